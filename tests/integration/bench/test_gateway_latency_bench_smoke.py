"""`python -m bench gateway latency`, a few rounds: every kind answers through real gateways and the output's form."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_a_short_run_measures_every_kind_against_the_prefill_alone(tmp_path):
    """Three rounds of every kind (a B gateway with other flags included) complete; no first event comes before the
    stand-in prefill's 15 ms, and each gateway kind has its difference from `direct` with an interval."""
    args = ["--rounds", "3", "--warmup", "1", "--gap-s", "0", "--gateway-b-args=--no-uvloop", "--out", str(tmp_path)]
    done = subprocess.run([sys.executable, "-m", "bench", "gateway", "latency", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    (written,) = tmp_path.glob("gateway-latency-*.json")
    result = json.loads(written.read_text())
    assert result == json.loads(done.stdout[done.stdout.index("{"):])
    assert result["command"] == "python -m bench gateway latency " + " ".join(args)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert result["commit"] == head and result["machine"]["cores"] and result["date"].endswith("Z")
    assert result["config"]["kinds"] == ["direct", "standalone", "hosted", "standalone_b"]
    for kind, ttft_ms in result["ttft_median_ms"].items():
        assert ttft_ms >= 15.0, (kind, ttft_ms)
    for kind in ("standalone", "hosted", "standalone_b"):
        low, high = result["over_direct_ci95"][kind]
        assert low <= result["over_direct_median_ms"][kind] <= high, (kind, result)
    assert isinstance(result["standalone_b_minus_standalone_median_ms"], float)
