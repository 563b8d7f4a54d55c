"""Where the prefill engine's NIXL copies run next to its forward: a CUPTI trace of long prefills with pushes.

On the GPU machine, through bench/gpu_run.sh (it installs the wheel set and kvpush): starts gpu_e2e's kvpush stack
with the prefill engine's torch profiler on (vLLM's --profiler-config; CUPTI records every kernel and copy of that
process, UCX's `cuda_ipc` copies included), sends warm-up prompts, then profiles a few prompts of each length and
summarises the trace: for each device-to-device copy, its stream, when its driver call was made (enqueued), when
it ran and for how long, and how much of the wait the forward's kernels filled; with each transfer's push timing
from the directory (layers landed before the prefill's end, exposed tail).

    KVPUSH_GPU_TIMEOUT_S=400 bash bench/gpu_run.sh profile --lengths 4096,8192 --kv-cache-gib 7

(`gpu_run.sh profile` runs this file in place of gpu_e2e.py: see there.) Writes $OUT/gpu_profile.json.

Every run also records the prefill data plane's I/O loop (`nixl_io_trace_path`) and summarises it over each
transfer's writes: how late the thread woke, how often it ran, how long its NIXL calls took. `--variant NAME=JSON`
(repeatable) runs a fresh stack per kv_connector_extra_config variant, side by side in one run (a variant's
`"engine_env": {...}` is the engines' extra environment instead, e.g. `{"CUDA_DEVICE_MAX_CONNECTIONS": 32}`);
`--no-cupti` leaves the torch profiler off (it slows the host):

    bash bench/gpu_run.sh profile --lengths 8192 --repeats 3 --kv-cache-gib 7 --no-cupti \
        --variant 'all-checks={"nixl_check_in_post_order": false}' --variant 'in-order={}' \
        --variant 'in-order-switch={"gil_switch_interval_s": 0.0002}'
"""

from __future__ import annotations

import gzip
import itertools
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import gpu_e2e  # bench/, this script's folder
from gpu_nsys_summary import busy, distribution, merge_windows

PROFILE_DIR = Path("/tmp/kvpush-torch-profile")
IO_TRACE_DIR = Path("/tmp/kvpush-io-trace")
WINDOW_GAP_US = 500.0


