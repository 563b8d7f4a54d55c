"""bench/gpu_profile.py's I/O-loop summary and variants: rows inside a transfer's write window, call counts and
durations, the prefill worker's trace file told from decode's."""

from __future__ import annotations

import json

import pytest

from tests.fixtures.bench_scripts import load_bench

ROWS = [
    {"t": 99.9, "late_ms": 9.0, "done": 0, "check": [1, 5.0, 5.0]},             # before the window
    {"t": 100.000, "late_ms": 0.1, "done": 0, "post": [1, 0.2, 0.2], "event": [2, 0.01, 0.006]},
    {"t": 100.004, "late_ms": 4.9, "done": 1, "check": [2, 9.8, 5.1]},
    {"t": 100.010, "late_ms": 0.0, "done": 2, "check": [2, 0.1, 0.06], "notif": [1, 0.02, 0.02]},
    {"t": 100.5, "late_ms": 0.0, "done": 0, "check": [1, 1.0, 1.0]},              # after it
]


def test_io_summary_covers_the_window_only():
    io = load_bench("gpu_profile").summarise_io(ROWS, 100.0, 100.02)
    assert (io["iterations"], io["handles_done"]) == (3, 3)
    assert io["check"]["calls"] == 4 and io["check"]["total_ms"] == pytest.approx(9.9)
    assert io["check"]["longest_ms"] == 5.1 and io["check"]["mean_ms"] == pytest.approx(2.475)
    assert io["post"]["calls"] == 1 and io["event"]["calls"] == 2
    assert io["late_ms"]["max"] == 4.9 and io["iteration_gap_ms"]["max"] == pytest.approx(6.0)


def test_an_empty_window_counts_nothing():
    assert load_bench("gpu_profile").summarise_io(ROWS, 200.0, 201.0) == {"iterations": 0, "handles_done": 0}


def test_the_trace_that_posted_is_the_prefill_workers(tmp_path):
    (tmp_path / "1-decode.jsonl").write_text("\n".join(json.dumps(r) for r in [{"t": 1.0, "late_ms": 0, "done": 0,
                                                                                  "notif": [1, 0.1, 0.1]}] * 9))
    (tmp_path / "2-prefill.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n" +
                                              json.dumps({"dropped_rows": 3}) + "\n")
    rows = load_bench("gpu_profile")._read_io_traces(tmp_path)
    assert rows == ROWS


def test_variants_parse_or_refuse():
    parse = load_bench("gpu_profile")._parse_variants
    assert parse([]) == [("default", {})]
    assert parse(['a={"gil_switch_interval_s": 0.0002}', "b={}"]) == [("a", {"gil_switch_interval_s": 0.0002}),
                                                                      ("b", {})]
    with pytest.raises(SystemExit, match="NAME=JSON"):
        parse(["nojson"])
