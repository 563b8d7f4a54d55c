"""docs/benchmarks.md's GIL probe command, taken from the doc and run as written (its result goes to a scratch file
instead of the committed one): the figures its row reports come out of it."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.nixl

ROOT = Path(__file__).resolve().parents[3]


def _doc_command() -> str:
    rows = [line for line in (ROOT / "docs" / "benchmarks.md").read_text().splitlines()
            if line.startswith("|") and "python -m bench dataplane gil" in line]
    [row] = rows
    [command] = re.findall(r"`(python -m bench dataplane gil[^`]*)`", row)
    return command


def test_the_documented_gil_probe_runs_and_tells_a_released_gil_from_a_kept_one(tmp_path):
    command = _doc_command()
    out = tmp_path / "gil.json"
    argv = [sys.executable, *shlex.split(command)[1:], "--out", str(out)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    calls = {c["call"]: c for c in json.loads(out.read_text())["voluntary"]["calls"]}
    # With no forced hand-over, the counter runs only while the caller released the GIL.
    assert calls["control: Python loop, keeps the GIL"]["calls_with_counter_inside"] == 0
    assert calls["control: time.sleep(0.001), releases the GIL"]["calls_with_counter_inside"] > 0
    longest = max(int(n) for n in re.findall(r"--descriptors ([\d ]+)", command)[0].split())
    assert calls[f"transfer, {longest} descriptors"]["calls_with_counter_inside"] > 0
