"""Where the prefill engine's NIXL copies wait: a summary of an Nsight Systems trace of `gpu_e2e.py hops`.

Reads the SQLite export of an `nsys profile --trace=cuda` report (`nsys export --type sqlite`) and, for every
process, its CUDA streams (with their priorities), kernels and copies. The process that issues the most
device-to-device or peer copies is the prefill engine (its UCX `cuda_ipc` copies into the decode engine's blocks).
For each such copy it reports when it was enqueued (the driver call on the CPU), when it ran on the GPU and how long,
and what else the GPU ran in between: the same process's kernels (the forward) and other processes' kernels (time
slicing between contexts). JSON out, standard library only (it runs on the GPU machine).

    python3 bench/gpu_nsys_summary.py trace.sqlite > summary.json
"""

from __future__ import annotations

import bisect
import json
import sqlite3
import statistics
import sys
from collections import defaultdict
from typing import Any

# CUPTI copy kinds (CUpti_ActivityMemcpyKind).
COPY_KINDS = {1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD", 7: "DtoA", 8: "DtoD", 9: "HtoH",
              10: "PtoP"}
DEVICE_COPIES = (8, 10)
# Kernels closer than this belong to one busy window (a forward's kernels follow each other by microseconds).
WINDOW_GAP_NS = 500_000


def _tables(db: sqlite3.Connection) -> set[str]:
    return {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def _pid(global_pid: int) -> int:
    return (global_pid >> 24) & 0xFFFFFF


def _pid_of_global_tid(global_tid: int) -> int:
    return (global_tid >> 24) & 0xFFFFFF


def merge_windows(intervals: list[tuple[float, float]], gap: float) -> list[tuple[float, float]]:
    """Busy windows: intervals closer than `gap` merged (a forward's kernels follow each other closely)."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start - merged[-1][1] <= gap:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def busy(sorted_intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Time in [start, end] covered by the union of intervals (sorted by start)."""
    covered, cursor = 0.0, start
    for a, b in sorted_intervals:
        if b <= cursor or a >= end:
            continue
        a, b = max(a, cursor), min(b, end)
        if b > a:
            covered += b - a
            cursor = b
    return covered


def distribution(values: list[float]) -> dict[str, float]:
    """count, min, p50, p90 and max of `values` ({} when empty)."""
    if not values:
        return {}
    ordered = sorted(values)
    return {"count": len(ordered), "min": round(ordered[0], 3), "p50": round(statistics.median(ordered), 3),
            "p90": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 3), "max": round(ordered[-1], 3)}


