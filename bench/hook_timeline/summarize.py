"""Where a prefill step's time goes, with a push and without, from `sitecustomize.py`'s timelines.

    python bench/hook_timeline/summarize.py /tmp/timeline --min-tokens 256 --out bench/results/x.json

Takes every prefill step of the prefill engine (execute_model with at least --min-tokens tokens scheduled), splits
it into the stages below from the recorded calls, groups the steps into plain (no push), push_no_writes (a push
whose writes were not posted in the step: no decode side yet, as hops_bench's p_leg) and push_writes, and prints
each stage's median per group and its difference from plain.

Stages (ms): io_thread_during_forward (the data plane's I/O thread running the owner's commands while the forward
ran, and how many: io_commands_during_forward), writes_posted (count), schedule (Scheduler.schedule), to_execute (schedule end -> execute_model), to_bind (execute_model start
-> bind_connector_metadata), forward (bind end -> wait_for_save: the host's forward, hooks included), save_hooks
(the sum of save_kv_layer calls), after_forward (wait_for_save start -> execute_model end: wait_for_save,
get_finished, the worker metadata), to_sample and sample (sample_tokens), to_update and update
(Scheduler.update_from_output; request_finished inside it), to_frontend (update end -> the API server's next
process_outputs), total (schedule start -> that process_outputs).
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
from collections import defaultdict
from pathlib import Path

STAGES = ("io_thread_during_forward", "io_commands_during_forward", "writes_posted", "schedule", "to_execute", "to_bind", "forward", "save_hooks", "save_calls", "after_forward", "to_sample",
          "sample", "to_update", "update", "request_finished", "to_frontend", "total")


def load(folder: Path) -> dict[int, list[list]]:
    """pid -> events [start_ns, end_ns, thread, name, facts], sorted by start."""
    by_pid: dict[int, list[list]] = {}
    for path in folder.glob("*.jsonl"):
        events = [e for e in (json.loads(line) for line in path.read_text().splitlines() if line.strip())
                  if isinstance(e, list)]
        if events:
            by_pid[int(path.stem)] = sorted(events, key=lambda e: e[0])
    return by_pid


def _first_after(events: list[list], starts: list[int], t: int, name: str, limit_ns: int,
                 tokens: int | None = None) -> list | None:
    i = bisect.bisect_left(starts, t)
    while i < len(events) and events[i][0] - t <= limit_ns:
        event = events[i]
        if event[3] == name and (tokens is None or (event[4] or {}).get("tokens") == tokens):
            return event
        i += 1
    return None


def _last_before(events: list[list], starts: list[int], t: int, name: str, limit_ns: int,
                 tokens: int | None = None) -> list | None:
    i = bisect.bisect_right(starts, t) - 1
    while i >= 0 and t - events[i][0] <= limit_ns:
        event = events[i]
        if event[3] == name and (tokens is None or (event[4] or {}).get("tokens") == tokens):
            return event
        i -= 1
    return None


def prefill_steps(by_pid: dict[int, list[list]], min_tokens: int) -> list[dict]:
    """One dict of stage durations (ms) per prefill step of every prefill worker process."""
    everything = sorted((e for events in by_pid.values() for e in events), key=lambda e: e[0])
    all_starts = [e[0] for e in everything]
    frontends = sorted((e for e in everything if e[3] == "process_outputs"), key=lambda e: e[0])
    frontend_starts = [e[0] for e in frontends]
    ms = 1e-6
    steps = []
    for pid, events in by_pid.items():
        if not any(e[3] == "bind_connector_metadata" and (e[4] or {}).get("prefill") for e in events):
            continue
        starts = [e[0] for e in events]
        for i, execute in enumerate(events):
            tokens = (execute[4] or {}).get("tokens", -1)
            if execute[3] != "execute_model" or tokens < min_tokens:
                continue
            inside = [e for e in events[i + 1:bisect.bisect_right(starts, execute[1])] if e[2] == execute[2]]
            bind = next((e for e in inside if e[3] == "bind_connector_metadata"), None)
            saves = [e for e in inside if e[3] == "save_kv_layer"]
            wait = next((e for e in inside if e[3] == "wait_for_save"), None)
            if bind is None or wait is None:
                continue
            others = [e for e in events[bisect.bisect_left(starts, bind[1] - 50_000_000):
                                        bisect.bisect_right(starts, wait[0])]
                      if e[2] != execute[2] and e[3] == "_run_command" and e[1] > bind[1]]
            # The forward's writes are posted during it or right after wait_for_save (layers held to the step's end).
            writes = [e for e in events[bisect.bisect_left(starts, bind[1]):
                                        bisect.bisect_right(starts, execute[1] + 20_000_000)] if e[3] == "_post"]
            pushes = bool((bind[4] or {}).get("pushes"))
            step = {"kind": ("push_writes" if writes else "push_no_writes") if pushes else "plain",
                    "tokens": tokens, "start_ns": execute[0],
                    "io_thread_during_forward": sum(min(e[1], wait[0]) - max(e[0], bind[1]) for e in others) * ms,
                    "io_commands_during_forward": len(others), "writes_posted": len(writes),
                    "to_bind": (bind[0] - execute[0]) * ms, "forward": (wait[0] - bind[1]) * ms,
                    "save_hooks": sum(e[1] - e[0] for e in saves) * ms, "save_calls": len(saves),
                    "after_forward": (execute[1] - wait[0]) * ms}
            schedule = _last_before(everything, all_starts, execute[0], "schedule", 200_000_000, tokens)
            if schedule is not None:
                step["schedule"] = (schedule[1] - schedule[0]) * ms
                step["to_execute"] = (execute[0] - schedule[1]) * ms
            sample = _first_after(events, starts, execute[1], "sample_tokens", 200_000_000)
            if sample is None:
                steps.append(step)
                continue
            step["to_sample"], step["sample"] = (sample[0] - execute[1]) * ms, (sample[1] - sample[0]) * ms
            update = _first_after(everything, all_starts, sample[1], "update_from_output", 200_000_000, tokens)
            if update is not None:
                step["to_update"], step["update"] = (update[0] - sample[1]) * ms, (update[1] - update[0]) * ms
                finished = [e for e in everything[bisect.bisect_left(all_starts, update[0]):
                                                   bisect.bisect_right(all_starts, update[1])]
                            if e[3] == "request_finished"]
                step["request_finished"] = sum(e[1] - e[0] for e in finished) * ms
                j = bisect.bisect_left(frontend_starts, update[1])
                if j < len(frontends) and frontends[j][0] - update[1] < 100_000_000:
                    step["to_frontend"] = (frontends[j][0] - update[1]) * ms
                    if schedule is not None:
                        step["total"] = (frontends[j][0] - schedule[0]) * ms
            steps.append(step)
    return sorted(steps, key=lambda s: s["start_ns"])


def summarize(steps: list[dict]) -> dict:
    groups: dict[str, list[dict]] = defaultdict(list)
    for step in steps:
        groups[step["kind"]].append(step)
    medians: dict[str, dict[str, float]] = {}
    for group, members in groups.items():
        medians[group] = {stage: round(statistics.median(v), 3)
                          for stage in STAGES if (v := [s[stage] for s in members if stage in s])}
        medians[group]["steps"] = len(members)
    for kind in ("push_no_writes", "push_writes"):
        if kind in medians and "plain" in medians:
            medians[f"{kind}_minus_plain"] = {stage: round(medians[kind][stage] - medians["plain"][stage], 3)
                                              for stage in STAGES if stage in medians[kind] and stage in medians["plain"]}
    return medians


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--min-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    steps = prefill_steps(load(args.folder), args.min_tokens)
    summary = {"bench": "hook_timeline", "min_tokens": args.min_tokens, "median_ms": summarize(steps),
               "steps": steps}
    print(json.dumps(summary["median_ms"], indent=1))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
