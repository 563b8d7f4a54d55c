"""Where a kvpush prefill leg's extra time over the same prefill alone goes, by the prefill engine's own stages.

`hops_bench` finds the connector's cost on the prefill engine as `p_leg` − `p_alone` (kvpush_one_token's split). This
bench splits that difference by vLLM's per-request metrics on the prefill engine (its Prometheus histograms:
queue time = arrival in the engine core → first scheduled; prefill time = first scheduled → first token; engine TTFT
= arrival at the API server's engine client → first token), and, with `--hook-timing`, by the time spent inside
KVPushConnector's own hooks in each engine process.

What runs: the local stack (tiny model, loopback), no decode leg. Blocks of `--per-block` requests of one kind, the
kinds alternating block by block (order swapped every other block); between blocks the prefill engine's /metrics
is scraped, so each block gives the mean of each stage over its requests:
  p_alone  streamed, max_tokens=1, no kv_transfer_params;
  p_leg    the same as a prefill leg (a transfer this bench plans, first token from prefill), cancelled afterwards.
The figures are medians over blocks of each kind, and `p_leg − p_alone` per stage.

`--hook-timing` (a measurement aid): every engine process imports a `sitecustomize` (written to the log folder, put
on the engines' PYTHONPATH) that wraps KVPushConnector's hooks with a timer and writes each process's totals
(calls, ms) to `hooks-<pid>.json` in the log folder every 2 s; the JSON carries them. The wrapper's own cost is
in the figures.

    python bench/prefill_stages_bench.py [--blocks 8] [--per-block 10] [--prompt-tokens 512] [--hook-timing]
                                         [--no-first-token]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import hops_bench
from bench_io import emit

from kvpush.localstack.client import stream_completion

HOOKS = ("bind_connector_metadata", "start_load_kv", "save_kv_layer", "wait_for_save", "get_finished",
         "build_connector_worker_meta", "build_connector_meta", "update_connector_output", "request_finished",
         "get_num_new_matched_tokens", "update_state_after_alloc", "on_new_request")
SITECUSTOMIZE = '''"""prefill_stages_bench --hook-timing: time inside KVPushConnector's hooks, per process
(a measurement aid)."""
import json, os, time

def _install(folder, names):
    from kvpush.connector import connector as module
    totals = {}
    written = [time.monotonic()]
    path = os.path.join(folder, f"hooks-{os.getpid()}.json")

    def wrap(name):
        hook = getattr(module.KVPushConnector, name)

        def timed(self, *args, **kwargs):
            started = time.perf_counter()
            try:
                return hook(self, *args, **kwargs)
            finally:
                calls, seconds = totals.get(name, (0, 0.0))
                totals[name] = (calls + 1, seconds + time.perf_counter() - started)
                now = time.monotonic()
                if now - written[0] >= 2.0:
                    written[0] = now
                    with open(path + ".tmp", "w") as out:
                        json.dump({n: {"calls": c, "ms": round(s * 1e3, 3)} for n, (c, s) in totals.items()}, out)
                    os.replace(path + ".tmp", path)
        setattr(module.KVPushConnector, name, timed)
    for name in names:
        if hasattr(module.KVPushConnector, name):
            wrap(name)

if os.environ.get("KVPUSH_BENCH_HOOK_TIMING"):
    _install(os.environ["KVPUSH_BENCH_HOOK_TIMING"], %r)
'''


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=8, help="blocks per kind")
    parser.add_argument("--per-block", type=int, default=10)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--gap-s", type=float, default=0.3)
    parser.add_argument("--hook-timing", action="store_true")
    parser.add_argument("--no-first-token", action="store_true",
                        help="prefill legs without first_token_from_prefill "
                             "(the gateway's --no-first-token-from-prefill)")
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    from kvpush.client import SyncDirectoryClient
    from kvpush.localstack.model import TinyModelSpec
    from kvpush.localstack.stack import DECODE_ENGINE_ID, PREFILL_ENGINE_ID, LocalStack

    args = parse_args(argv)
    log_dir = (args.log_dir or Path("/tmp") / f"kvpush-stages-{int(time.time())}").resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    engine_env = {"UCX_NET_DEVICES": "lo"}
    if args.hook_timing:
        site = log_dir / "site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE % (HOOKS,))
        engine_env.update(PYTHONPATH=str(site), KVPUSH_BENCH_HOOK_TIMING=str(log_dir))
    stack = LocalStack(spec=TinyModelSpec(), log_dir=log_dir, progress=lambda m: print(m, file=sys.stderr),
                       engine_env=engine_env, with_colocated=False)
    stack.start()
    blocks: dict[str, list[dict]] = {"p_alone": [], "p_leg": []}
    try:
        client = SyncDirectoryClient(stack.directory_channel(timeout_s=5.0, max_attempts=2))
        body = {"model": "tiny", "max_tokens": 1, "temperature": 0.0, "ignore_eos": True}
        url, sent = stack.prefill.url, 0
        for block in range(args.blocks):
            for kind in (("p_alone", "p_leg") if block % 2 == 0 else ("p_leg", "p_alone")):
                before, ttfts = hops_bench.scrape_stages(url), []
                for _ in range(args.per_block):
                    time.sleep(args.gap_s)
                    sent += 1
                    request = {**body, "prompt": hops_bench._prompt(args.prompt_tokens, seed=sent)}
                    transfer_id = ""
                    if kind == "p_leg":
                        transfer_id = client.plan_transfer(
                            prompt_token_count=args.prompt_tokens, prefill_engine_id=PREFILL_ENGINE_ID,
                            decode_engine_id=DECODE_ENGINE_ID).transfer.transfer_id
                        request["kv_transfer_params"] = {"transfer_id": transfer_id, "do_remote_decode": True,
                                                         "first_token_from_prefill": not args.no_first_token}
                    result = stream_completion(url + "/v1/completions", request, timeout_s=120)
                    if transfer_id:
                        client.cancel_transfer(transfer_id, "prefill stages bench: a prefill leg without decode")
                    if result.status != 200 or result.error:
                        raise RuntimeError(f"{kind} request failed: {result.status} {result.error}")
                    ttfts.append(result.ttft_s * 1e3)
                time.sleep(0.5)  # the block's last request is in the histograms
                blocks[kind].append({"client_ttft": round(statistics.median(ttfts), 3),
                                     **hops_bench.stage_means(before, hops_bench.scrape_stages(url))})
        client.close()
    finally:
        stack.stop()
    names = ("client_ttft", *hops_bench.ENGINE_STAGES)
    median = {kind: {name: hops_bench._median(b[name] for b in rows) for name in names}
              for kind, rows in blocks.items()}
    result = {
        "bench": "prefill_stages", "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": {"model": "tiny (localstack TinyModelSpec)", "prompt_tokens": args.prompt_tokens,
                   "blocks": args.blocks, "per_block": args.per_block, "hook_timing": args.hook_timing,
                   "first_token_from_prefill": not args.no_first_token},
        "median_ms": median,
        "p_leg_minus_p_alone_ms": {name: None if median["p_leg"][name] is None or median["p_alone"][name] is None
                                   else round(median["p_leg"][name] - median["p_alone"][name], 3) for name in names},
        "hooks": {path.name: json.loads(path.read_text()) for path in sorted(log_dir.glob("hooks-*.json"))},
        "requests": {"p_alone": args.blocks * args.per_block, "p_leg": args.blocks * args.per_block},
        "blocks": blocks,
    }
    print(f"wrote {emit(result, args.out, 'prefill-stages')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
