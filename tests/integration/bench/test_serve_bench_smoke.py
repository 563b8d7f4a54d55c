"""`python -m bench serve --smoke`: one real `vllm bench serve` run per variant, and the output's form."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engines

ROOT = Path(__file__).resolve().parents[3]


def test_smoke_run_writes_json_and_plot(tmp_path):
    """The CI form (tiny model, colocated and kvpush with first token, 4 requests) completes every request
    and writes the JSON (settings, per-variant points with TTFT/TPOT/ITL) and its PNG."""
    out = tmp_path / "serve.json"
    done = subprocess.run([sys.executable, "-m", "bench", "serve", "--smoke", "--out", str(out),
                           "--log-dir", str(tmp_path / "logs")], cwd=ROOT, capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["benchmark"] == "serve" and result["settings"]["isl"] == 64
    assert result["command"].startswith("python -m bench serve --smoke --out ") and result["machine"]["cores"]
    assert set(result["variants"]) == {"colocated", "kvpush-first-token"}
    for variant, data in result["variants"].items():
        point = data["points"]["8.0"]
        assert "error" not in point, (variant, point)
        assert point["completed"] == 4 and point["failed"] == 0, (variant, point)
        for key in ("mean_ttft_ms", "p99_ttft_ms", "request_throughput"):
            assert point[key] > 0, (variant, key, point)
        for key in ("mean_tpot_ms", "p50_itl_ms", "p99_e2el_ms"):  # a tiny engine can send 4 tokens in one chunk
            assert point[key] >= 0, (variant, key, point)
    assert "kvpush-first-token/colocated" in result["ratios"]
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