def summarise_trace(path: Path) -> dict[str, Any]:
    """The copies of a Kineto trace against its kernels (module docstring)."""
    with gzip.open(path, "rt") if path.suffix == ".gz" else path.open() as f:
        trace = json.load(f)
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    kernels: list[tuple[float, float, int]] = []
    copies: list[dict[str, Any]] = []
    calls: dict[int, dict[str, Any]] = {}
    categories: dict[str, int] = defaultdict(int)
    for e in events:
        cat = e.get("cat", "")
        categories[cat] += 1
        args = e.get("args", {})
        if cat == "kernel":
            kernels.append((e["ts"], e["ts"] + e.get("dur", 0), args.get("stream", -1)))
        elif cat == "gpu_memcpy":
            copies.append({"name": e.get("name"), "ts": e["ts"], "dur": e.get("dur", 0),
                           "stream": args.get("stream", -1), "bytes": args.get("bytes"),
                           "correlation": args.get("correlation")})
        elif cat in ("cuda_runtime", "cuda_driver") and "correlation" in args:
            calls[args["correlation"]] = {"name": e.get("name"), "ts": e["ts"], "tid": e.get("tid")}
    device_copies = [c for c in copies if "DtoD" in (c["name"] or "") or "PtoP" in (c["name"] or "")
                     or "Peer" in (c["name"] or "")]
    # The copies' own streams: those that run device copies and no kernel (vLLM's compute stream also copies).
    kernel_streams = {s for _, _, s in kernels}
    copy_streams = {c["stream"] for c in device_copies} - kernel_streams
    device_copies = [c for c in device_copies if c["stream"] in copy_streams]
    forward = sorted((a, b) for a, b, s in kernels)
    windows = merge_windows(forward, WINDOW_GAP_US)
    rows = []
    for c in sorted(device_copies, key=lambda c: c["ts"]):
        call = calls.get(c["correlation"])
        window = next((w for w in windows if w[0] <= c["ts"] <= w[1]), None)
        row = {"name": c["name"], "stream": c["stream"], "bytes": c["bytes"], "run_us": c["dur"],
               "api": call["name"] if call else None, "api_tid": call["tid"] if call else None,
               "inside_forward": window is not None,
               "forward_end_minus_copy_end_us": (window[1] - c["ts"] - c["dur"]) if window else None}
        if call:
            row["wait_us"] = c["ts"] - call["ts"]
            row["forward_busy_during_wait_us"] = busy(forward, call["ts"], c["ts"])
            row["enqueued_inside_forward"] = any(w[0] <= call["ts"] <= w[1] for w in windows)
        row["forward_busy_during_run_us"] = busy(forward, c["ts"], c["ts"] + c["dur"])
        rows.append(row)
    long_windows = [w for w in windows if w[1] - w[0] > 20_000]
    per_forward = []
    for start, end in long_windows:  # each long prefill: its copies during the forward and after its end
        during = [c for c in device_copies if start <= c["ts"] <= end]
        after = [c for c in device_copies if end < c["ts"] <= end + 50_000]
        per_forward.append({
            "forward_ms": round((end - start) / 1e3, 2), "copies_during": len(during),
            "bytes_during": sum(c["bytes"] or 0 for c in during), "copies_after": len(after),
            "bytes_after": sum(c["bytes"] or 0 for c in after),
            "first_copy_ms_from_forward_end": round((during[0]["ts"] - end) / 1e3, 2) if during else None,
            "last_copy_end_ms_from_forward_end": round((max(c["ts"] + c["dur"] for c in during + after) - end) / 1e3, 2)
            if during or after else None,
        })
    return {
        "trace": path.name, "categories": dict(categories), "kernels": len(kernels),
        "kernel_streams": sorted({s for _, _, s in kernels}), "copy_streams": sorted(copy_streams),
        "copy_names": sorted({c["name"] for c in copies}),
        "device_copies": len(rows),
        "wait_us": distribution([r["wait_us"] for r in rows if "wait_us" in r]),
        "run_us": distribution([r["run_us"] for r in rows]),
        "forward_busy_during_wait_us": distribution([r["forward_busy_during_wait_us"] for r in rows
                                              if "forward_busy_during_wait_us" in r]),
        "forward_busy_during_run_us": distribution([r["forward_busy_during_run_us"] for r in rows]),
        "enqueued_inside_forward": sum(bool(r.get("enqueued_inside_forward")) for r in rows),
        "ran_inside_forward": sum(r["inside_forward"] for r in rows),
        "per_forward": per_forward,
        "forward_windows_over_20ms": [{"start_us": w[0], "ms": round((w[1] - w[0]) / 1e3, 2)} for w in long_windows],
        "copies": rows[:400],
    }


def summarise_io(rows: list[dict[str, Any]], start: float, end: float) -> dict[str, Any]:
    """The prefill I/O thread's iterations between `start` and `end` (unix seconds): how late it woke, how often it
    ran, and how long its NIXL calls took (GIL hand-back included: io_trace.py)."""
    inside = [r for r in rows if start <= r.get("t", 0.0) <= end]
    out: dict[str, Any] = {"iterations": len(inside), "handles_done": sum(r.get("done", 0) for r in inside)}
    if not inside:
        return out
    out["late_ms"] = distribution([r["late_ms"] for r in inside])
    gaps = [(b["t"] - a["t"]) * 1e3 for a, b in itertools.pairwise(inside)]
    if gaps:
        out["iteration_gap_ms"] = distribution(gaps)
    for kind in ("check", "post", "event", "notif"):
        calls = [r[kind] for r in inside if kind in r]
        if calls:
            count = sum(c[0] for c in calls)
            out[kind] = {"calls": count, "total_ms": round(sum(c[1] for c in calls), 3),
                         "mean_ms": round(sum(c[1] for c in calls) / count, 4),
                         "longest_ms": max(c[2] for c in calls),
                         "iterations_longest_ms": distribution([c[2] for c in calls])}
    return out


