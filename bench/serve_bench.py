"""Serving under load: `vllm bench serve` against the same gateway for every P/D connector, side by side.

Variants (one after the other, so only one pair of engines loads the cores at a time):
  colocated            one plain engine, no connector, benchmarked directly (the reference)
  nixl-pull            vLLM NixlConnector, gateway in nixl-pull mode (P leg, then D leg)
  nixl-pull-fair       the same with NIXL's progress thread sleeping 100 us between loops
                       (bench/nixl_paced: stock vLLM's thread busy-spins a core, REFERENCE §6)
  nixl-push            vLLM NixlPushConnector, both legs at once
  nixl-push-fair       the same with the sleeping progress thread
  kvpush               KVPushConnector + directory, both legs at once (--no-first-token-from-prefill)
  kvpush-alloc-at-once kvpush with decode allocating a leg's blocks as it arrives (decode_allocation_wait_s null)
                       instead of once its prefill started: how long decode holds blocks, and what it costs TTFT
  kvpush-processor     kvpush with the ForcePrefillFirstToken logits processor loaded on decode but the
                       gateway's first token off: separates the processor's cost from the first token's
  kvpush-first-token   the same with the gateway's first token from prefill (the default) and the
                       ForcePrefillFirstToken logits processor on decode
Every variant runs the same `vllm bench serve` (random dataset, `--ignore-eos`, seed 0) over each
request rate; P and D are pinned with `--prefill-cpus` / `--decode-cpus`; `--netns` puts them in the
shaped network namespaces of bench/ttft_bench.py (root needed). Results: TTFT / TPOT / ITL mean, p50,
p99, throughput and failures per variant and rate, as JSON in bench/results/serve-<time>.json and a
PNG plot beside it. kvpush variants add `decode_blocks` per rate, from the directory's records of the point's
transfers: plan -> prefill's first readiness, plan -> decode allocated, and allocated -> transfer ended (decode's
blocks held before the request can decode), p50 and p99 in ms.

    python bench/serve_bench.py --model tiny --isl 512 --osl 32 --rates 2,4 --num-prompts 40 \
        --prefill-cpus 0 --decode-cpus 1
`--smoke` is the CI form: the tiny model, two variants, a handful of short requests.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ttft_bench
from bench_io import write_result

from kvpush.localstack.model import BENCH_MODEL_SPEC, TinyModelSpec, ensure_tiny_model
from kvpush.localstack.netns import PDNetwork
from kvpush.localstack.processes import (
    EngineHandle,
    EngineSpec,
    group_cpu_seconds,
    launch_engine,
    start_directory,
)
from kvpush.localstack.stack import DECODE_ENGINE_ARGS, DIRECTORY_ARGS
from kvpush.localstack.vllm_bench import run_bench_serve, summarise

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PACED_SITE = Path(__file__).resolve().parent / "nixl_paced"
PACED_DELAY_US = 100
VARIANTS = ("colocated", "nixl-pull", "nixl-pull-fair", "nixl-push", "nixl-push-fair", "kvpush",
            "kvpush-alloc-at-once", "kvpush-processor", "kvpush-first-token")
# kvpush settings of a variant beyond the defaults.
VARIANT_CONNECTOR_EXTRA: dict[str, dict[str, object]] = {"kvpush-alloc-at-once": {"decode_allocation_wait_s": None}}
# Variants whose decode engines load the ForcePrefillFirstToken logits processor.
PROCESSOR_VARIANTS = ("kvpush-processor", "kvpush-first-token")


def say(message: str) -> None:
    """Progress on stderr (stdout is the JSON)."""
    print(f"[serve_bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def connector_of(variant: str) -> str:
    """The connector (and gateway mode) a variant runs."""
    if variant.startswith("kvpush"):
        return "kvpush"
    return variant.removesuffix("-fair")


def variant_env(variant: str) -> dict[str, str]:
    """Extra engine environment: the fair variants load bench/nixl_paced before anything else."""
    if not variant.endswith("-fair"):
        return {}
    path = os.pathsep.join(p for p in (str(PACED_SITE), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "KVPUSH_BENCH_NIXL_PTHR_DELAY_US": str(PACED_DELAY_US)}


def bench_point(base_url: str, model_dir: Path, args: argparse.Namespace, rate: float, out_file: Path) -> dict:
    """One `vllm bench serve` run (random dataset, streamed completions, greedy) against `base_url`."""
    return run_bench_serve(base_url, model="tiny", tokenizer=model_dir, isl=args.isl, osl=args.osl,
                           num_prompts=args.num_prompts, rate=rate, out_file=out_file, timeout_s=args.point_timeout,
                           warmups=args.warmups, extra_args=("--temperature", "0"))


def run_variant(args, variant: str, model_dir: Path, topology, log_dir: Path, scratch: Path) -> dict:
    """Start the variant's engines (and gateway), benchmark every rate, stop everything."""
    directory = gateway = None
    engines: list[EngineHandle] = []
    try:
        if variant == "colocated":
            engines = [launch_engine(EngineSpec(name="colocated", model_dir=model_dir, cpus=args.prefill_cpus or None,
                                                max_model_len=args.max_model_len), log_dir)]
            engines[0].wait_ready(args.engine_timeout, progress=None)
            base = engines[0].url
        else:
            connector = connector_of(variant)
            port = 0
            if connector == "kvpush":
                directory = start_directory(log_dir, host="0.0.0.0" if topology.network else "127.0.0.1",
                                            extra_args=DIRECTORY_ARGS)
                port = directory.port
            decode_args = DECODE_ENGINE_ARGS if variant in PROCESSOR_VARIANTS else ()
            prefill, decode = ttft_bench.start_pd_engines(args, model_dir, connector, topology, log_dir, port,
                                                          decode_args=decode_args, env=variant_env(variant),
                                                          connector_extra=VARIANT_CONNECTOR_EXTRA.get(variant))
            engines = [prefill, decode]
            gateway_args = (("--first-token-from-prefill",) if variant == "kvpush-first-token"
                            else ("--no-first-token-from-prefill",))
            gateway = ttft_bench.start_bench_gateway(connector, log_dir, prefill=prefill, decode=decode,
                                                     topology=topology, directory_address=f"127.0.0.1:{port}",
                                                     extra_args=gateway_args)
            base = gateway.url
        out: dict[str, Any] = {"idle_cpu_cores": ttft_bench.idle_cpu(engines), "points": {}}
        # Every process group of the variant, for the cores each one used while a point ran.
        groups = {e.spec.name: e.process.pid for e in engines}
        groups.update({name: handle.process.pid for name, handle in (("gateway", gateway), ("directory", directory))
                       if handle is not None})
        for rate in args.rates:
            out_file = scratch / f"{variant}-{rate}.json"
            cpu_before = {name: group_cpu_seconds(pid) for name, pid in groups.items()}
            started, started_wall = time.monotonic(), time.time()
            try:
                out["points"][str(rate)] = summarise(bench_point(base, model_dir, args, rate, out_file))
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                out["points"][str(rate)] = {"error": str(error)[:1500]}
            elapsed = time.monotonic() - started
            if directory is not None:
                out["points"][str(rate)]["decode_blocks"] = decode_block_hold(f"127.0.0.1:{directory.port}",
                                                                              started_wall)
            out["points"][str(rate)]["busy_cpu_cores"] = {
                name: round((group_cpu_seconds(pid) - cpu_before[name]) / elapsed, 2)
                for name, pid in groups.items()}
            say(f"{variant} @ {rate} req/s: {out['points'][str(rate)]}")
        return out
    finally:
        if gateway:
            gateway.process.stop(5.0)
        for engine in engines:
            engine.stop(15.0)
        if directory:
            directory.process.stop(5.0)


