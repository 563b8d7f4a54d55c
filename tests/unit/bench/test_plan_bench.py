"""bench/plan_bench.py's hook case drives the real prefill worker through stand-ins of its collaborators: when the
worker's ports change and a stand-in no longer fits, the case must fail, not report its 10 s bound as a figure."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _plan_bench():
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("plan_bench_under_test", ROOT / "bench" / "plan_bench.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_layer_write_is_submitted_through_the_worker() -> None:
    result = _plan_bench().run_save_kv_layer_case(reps=1)
    assert result["one_owner_worker"] is True
    assert 0 < result["until_submitted_ms"] < 5_000, result
    assert result["forward_us_per_layer"] > 0