def _read_io_traces(folder: Path) -> list[dict[str, Any]]:
    """Rows of the trace files that posted (the prefill worker's; decode's only polls notifications)."""
    best: list[dict[str, Any]] = []
    for path in sorted(folder.glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        rows = [r for r in rows if "t" in r]
        if any("post" in r for r in rows) and len(rows) > len(best):
            best = rows
    return best


def _parse_variants(raw: list[str]) -> list[tuple[str, dict[str, Any]]]:
    variants = []
    for item in raw:
        name, _, extra = item.partition("=")
        if not name or not extra:
            raise SystemExit(f"--variant wants NAME=JSON, got {item!r}")
        variants.append((name, json.loads(extra)))
    return variants or [("default", {})]


def run_profile(args: Any) -> int:
    config = gpu_e2e.preset_config(args.preset)
    model_dir = gpu_e2e.ensure_shaped_model(args.preset)
    log_dir = Path(args.log_dir or "/tmp/kvpush-gpu-profile-logs")
    profiler_config = json.dumps({"profiler": "torch", "torch_profiler_dir": str(PROFILE_DIR),
                                  "torch_profiler_with_stack": False, "ignore_frontend": True,
                                  "torch_profiler_dump_cuda_time_total": False})
    lengths = [int(x) for x in args.lengths.split(",")]
    layers = config["num_hidden_layers"]
    base_extra = dict(args.connector_extra)
    report: dict[str, Any] = {"bench": "gpu_profile", "preset": args.preset, "lengths": lengths,
                              "cupti": args.cupti, "variants": []}
    for index, (name, extra) in enumerate(args.variants):
        io_dir = IO_TRACE_DIR / name
        connector_extra = {k: v for k, v in extra.items() if k != "engine_env"}
        args.connector_extra = {**base_extra, **connector_extra,
                                "nixl_io_trace_path": str(io_dir / "{pid}-{agent}.jsonl")}
        stack = gpu_e2e.Stack(args, model_dir, log_dir / name)
        stack.engine_env = {**stack.engine_env, **{k: str(v) for k, v in extra.get("engine_env", {}).items()}}
        cupti = args.cupti and index == 0  # one CUPTI trace (the first variant): it slows the host
        if cupti:
            spec = stack._spec

            def prefill_with_profiler(role: str, *a: Any, _spec: Any = spec, **kw: Any) -> Any:
                built = _spec(role, *a, **kw)
                if role == "prefill":
                    built.extra_args = [*built.extra_args, "--profiler-config", profiler_config]
                return built

            stack._spec = prefill_with_profiler  # type: ignore[method-assign]
        records: list[tuple[int, str, dict[str, Any]]] = []
        try:
            stack.start("kvpush-first-token", with_colocated=False)
            prefill_url = stack.engines["prefill"].url
            for i, length in enumerate(lengths * 2):  # warm-up: every shape compiled before measuring
                stack.tokens(stack.gateway.url, gpu_e2e.prompt_of(length, seed=500 + i, vocab=config["vocab_size"]), 4)
            if cupti:
                gpu_e2e.call("POST", prefill_url + "/start_profile", {}, timeout_s=60)
            ids = []
            for i, length in enumerate(lengths * args.repeats):
                prompt = gpu_e2e.prompt_of(length, seed=900 + i, vocab=config["vocab_size"])
                _, transfer_id = stack.tokens(stack.gateway.url, prompt, 4)
                ids.append((length, transfer_id))
                time.sleep(0.3)
            if cupti:
                gpu_e2e.call("POST", prefill_url + "/stop_profile", {}, timeout_s=180)
            for length, transfer_id in ids:
                records.append((length, transfer_id, stack.transfer(transfer_id)))
        finally:
            stack.stop()
        rows = _read_io_traces(io_dir)
        transfers = []
        for length, transfer_id, record in records:
            ranks = record.get("rank_timings") or []
            timing = (ranks[0].get("timing") if ranks else None) or {}
            first = gpu_e2e.ts(timing.get("first_write_start_time"))
            last = gpu_e2e.ts(timing.get("last_write_end_time"))
            io = summarise_io(rows, first - 0.001, last + 0.001) if first and last else {}
            transfers.append({"prompt_tokens": length, "transfer_id": transfer_id,
                              "push": gpu_e2e.push_timing(record, layers), "io": io})
        report["variants"].append({"name": name, "connector_extra": extra, "cupti": cupti,
                                   "transfers": transfers})
        report["transfers"] = report["variants"][0]["transfers"]
        # Written after every variant: a run cut short by its time limit keeps what it measured.
        gpu_e2e.write_result(gpu_e2e.out_dir() / f"gpu_profile{args.tag}.json", report, indent=1, echo=False)
        for entry in transfers:
            push, io = entry["push"] or {}, entry["io"]
            check = io.get("check", {})
            gpu_e2e.say(f"{name}: {entry['prompt_tokens']} tokens: layers before prefill end "
                        f"{push.get('layers_before_prefill_end')}/{push.get('layer_count')}, exposed tail "
                        f"{push.get('exposed_tail_ms')} ms; I/O iterations {io.get('iterations')}, late p50/max "
                        f"{io.get('late_ms', {}).get('p50')}/{io.get('late_ms', {}).get('max')} ms, checks "
                        f"{check.get('calls')} mean {check.get('mean_ms')} longest {check.get('longest_ms')} ms")
    if args.cupti:
        deadline = time.monotonic() + 120
        traces: list[Path] = []
        while time.monotonic() < deadline:
            traces = sorted(PROFILE_DIR.rglob("*.pt.trace.json*"))
            if traces:
                break
            time.sleep(2)
        report["trace_files"] = [str(t) for t in traces]
        report["traces"] = [summarise_trace(t) for t in traces]
        for t in report["traces"]:
            gpu_e2e.say(json.dumps({k: t[k] for k in ("trace", "kernels", "kernel_streams", "copy_streams",
                                                      "copy_names", "device_copies", "wait_us", "run_us",
                                                      "forward_busy_during_wait_us", "forward_busy_during_run_us",
                                                      "enqueued_inside_forward", "ran_inside_forward")}))
    out = gpu_e2e.write_result(gpu_e2e.out_dir() / f"gpu_profile{args.tag}.json", report, indent=1, echo=False)
    gpu_e2e.say(f"wrote {out}")
    return 0


def main(argv: list[str]) -> int:
    # gpu_e2e's parser and stack, its hops flags; --lengths, --repeats, --variant NAME=JSON (repeatable: each a
    # fresh stack with that kv_connector_extra_config over --connector-extra) and --no-cupti are this file's.
    lengths, repeats, cupti, variants, rest = "4096,8192", 2, True, [], []
    i = 1 if argv[:1] == ["profile"] else 0  # gpu_run.sh passes its command first
    while i < len(argv):
        if argv[i] == "--lengths":
            lengths = argv[i + 1]
            i += 2
        elif argv[i] == "--repeats":
            repeats = int(argv[i + 1])
            i += 2
        elif argv[i] == "--variant":
            variants.append(argv[i + 1])
            i += 2
        elif argv[i] == "--no-cupti":
            cupti = False
            i += 1
        else:
            rest.append(argv[i])
            i += 1

    def run(args: Any) -> int:
        args.lengths, args.repeats, args.cupti = lengths, repeats, cupti
        args.variants = _parse_variants(variants)
        return run_profile(args)

    gpu_e2e.run_hops = run  # main() dispatches by name at call time
    return gpu_e2e.main(["hops", *rest])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
