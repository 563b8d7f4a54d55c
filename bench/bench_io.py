"""What every benchmark does with its result: print it as JSON and keep it in a timestamped file."""

from __future__ import annotations

import json
import time
from pathlib import Path


def emit(result: dict, out_dir: Path, prefix: str) -> Path:
    """Print `result` as JSON and write it to `out_dir`/`prefix`-<UTC time>.json (the folder made if need be)."""
    text = json.dumps(result, indent=2)
    print(text)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{prefix}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    path.write_text(text + "\n")
    return path
