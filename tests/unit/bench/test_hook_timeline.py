"""A prefill step's stages from recorded calls (bench/hook_timeline/summarize.py), on a hand-made timeline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.fixtures.bench_scripts import load_bench

ENGINE, IO, FRONTEND = 1, 2, 3  # thread ids


def _step(t0: int, pushes: bool, tokens: int = 512, writes: bool = False) -> list[list]:
    """One step of the prefill engine (UniProcExecutor: the engine core, the worker and the I/O thread in one
    process), times in µs from t0."""
    us = 1000
    events = [
        [t0, t0 + 100 * us, ENGINE, "schedule", {"tokens": tokens, "new": 1, "prefill": True}],
        [t0 + 1000 * us, t0 + 1010 * us, ENGINE, "bind_connector_metadata", {"pushes": pushes, "prefill": True}],
        [t0 + 2000 * us, t0 + 2050 * us, ENGINE, "save_kv_layer", None],
        [t0 + 2100 * us, t0 + 2300 * us, IO, "_run_command", None],
        [t0 + 3000 * us, t0 + 3040 * us, ENGINE, "save_kv_layer", None],
        [t0 + 5000 * us, t0 + 5100 * us, ENGINE, "wait_for_save", None],
        [t0 + 8000 * us, t0 + 8200 * us, ENGINE, "update_from_output", {"tokens": tokens, "new": 1, "prefill": True}],
        [t0 + 8050 * us, t0 + 8070 * us, ENGINE, "request_finished", {"request_id": "r", "prefill": True}],
    ]
    if writes:
        events.append([t0 + 5200 * us, t0 + 7200 * us, IO, "_post", None])
    return events


@pytest.fixture
def timeline(tmp_path: Path) -> Path:
    ms = 1_000_000
    engine = _step(0, pushes=True, writes=True) + _step(100 * ms, pushes=False) + _step(200 * ms, pushes=True, tokens=8)
    frontend = [[t + 9 * ms, t + 9 * ms + 100_000, FRONTEND, "process_outputs", {"outputs": 1}] for t in (0, 100 * ms)]
    for pid, events in ((100, engine), (200, frontend)):
        lines = [json.dumps({"pid": pid, "argv": []})] + [json.dumps(e) for e in events]
        (tmp_path / f"{pid}.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path


def test_each_prefill_step_is_split_into_its_stages(timeline: Path):
    summarize = load_bench("hook_timeline/summarize")
    steps = summarize.prefill_steps(summarize.load(timeline), min_tokens=256)
    assert [step["kind"] for step in steps] == ["push_writes", "plain"], "the 8-token step is not a prefill"
    push = steps[0]
    assert push["forward"] == pytest.approx(3.99)  # bind end -> wait_for_save
    assert push["save_hooks"] == pytest.approx(0.09) and push["save_calls"] == 2
    assert push["after_first_layer"] == pytest.approx(1.0)
    assert push["io_thread_during_forward"] == pytest.approx(0.2) and push["io_commands_during_forward"] == 1
    assert push["writes_posted"] == 1 and steps[1]["writes_posted"] == 0
    assert push["to_update"] == pytest.approx(2.9) and push["update"] == pytest.approx(0.2)
    assert push["request_finished"] == pytest.approx(0.02)
    assert push["to_frontend"] == pytest.approx(0.8) and push["total"] == pytest.approx(9.0)
    assert push["layer_gaps"] == pytest.approx([0.99, 1.0, 2.0])
    medians = summarize.summarize(steps)
    assert medians["push_writes_minus_plain"]["writes_posted"] == 1
    assert medians["plain"]["steps"] == 1