def decode_block_hold(directory_address: str, since_wall: float) -> dict[str, Any]:
    """From the directory's records of the transfers planned since `since_wall` (warm-ups included): p50 and p99 in
    ms of plan -> first readiness, plan -> decode allocated, allocated -> ended (decode holds the prompt's blocks
    with the request not yet decoding), and how many were allocated before their first readiness."""
    from kvpush.client.config import ChannelConfig
    from kvpush.client.sync import SyncDirectoryClient

    with SyncDirectoryClient(ChannelConfig(address=directory_address)) as client:
        transfers = [t for t in client.list_transfers(limit=1000)
                     if t.create_time.ToNanoseconds() / 1e9 >= since_wall and t.HasField("allocate_time")
                     and t.HasField("first_ready_time") and t.HasField("end_time")]

    def ms(later, earlier) -> float:
        return (later.ToNanoseconds() - earlier.ToNanoseconds()) / 1e6

    def p50_p99(values: list[float]) -> dict[str, float]:
        ordered = sorted(values)
        return {"p50": round(ordered[len(ordered) // 2], 1),
                "p99": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 1)} if ordered else {}

    return {"transfers": len(transfers),
            "plan_to_first_ready_ms": p50_p99([ms(t.first_ready_time, t.create_time) for t in transfers]),
            "plan_to_allocated_ms": p50_p99([ms(t.allocate_time, t.create_time) for t in transfers]),
            "allocated_to_end_ms": p50_p99([ms(t.end_time, t.allocate_time) for t in transfers]),
            "allocated_before_first_ready": sum(t.allocate_time.ToNanoseconds() < t.first_ready_time.ToNanoseconds()
                                                for t in transfers)}


def add_ratios(result: dict) -> None:
    """kvpush(-first-token) over each baseline, per rate, for TTFT mean/p99 and TPOT mean."""
    variants = result["variants"]
    ratios: dict[str, Any] = {}
    for mine in ("kvpush", "kvpush-processor", "kvpush-first-token"):
        for base in ("nixl-pull-fair", "nixl-pull", "nixl-push-fair", "colocated"):
            for rate in map(str, result["settings"]["rates"]):
                a = variants.get(mine, {}).get("points", {}).get(rate, {})
                b = variants.get(base, {}).get("points", {}).get(rate, {})
                for key in ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms"):
                    if a.get(key) and b.get(key) and not a.get("failed") and not b.get("failed"):
                        ratios.setdefault(f"{mine}/{base}", {}).setdefault(rate, {})[key] = round(a[key] / b[key], 3)
    # Waiting for prefill's start against allocating at once: TTFT, and decode's block hold before decoding.
    for rate in map(str, result["settings"]["rates"]):
        a = variants.get("kvpush", {}).get("points", {}).get(rate, {})
        b = variants.get("kvpush-alloc-at-once", {}).get("points", {}).get(rate, {})
        pair: dict[str, float] = {}
        for key in ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms"):
            if a.get(key) and b.get(key):
                pair[key] = round(a[key] / b[key], 3)
        for quantile in ("p50", "p99"):
            held_a = a.get("decode_blocks", {}).get("allocated_to_end_ms", {}).get(quantile)
            held_b = b.get("decode_blocks", {}).get("allocated_to_end_ms", {}).get(quantile)
            if held_a and held_b:
                pair[f"allocated_to_end_{quantile}"] = round(held_a / held_b, 3)
        if pair:
            ratios.setdefault("kvpush/kvpush-alloc-at-once", {})[rate] = pair
    result["ratios"] = ratios


def plot(result: dict, path: Path) -> None:
    """TTFT mean and p99, TPOT mean against request rate, one line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = (("mean_ttft_ms", "TTFT mean (ms)"), ("p99_ttft_ms", "TTFT p99 (ms)"), ("mean_tpot_ms", "TPOT mean (ms)"))
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4))
    for axis, (key, label) in zip(axes, keys):
        for variant, data in result["variants"].items():
            points = [(float(r), p[key]) for r, p in data.get("points", {}).items()
                      if isinstance(p, dict) and p.get(key)]
            if points:
                xs, ys = zip(*sorted(points))
                axis.plot(xs, ys, marker="o", label=variant)
        axis.set_xlabel("request rate (req/s)")
        axis.set_ylabel(label)
        axis.set_yscale("log")
        axis.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    s = result["settings"]
    fig.suptitle(f"vllm bench serve: {s['model']} model, ISL {s['isl']}, OSL {s['osl']}, "
                 f"{s['num_prompts']} prompts, {'1 Gbit/s namespaces' if s['netns'] else 'loopback'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--model", choices=("tiny", "bench"), default="tiny",
                        help="tiny: the 2-layer test model; bench: the 8-layer benchmark model")
    parser.add_argument("--isl", type=int, default=512)
    parser.add_argument("--osl", type=int, default=32)
    parser.add_argument("--rates", default="4", help="comma list of Poisson request rates (req/s)")
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--warmups", type=int, default=2)
    parser.add_argument("--netns", action="store_true", help="P and D in the shaped 1 Gbit/s namespaces (root)")
    parser.add_argument("--link-rate", default="1gbit")
    parser.add_argument("--prefill-cpus", default="", help="taskset CPU list for prefill (and colocated)")
    parser.add_argument("--decode-cpus", default="", help="taskset CPU list for decode")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--engine-timeout", type=float, default=420.0)
    parser.add_argument("--point-timeout", type=float, default=600.0)
    parser.add_argument("--smoke", action="store_true", help="CI form: tiny model, 2 variants, 4 short requests")
    parser.add_argument("--out", default="", help="JSON path (default bench/results/serve-<time>.json)")
    parser.add_argument("--log-dir", default="")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.isl, args.osl, args.num_prompts, args.warmups = "tiny", 64, 4, 4, 0
        args.rates = "8"
        if args.variants == ",".join(VARIANTS):
            args.variants = "colocated,kvpush-first-token"
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
    args.rates = [float(r) for r in args.rates.split(",") if r]
    return args


def main(argv=None) -> int:
    """Run every variant, write the JSON and the plot, print the JSON."""
    args = parse_args(argv)
    ttft_bench.stop_on_signals()
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    spec = TinyModelSpec() if args.model == "tiny" else BENCH_MODEL_SPEC
    model_dir = ensure_tiny_model(spec)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix=f"kvpush-serve-{stamp}-"))
    scratch = Path(tempfile.mkdtemp(prefix="kvpush-serve-points-"))
    result: dict[str, Any] = {
        "benchmark": "serve", "command": " ".join(["python", "bench/serve_bench.py", *(argv or sys.argv[1:])]),
        "started_utc": stamp, "settings": {
            "model": args.model, "layers": spec.num_layers, "isl": args.isl, "osl": args.osl, "rates": args.rates,
            "num_prompts": args.num_prompts, "netns": args.netns, "link_rate": args.link_rate if args.netns else None,
            "prefill_cpus": args.prefill_cpus, "decode_cpus": args.decode_cpus,
            "paced_progress_thread_us": PACED_DELAY_US},
        "cpu": ttft_bench.cpu_context(), "log_dir": str(log_dir), "variants": {}}
    network = PDNetwork(prefix="kvs", rate=args.link_rate) if args.netns else None
    try:
        if network:
            network.create()
        topology = ttft_bench.Topology(network)
        for variant in args.variants:
            say(f"variant {variant}")
            try:
                result["variants"][variant] = run_variant(args, variant, model_dir, topology, log_dir, scratch)
            except Exception as error:  # one broken connector must not hide the others' figures
                say(f"variant {variant} failed: {error}")
                result["variants"][variant] = {"error": str(error)[:2000]}
    finally:
        if network:
            network.destroy()
    result["cpu"]["loadavg_at_end"] = os.getloadavg()
    add_ratios(result)
    out = Path(args.out) if args.out else RESULTS_DIR / f"serve-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, result, echo=False)
    plot(result, out.with_suffix(".png"))
    print(json.dumps(result, indent=2))
    say(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
