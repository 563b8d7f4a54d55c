"""Does NIXL's Python binding release the GIL while it posts a transfer? (bench/results/nixl_gil_probe.json)

Two in-process UCX agents over DRAM; one thread appends a timestamp in a tight loop while the main thread
posts WRITEs of N non-contiguous 4 KiB descriptors. The loop's timestamps that fall inside `transfer()` (and
inside `make_prepped_xfer()`) say whether another Python thread ran meanwhile: none means the call held the GIL
for its whole duration, so in an engine's process it delays the forward thread by that long. The counter's
longest pause overlapping each call says the same in milliseconds. The probe sets a 100 µs switch interval, so
hand-overs between bytecodes pause the counter far less than a call that keeps the GIL. A control row times
time.sleep(0.001), which releases the GIL. Run it on a quiet machine: a loaded one preempts the poster between
its timestamps, and the counter's slices then land inside the measured span.

    .venv/bin/python bench/nixl_gil_probe.py --descriptors 250 1000 --repeats 30
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_io import write_result  # bench/, this script's folder

_SIZE = 4096


def probe(descriptor_counts: list[int], repeats: int) -> dict:
    from nixl._api import nixl_agent, nixl_agent_config

    total = 2 * max(descriptor_counts)
    source = nixl_agent("gil-probe-src", nixl_agent_config(backends=["UCX"]))
    target = nixl_agent("gil-probe-dst", nixl_agent_config(backends=["UCX"]))
    src = np.ones(total * _SIZE, dtype=np.uint8)
    dst = np.zeros(total * _SIZE, dtype=np.uint8)
    source.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    target.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    source.add_remote_agent(target.get_agent_metadata())
    local = source.prep_xfer_dlist("NIXL_INIT_AGENT", [(src.ctypes.data + i * _SIZE, _SIZE, 0) for i in range(total)],
                                   "DRAM")
    remote = source.prep_xfer_dlist("gil-probe-dst", [(dst.ctypes.data + i * _SIZE, _SIZE, 0) for i in range(total)],
                                    "DRAM")
    # Hand the GIL over every 100 µs (not 5 ms) between bytecodes: then only a C call that keeps it pauses the
    # counter for long, and the pause measures that call.
    sys.setswitchinterval(0.0001)
    stamps: list[float] = []
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            stamps.append(time.perf_counter())

    counter = threading.Thread(target=count, name="gil-probe-counter")
    counter.start()
    time.sleep(0.1)
    calls: dict[int, list[tuple[float, float, float]]] = {n: [] for n in descriptor_counts}
    for n in descriptor_counts:
        indices = np.arange(0, 2 * n, 2, dtype=np.int32)  # every other block: n descriptors, none merged
        for _ in range(repeats):
            made = time.perf_counter()
            handle = source.make_prepped_xfer("WRITE", local, indices, remote, indices)
            posting = time.perf_counter()
            source.transfer(handle)
            posted = time.perf_counter()
            calls[n].append((made, posting, posted))
            while source.check_xfer_state(handle) == "PROC":
                time.sleep(0.0005)
            source.release_xfer_handle(handle)
            time.sleep(0.005)  # let the counter run between calls
    # Control: a call that releases the GIL for a similar time (the counter runs all through it).
    control: list[tuple[float, float]] = []
    for _ in range(repeats):
        start = time.perf_counter()
        time.sleep(0.001)
        control.append((start, time.perf_counter()))
        time.sleep(0.005)
    stop.set()
    counter.join()

    def inside(start: float, end: float) -> int:
        return bisect.bisect_left(stamps, end) - bisect.bisect_left(stamps, start)

    def longest_pause_ms(start: float, end: float) -> float:
        """The counter's longest pause overlapping [start, end]: a call that holds the GIL pauses it throughout."""
        first = max(0, bisect.bisect_left(stamps, start) - 1)
        last = min(len(stamps) - 1, bisect.bisect_right(stamps, end))
        window = stamps[first:last + 1]
        return 1e3 * max((b - a for a, b in itertools.pairwise(window)), default=0.0)

    results = []
    for n, spans in calls.items():
        transfer_ms = [1e3 * (end - start) for _, start, end in spans]
        make_ms = [1e3 * (posting - made) for made, posting, _ in spans]
        results.append({
            "descriptor_count": n,
            "transfer_ms_median": statistics.median(transfer_ms), "transfer_ms_max": max(transfer_ms),
            "make_prepped_xfer_ms_median": statistics.median(make_ms),
            # The counter may also run in the bytecodes between a timestamp and the call (the eval loop hands the
            # GIL over at its switch interval): a call that released the GIL shows iterations in most repeats.
            "counter_iterations_inside_transfer_median": statistics.median(inside(s, e) for _, s, e in spans),
            "transfers_with_no_counter_iteration": sum(inside(s, e) == 0 for _, s, e in spans),
            "counter_iterations_inside_make_median": statistics.median(inside(m, p) for m, p, _ in spans),
            "counter_longest_pause_ms_median": statistics.median(longest_pause_ms(s, e) for _, s, e in spans),
        })
    results.append({"control": "time.sleep(0.001), releases the GIL",
                    "call_ms_median": statistics.median(1e3 * (e - s) for s, e in control),
                    "counter_iterations_inside_median": statistics.median(inside(s, e) for s, e in control),
                    "calls_with_no_counter_iteration": sum(inside(s, e) == 0 for s, e in control),
                    "counter_longest_pause_ms_median": statistics.median(longest_pause_ms(s, e) for s, e in control)})
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return {"repeats": repeats, "counter_iterations": len(stamps),
            "counter_iteration_us_median": 1e6 * statistics.median(gaps) if gaps else None, "calls": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--descriptors", type=int, nargs="+", default=[250, 1000])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "nixl_gil_probe.json")
    args = parser.parse_args()
    result = probe(args.descriptors, args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