def summarize(path: str) -> dict[str, Any]:
    db = sqlite3.connect(path)
    tables = _tables(db)
    names = dict(db.execute("SELECT id, value FROM StringIds")) if "StringIds" in tables else {}
    streams: dict[tuple[int, int], dict[str, Any]] = {}
    if "TARGET_INFO_CUDA_STREAM" in tables:
        cursor = db.execute("SELECT * FROM TARGET_INFO_CUDA_STREAM")
        columns = [d[0] for d in cursor.description]
        for row in cursor:
            record = dict(zip(columns, row))
            pid = _pid(record["globalPid"]) if record.get("globalPid") else record.get("processId")
            streams[(pid, record["streamId"])] = record
    kernels: dict[int, list[tuple[int, int, int]]] = defaultdict(list)  # pid -> (start, end, stream)
    for start, end, gpid, stream in db.execute(
            "SELECT start, end, globalPid, streamId FROM CUPTI_ACTIVITY_KIND_KERNEL"):
        kernels[_pid(gpid)].append((start, end, stream))
    copies: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for start, end, gpid, stream, kind, size, corr in db.execute(
            "SELECT start, end, globalPid, streamId, copyKind, bytes, correlationId FROM CUPTI_ACTIVITY_KIND_MEMCPY"):
        copies[_pid(gpid)].append({"start": start, "end": end, "stream": stream, "kind": kind, "bytes": size,
                                   "correlation": corr})
    api: dict[tuple[int, int], tuple[int, int, str, int]] = {}  # (pid, correlation) -> call start, end, name, tid
    if "CUPTI_ACTIVITY_KIND_RUNTIME" in tables:
        for start, end, gtid, corr, name_id in db.execute(
                "SELECT start, end, globalTid, correlationId, nameId FROM CUPTI_ACTIVITY_KIND_RUNTIME"):
            api[(_pid_of_global_tid(gtid), corr)] = (start, end, names.get(name_id, str(name_id)), gtid & 0xFFFFFF)

    processes = {}
    for pid in sorted(set(kernels) | set(copies)):
        by_kind: dict[str, int] = defaultdict(int)
        for c in copies[pid]:
            by_kind[COPY_KINDS.get(c["kind"], str(c["kind"]))] += 1
        stream_kernels: dict[int, int] = defaultdict(int)
        for _, _, stream in kernels[pid]:
            stream_kernels[stream] += 1
        processes[pid] = {
            "kernels": len(kernels[pid]), "copies": dict(by_kind),
            "streams": {str(s): {"kernels": n, "priority": streams.get((pid, s), {}).get("priority")}
                        for s, n in sorted(stream_kernels.items(), key=lambda kv: -kv[1])[:8]},
        }
    prefill = max(copies, key=lambda p: sum(c["kind"] in DEVICE_COPIES for c in copies[p]), default=None)
    report: dict[str, Any] = {"trace": path, "processes": {str(p): v for p, v in processes.items()},
                              "prefill_pid": prefill}
    if prefill is None:
        return report
    pushes = sorted((c for c in copies[prefill] if c["kind"] in DEVICE_COPIES), key=lambda c: c["start"])
    # The copies' own streams: those that run device copies and no kernel (vLLM's compute stream also copies).
    copy_streams = {c["stream"] for c in pushes} - {stream for _, _, stream in kernels[prefill]}
    pushes = [c for c in pushes if c["stream"] in copy_streams]
    own = sorted((s, e) for s, e, _ in kernels[prefill])
    other = sorted((s, e) for pid, ks in kernels.items() if pid != prefill for s, e, _ in ks)
    windows = merge_windows(own, WINDOW_GAP_NS)
    window_starts = [w[0] for w in windows]
    rows = []
    for c in pushes:
        call = api.get((prefill, c["correlation"]))
        enqueued = call[0] if call else None
        i = bisect.bisect_right(window_starts, c["start"]) - 1
        inside = i >= 0 and windows[i][0] <= c["start"] <= windows[i][1]
        row = {
            "bytes": c["bytes"], "kind": COPY_KINDS.get(c["kind"]), "stream": c["stream"],
            "stream_priority": streams.get((prefill, c["stream"]), {}).get("priority"),
            "api": call[2] if call else None, "api_tid": call[3] if call else None,
            "run_us": (c["end"] - c["start"]) / 1e3,
            "wait_us": (c["start"] - enqueued) / 1e3 if enqueued is not None else None,
            "started_inside_forward_window": inside,
            "forward_window_end_minus_copy_end_us": ((windows[i][1] - c["end"]) / 1e3) if inside else None,
        }
        if enqueued is not None:
            row["own_kernel_busy_during_wait_us"] = busy(own, enqueued, c["start"]) / 1e3
            row["other_process_kernel_busy_during_wait_us"] = busy(other, enqueued, c["start"]) / 1e3
            row["own_kernel_busy_during_run_us"] = busy(own, c["start"], c["end"]) / 1e3
            row["enqueued_ns"] = enqueued
        row["start_ns"], row["end_ns"] = c["start"], c["end"]
        rows.append(row)
    long_windows = [(a, b) for a, b in windows if b - a > 5_000_000]
    report["prefill"] = {
        "copy_streams": sorted(copy_streams),
        "copy_stream_priorities": {str(s): streams.get((prefill, s), {}).get("priority") for s in copy_streams},
        "compute_stream_priorities": {str(s): streams.get((prefill, s), {}).get("priority")
                                      for s in {st for _, _, st in kernels[prefill]} - copy_streams},
        "copies": len(rows),
        "copy_bytes": distribution([r["bytes"] for r in rows]),
        "wait_us": distribution([r["wait_us"] for r in rows if r["wait_us"] is not None]),
        "run_us": distribution([r["run_us"] for r in rows]),
        "started_inside_forward_window": sum(r["started_inside_forward_window"] for r in rows),
        "own_kernel_busy_during_wait_us": distribution([r["own_kernel_busy_during_wait_us"] for r in rows
                                                 if "own_kernel_busy_during_wait_us" in r]),
        "other_process_kernel_busy_during_wait_us": distribution([r["other_process_kernel_busy_during_wait_us"]
                                                           for r in rows
                                                           if "other_process_kernel_busy_during_wait_us" in r]),
        "own_kernel_busy_during_run_us": distribution([r["own_kernel_busy_during_run_us"] for r in rows
                                                if "own_kernel_busy_during_run_us" in r]),
        "forward_windows_over_5ms": [{"start_ns": a, "ms": round((b - a) / 1e6, 3)} for a, b in long_windows[-12:]],
        "copies_detail_last": rows[-200:],
    }
    return report


if __name__ == "__main__":
    json.dump(summarize(sys.argv[1]), sys.stdout, indent=1)
