"""Does NIXL's binding hand the GIL back while it makes and posts a transfer? (bench/results/nixl_gil_release.json)

Two in-process UCX agents over DRAM; a counter thread appends timestamps while the main thread makes and posts WRITEs
of N non-contiguous 4 KiB descriptors. A timestamp that falls inside a call means the counter ran Python meanwhile.
Two ways of letting it run, side by side in one run, on the same agents and descriptors:

- `voluntary`: a 100 s switch interval, so the GIL is never taken from the main thread; the counter hands it back
  after each timestamp (time.sleep(0)). A timestamp inside a call then means the call released the GIL itself.
  None means little on its own: the counter also needs a core within the call (on a loaded machine it often has
  none for a ~1 ms call). Two controls calibrate it: a pure-Python loop of ~1 ms, which keeps the GIL and must show
  none, and time.sleep(0.001), which releases it. First contacts (`add_remote_agent` of a fresh agent) are probed
  this way too.
- `forced`: a 100 µs switch interval and a counter that never yields, as a thread running Python next to the
  poster sees it: a call that keeps the GIL pauses the counter throughout, hand-overs between bytecodes briefly; its
  longest pause overlapping each call is given too. CPU contention pauses it as well.

    python -m bench dataplane gil --descriptors 250 1000 4000 --repeats 30
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_io import write_result  # bench/, this script's folder

_SIZE = 4096
_VOLUNTARY_SWITCH_S = 100.0  # longer than the run: the eval loop never takes the GIL from a thread
_FORCED_SWITCH_S = 0.0001
_HOLD_LOOP = 30_000  # sum(range(_HOLD_LOOP)): ~1 ms of C that keeps the GIL


class Counter:
    """A thread appending perf_counter() stamps; `voluntary` hands the GIL back after each one."""

    def __init__(self, voluntary: bool) -> None:
        self.stamps: list[float] = []
        self._stop = threading.Event()
        self._voluntary = voluntary
        self._thread = threading.Thread(target=self._run, name="gil-probe-counter")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        stamps, stop = self.stamps, self._stop
        if self._voluntary:
            while not stop.is_set():
                stamps.append(time.perf_counter())
                time.sleep(0)
        else:
            while not stop.is_set():
                stamps.append(time.perf_counter())

    def inside(self, start: float, end: float) -> int:
        return bisect.bisect_left(self.stamps, end) - bisect.bisect_left(self.stamps, start)

    def longest_pause_ms(self, start: float, end: float) -> float:
        """The counter's longest pause overlapping [start, end]."""
        first = max(0, bisect.bisect_left(self.stamps, start) - 1)
        last = min(len(self.stamps) - 1, bisect.bisect_right(self.stamps, end))
        window = self.stamps[first:last + 1]
        return 1e3 * max((b - a for a, b in itertools.pairwise(window)), default=0.0)


@contextmanager
def counting(voluntary: bool) -> Iterator[Counter]:
    previous = sys.getswitchinterval()
    sys.setswitchinterval(_VOLUNTARY_SWITCH_S if voluntary else _FORCED_SWITCH_S)
    counter = Counter(voluntary)
    counter.start()
    time.sleep(0.1)
    try:
        yield counter
    finally:
        counter.stop()
        sys.setswitchinterval(previous)


class Spans:
    """(start, end) of each call, by row name; rows keep their first-seen order."""

    def __init__(self) -> None:
        self.rows: dict[str, list[tuple[float, float]]] = {}

    def time(self, row: str, call: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        value = call()
        self.rows.setdefault(row, []).append((start, time.perf_counter()))
        return value

    def summary(self, counter: Counter, pauses: bool) -> list[dict[str, Any]]:
        out = []
        for row, spans in self.rows.items():
            ms = [1e3 * (end - start) for start, end in spans]
            inside = [counter.inside(start, end) for start, end in spans]
            entry: dict[str, Any] = {
                "call": row, "calls": len(spans),
                "call_ms_median": statistics.median(ms), "call_ms_max": max(ms),
                "calls_with_counter_inside": sum(n > 0 for n in inside),
                "counter_iterations_inside_median": statistics.median(inside),
            }
            if pauses:
                entry["counter_longest_pause_ms_median"] = statistics.median(
                    counter.longest_pause_ms(start, end) for start, end in spans)
            out.append(entry)
        return out


def probe(descriptor_counts: list[int], repeats: int, first_contacts: int) -> dict[str, Any]:
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
    # Agents for first contacts are made before counting: making one takes ~0.5 s, most of it holding the GIL.
    fresh = [nixl_agent(f"gil-probe-peer-{i}", nixl_agent_config(backends=["UCX"])) for i in range(first_contacts)]
    peer_buffers = [np.zeros(_SIZE, dtype=np.uint8) for _ in fresh]
    for agent, buffer in zip(fresh, peer_buffers, strict=True):
        agent.register_memory([(buffer.ctypes.data, buffer.nbytes, 0, "")], "DRAM")
    peer_metadata = [agent.get_agent_metadata() for agent in fresh]

    def write(spans: Spans, n: int, indices: np.ndarray, voluntary: bool) -> None:
        handle = spans.time(f"make_prepped_xfer, {n} descriptors",
                            lambda: source.make_prepped_xfer("WRITE", local, indices, remote, indices))
        state = spans.time(f"transfer, {n} descriptors", lambda: source.transfer(handle))
        if voluntary:
            state = spans.time(f"check_xfer_state, {n} descriptors", lambda: source.check_xfer_state(handle))
        while state == "PROC":
            time.sleep(0.0005)
            state = source.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"WRITE of {n} descriptors ended {state}")
        source.release_xfer_handle(handle)
        time.sleep(0.005)  # let the counter run between calls

    result: dict[str, Any] = {"repeats": repeats, "descriptor_counts": descriptor_counts}
    for mode in ("voluntary", "forced"):
        voluntary = mode == "voluntary"
        spans = Spans()
        with counting(voluntary) as counter:
            for n in descriptor_counts:
                indices = np.arange(0, 2 * n, 2, dtype=np.int32)  # every other block: n descriptors, none merged
                for _ in range(repeats):
                    write(spans, n, indices, voluntary)
            for _ in range(repeats):
                spans.time("control: Python loop, keeps the GIL", lambda: sum(range(_HOLD_LOOP)))
                time.sleep(0.005)
            for _ in range(repeats):
                spans.time("control: time.sleep(0.001), releases the GIL", lambda: time.sleep(0.001))
                time.sleep(0.005)
            if voluntary:
                for metadata in peer_metadata:
                    spans.time("add_remote_agent (first contact)",
                               lambda metadata=metadata: source.add_remote_agent(metadata))
                    time.sleep(0.005)
        gaps = [b - a for a, b in itertools.pairwise(counter.stamps)]
        result[mode] = {
            "switch_interval_s": _VOLUNTARY_SWITCH_S if voluntary else _FORCED_SWITCH_S,
            "counter_iterations": len(counter.stamps),
            "counter_iteration_us_median": 1e6 * statistics.median(gaps) if gaps else None,
            "calls": spans.summary(counter, pauses=not voluntary),
        }
    if not np.all(dst[::2 * _SIZE] == 1):  # the first byte of every block the largest WRITE covered
        raise RuntimeError("the WRITEs did not land")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--descriptors", type=int, nargs="+", default=[250, 1000])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--first-contacts", type=int, default=5, help="fresh agents to add in the voluntary mode")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "nixl_gil_release.json")
    args = parser.parse_args()
    result = probe(args.descriptors, args.repeats, args.first_contacts)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
