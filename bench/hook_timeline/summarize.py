"""Where a prefill step's time goes, with a push and without, from `sitecustomize.py`'s timelines.

    python bench/hook_timeline/summarize.py /tmp/timeline --min-tokens 256 --out bench/results/x.json

Takes every prefill step of the prefill engine (a bind_connector_metadata of the prefill role whose step scheduled
at least --min-tokens tokens and saved every layer before wait_for_save), groups the steps into plain (no push),
push_no_writes (a push whose writes were not posted in the step: no decode side yet, as hops_bench's p_leg) and
push_writes, and prints each stage's median per group and its difference from plain, and the median gap between
consecutive layers' hooks.

Stages (ms): to_bind (Scheduler.schedule end -> bind_connector_metadata), forward (bind end -> wait_for_save: the
host's forward, hooks included), first_layer (bind end -> the first save_kv_layer), after_first_layer (the first
save_kv_layer -> the second: where the first layer's post wakes the connector's threads), save_hooks (the sum of
save_kv_layer calls), io_thread_during_forward (the data plane's I/O thread running the owner's commands while
the forward ran; io_commands_during_forward counts them), writes_posted, wait_for_save, to_update and update
(wait_for_save end -> Scheduler.update_from_output of the step, and its duration; request_finished inside it),
to_frontend (update end -> the next process_outputs of an API server), total (schedule start -> that
process_outputs).
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_io import write_result  # bench/, the folder above

STAGES = ("to_bind", "forward", "first_layer", "after_first_layer", "save_hooks", "save_calls",
          "io_thread_during_forward", "io_commands_during_forward", "writes_posted", "wait_for_save", "to_update",
          "update", "request_finished", "to_frontend", "total")
MS = 1e-6
WINDOW_NS = 200_000_000


def load(folder: Path) -> dict[int, list[list]]:
    """pid -> events [start_ns, end_ns, thread, name, facts], sorted by start."""
    by_pid: dict[int, list[list]] = {}
    for path in folder.glob("*.jsonl"):
        events = [e for e in (json.loads(line) for line in path.read_text().splitlines() if line.strip())
                  if isinstance(e, list)]
        if events:
            by_pid[int(path.stem)] = sorted(events, key=lambda e: e[0])
    return by_pid


def _prefill_pids(by_pid: dict[int, list[list]]) -> set[int]:
    return {pid for pid, events in by_pid.items()
            if any(e[3] in ("bind_connector_metadata", "build_connector_meta", "schedule")
                   and (e[4] or {}).get("prefill") for e in events)}


def prefill_steps(by_pid: dict[int, list[list]], min_tokens: int) -> list[dict]:
    """One dict of stage durations (ms) per prefill step of the prefill engine."""
    prefill = _prefill_pids(by_pid)
    engine = sorted((e for pid in prefill for e in by_pid[pid]), key=lambda e: e[0])
    schedules = [e for e in engine if e[3] == "schedule"]
    schedule_starts = [e[0] for e in schedules]
    updates = [e for e in engine if e[3] == "update_from_output"]
    update_starts = [e[0] for e in updates]
    finished = [e for e in engine if e[3] == "request_finished"]
    finished_starts = [e[0] for e in finished]
    frontends = sorted((e for events in by_pid.values() for e in events if e[3] == "process_outputs"),
                       key=lambda e: e[0])
    frontend_starts = [e[0] for e in frontends]
    steps = []
    for pid in prefill:
        events = by_pid[pid]
        starts = [e[0] for e in events]
        for i, bind in enumerate(events):
            if bind[3] != "bind_connector_metadata":
                continue
            j = bisect.bisect_right(schedule_starts, bind[0]) - 1
            if j < 0 or bind[0] - schedules[j][1] > WINDOW_NS:
                continue
            schedule = schedules[j]
            tokens = (schedule[4] or {}).get("tokens", -1)
            if tokens < min_tokens:
                continue
            saves, wait = [], None
            for event in events[i + 1:]:
                if event[2] != bind[2]:
                    continue
                if event[3] == "save_kv_layer":
                    saves.append(event)
                elif event[3] == "wait_for_save":
                    wait = event
                    break
                elif event[3] == "bind_connector_metadata":
                    break
            if wait is None or len(saves) < 2:
                continue
            window = events[bisect.bisect_left(starts, bind[1] - 50_000_000):bisect.bisect_right(starts, wait[0])]
            commands = [e for e in window if e[2] != bind[2] and e[3] == "_run_command" and e[1] > bind[1]]
            # The forward's writes are posted during it or right after wait_for_save (layers held to the step's end).
            posted = events[bisect.bisect_left(starts, bind[1]):bisect.bisect_right(starts, wait[1] + 20_000_000)]
            writes = [e for e in posted if e[3] == "_post"]
            pushes = bool((bind[4] or {}).get("pushes"))
            layer_times = [bind[1]] + [e[0] for e in saves] + [wait[0]]
            step = {"kind": ("push_writes" if writes else "push_no_writes") if pushes else "plain", "tokens": tokens,
                    "start_ns": bind[0], "layer_gaps": [(b - a) * MS for a, b in itertools.pairwise(layer_times)],
                    "to_bind": (bind[0] - schedule[1]) * MS, "forward": (wait[0] - bind[1]) * MS,
                    "first_layer": (saves[0][0] - bind[1]) * MS, "after_first_layer": (saves[1][0] - saves[0][0]) * MS,
                    "save_hooks": sum(e[1] - e[0] for e in saves) * MS, "save_calls": len(saves),
                    "io_thread_during_forward": sum(min(e[1], wait[0]) - max(e[0], bind[1]) for e in commands) * MS,
                    "io_commands_during_forward": len(commands), "writes_posted": len(writes),
                    "wait_for_save": (wait[1] - wait[0]) * MS}
            k = bisect.bisect_left(update_starts, wait[1])
            while (k < len(updates) and updates[k][0] - wait[1] < WINDOW_NS
                   and (updates[k][4] or {}).get("tokens") != tokens):
                k += 1
            if k < len(updates) and updates[k][0] - wait[1] < WINDOW_NS:
                update = updates[k]
                step["to_update"], step["update"] = (update[0] - wait[1]) * MS, (update[1] - update[0]) * MS
                inside = finished[bisect.bisect_left(finished_starts, update[0]):
                                  bisect.bisect_right(finished_starts, update[1])]
                step["request_finished"] = sum(e[1] - e[0] for e in inside) * MS
                f = bisect.bisect_left(frontend_starts, update[1])
                if f < len(frontends) and frontends[f][0] - update[1] < 100_000_000:
                    step["to_frontend"] = (frontends[f][0] - update[1]) * MS
                    step["total"] = (frontends[f][0] - schedule[0]) * MS
            steps.append(step)
    return sorted(steps, key=lambda s: s["start_ns"])


def summarize(steps: list[dict]) -> dict:
    groups: dict[str, list[dict]] = defaultdict(list)
    for step in steps:
        groups[step["kind"]].append(step)
    medians: dict[str, dict] = {}
    for group, members in groups.items():
        medians[group] = {stage: round(statistics.median(v), 3)
                          for stage in STAGES if (v := [s[stage] for s in members if stage in s])}
        medians[group]["steps"] = len(members)
        depth = min(len(s["layer_gaps"]) for s in members)
        medians[group]["layer_gaps"] = [round(statistics.median(s["layer_gaps"][g] for s in members), 3)
                                        for g in range(depth)]
    for kind in ("push_no_writes", "push_writes"):
        if kind in medians and "plain" in medians:
            medians[f"{kind}_minus_plain"] = {
                stage: round(medians[kind][stage] - medians["plain"][stage], 3)
                for stage in STAGES if stage in medians[kind] and stage in medians["plain"]}
    return medians


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--min-tokens", type=int, default=256)
    parser.add_argument("--label", default="", help="what the run measured, kept in the JSON")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    steps = prefill_steps(load(args.folder), args.min_tokens)
    summary = {"bench": "hook_timeline", "label": args.label, "min_tokens": args.min_tokens,
               "median_ms": summarize(steps), "steps": steps}
    print(json.dumps({k: {s: v for s, v in m.items() if s != "layer_gaps"} for k, m in summary["median_ms"].items()},
                     indent=1))
    if args.out:
        write_result(args.out, summary, indent=1, echo=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
