"""What a decode engine's settings cost per step: plain engines, no P/D, the same streamed requests to each.

First token from prefill loads a logits processor into every decode engine (`--logits-processors
kvpush.connector.first_token:ForcePrefillFirstToken`). vLLM then keeps every request's output token ids for
the processors (`logitsprocs_need_output_token_ids`), which under async scheduling has each step synchronize on
the previous step's sampled tokens before sampling (a GPU→CPU copy on a GPU; nothing to wait for on a CPU). This
bench measures what a setting costs per decode step,
side by side in one run: each variant is its own engine (tiny model, float32, pinned to `--cpus`), one engine
at a time so none shares the cores, all sent the same prompts. The variants still run at different moments:
`--rounds` repeats the whole sequence so that a noisy moment shows up as a spread between rounds.

Variants (`--variants`, comma-separated):
  plain            no processor (what a decode engine without first token runs)
  processor        --logits-processors ...ForcePrefillFirstToken
  plain-sync       --no-async-scheduling
  processor-sync   the processor and --no-async-scheduling

Per variant: TPOT ((last event - first event) / (events - 1)) and TTFT of `--requests` streamed completions
(random token-id prompts of `--isl`, `--osl` tokens, greedy, ignore_eos), `--concurrency` at a time; mean, p50,
p99 and the ratio of each variant's mean TPOT over `plain`'s. JSON to bench/results/decode-step-<UTC>.json.

    python bench/decode_step_bench.py --variants plain,processor,plain-sync,processor-sync \\
        --isl 512 --osl 64 --requests 24 --cpus 1 --rounds 2
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from bench_io import emit

from kvpush.localstack.client import stream_completion
from kvpush.localstack.model import TinyModelSpec, ensure_tiny_model
from kvpush.localstack.processes import EngineSpec, launch_engine
from kvpush.localstack.stack import FIRST_TOKEN_PROCESSOR

VARIANT_ARGS = {
    "plain": (),
    "processor": ("--logits-processors", FIRST_TOKEN_PROCESSOR),
    "plain-sync": ("--no-async-scheduling",),
    "processor-sync": ("--logits-processors", FIRST_TOKEN_PROCESSOR, "--no-async-scheduling"),
}


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    ordered = sorted(values)
    return {"mean": round(statistics.fmean(ordered), 3), "p50": round(statistics.median(ordered), 3),
            "p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3)}


def _one_request(url: str, body: dict, variant: str, prompt: list[int]) -> tuple[float, float]:
    """One streamed completion: (TTFT ms, TPOT ms)."""
    result = stream_completion(url, {**body, "prompt": prompt}, timeout_s=300)
    if result.status != 200 or result.error:
        raise RuntimeError(f"{variant}: {result.status} {result.error}")
    events = [e for e in result.events if e.get("choices")]
    tpot = (result.total_s - result.ttft_s) / max(1, len(events) - 1)
    return result.ttft_s * 1000, tpot * 1000


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="plain,processor,plain-sync,processor-sync")
    parser.add_argument("--isl", type=int, default=512)
    parser.add_argument("--osl", type=int, default=64)
    parser.add_argument("--requests", type=int, default=24, help="measured requests per variant")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="repeat every variant this many times, in turn")
    parser.add_argument("--cpus", default="1", help="taskset CPU list for every engine (they run one at a time)")
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANT_ARGS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {sorted(VARIANT_ARGS)}")
    log_dir = args.log_dir or Path("/tmp") / f"kvpush-decode-step-{int(time.time())}"
    log_dir.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_tiny_model(TinyModelSpec())
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(args.isl)] for _ in range(args.warmup + args.requests)]
    results: dict[str, dict] = {}
    # One engine at a time on the same cores: each variant sees the same machine, and none shares it.
    for round_index, variant in [(r, v) for r in range(args.rounds) for v in variants]:
        spec = EngineSpec(name=f"engine-{variant}", model_dir=model_dir, cpus=args.cpus,
                          extra_args=VARIANT_ARGS[variant])
        handle = launch_engine(spec, log_dir)
        try:
            handle.wait_ready(420.0, progress=lambda m: print(m, file=sys.stderr))
            url = handle.url + "/v1/completions"
            body = {"model": "tiny", "max_tokens": args.osl, "temperature": 0.0, "ignore_eos": True}
            one = functools.partial(_one_request, url, body, variant)
            with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
                list(pool.map(one, prompts[:args.warmup]))
                measured = list(pool.map(one, prompts[args.warmup:]))
            entry = results.setdefault(variant, {"engine_args": list(VARIANT_ARGS[variant]), "rounds": []})
            entry["rounds"].append({"ttft_ms": _stats([m[0] for m in measured]),
                                    "tpot_ms": _stats([m[1] for m in measured]), "raw": measured})
            print(variant, round_index, json.dumps(entry["rounds"][-1]["tpot_ms"]), file=sys.stderr)
        finally:
            handle.stop()
    for result in results.values():  # all rounds together
        result["ttft_ms"] = _stats([m[0] for r in result["rounds"] for m in r["raw"]])
        result["tpot_ms"] = _stats([m[1] for r in result["rounds"] for m in r["raw"]])
    base = (results.get("plain") or {}).get("tpot_ms", {}).get("mean")
    for result in results.values():
        mean = result["tpot_ms"]["mean"]
        result["tpot_mean_x_plain"] = round(mean / base, 3) if base and mean else None
        result["tpot_mean_x_plain_by_round"] = [
            round(r["tpot_ms"]["mean"] / b["tpot_ms"]["mean"], 3)
            for r, b in zip(result["rounds"], (results.get("plain") or {}).get("rounds", []))]
    out = {"bench": "decode_step",
           "config": {"model": "tiny (localstack TinyModelSpec, float32)", "isl": args.isl, "osl": args.osl,
                      "requests": args.requests, "concurrency": args.concurrency, "cpus": args.cpus,
                      "rounds": args.rounds},
           "variants": results}
    print(f"wrote {emit(out, args.out, 'decode-step')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
