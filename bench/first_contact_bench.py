"""The first requests after a P/D pair starts: decode peers loaded ahead (`preload_peers`, the default) against
loaded by the first instruction that names them (`preload_peers=false`).

Each round starts a fresh local stack (tiny model, loopback, one prefill and one decode engine, first token from
prefill: the gateway's default) for one variant, the variants alternating from round to round, and sends
`--requests` greedy streamed requests one at a time through the gateway (random token-id prompts). Per request:
TTFT and the whole answer's time (ms). From the prefill engine's log: every `peer_added` line (its `load_ms`, the
NIXL wire-up) and whether the peer was loaded before the first request was sent. The figures: per variant, the
median over rounds of the first request's TTFT / total and of the later requests' medians.

    .venv/bin/python bench/first_contact_bench.py [--rounds 2] [--requests 6] [--prompt-tokens 512]

JSON in bench/results/first-contact-<UTC time>.json.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_io import emit

from kvpush.localstack.client import stream_completion

VARIANTS = {"preload": True, "on_instruction": False}
_LOAD_MS = re.compile(r"load_ms[\"'=:\s]+([0-9.]+)")


def peer_loads(log_text: str) -> list[float]:
    """The load_ms of every `peer_added` line of an engine log."""
    return [float(m.group(1)) for line in log_text.splitlines() if "peer_added" in line
            for m in [_LOAD_MS.search(line)] if m]


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def run_round(variant: str, args: argparse.Namespace, round_index: int) -> dict:
    from kvpush.localstack.model import TinyModelSpec
    from kvpush.localstack.stack import LocalStack

    log_dir = args.log_dir / f"round{round_index}-{variant}"
    stack = LocalStack(spec=TinyModelSpec(), log_dir=log_dir, progress=lambda m: print(m, file=sys.stderr),
                       with_colocated=False, serve_metrics=False,
                       connector_extra={"preload_peers": VARIANTS[variant]})
    stack.start()
    try:
        prefill_log = stack.prefill.process.log_path
        loaded_before = peer_loads(prefill_log.read_text(errors="replace"))
        rng = random.Random(round_index)
        requests = []
        for _ in range(args.requests):
            prompt = [rng.randrange(3, stack.spec.vocab_size - 3) for _ in range(args.prompt_tokens)]
            result = stream_completion(stack.gateway_url + "/v1/completions", {
                "model": "tiny", "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0.0,
                "ignore_eos": True}, timeout_s=180)
            if result.status != 200 or result.error:
                raise RuntimeError(f"request failed: {result.status} {result.error[:300]}")
            requests.append({"ttft_ms": round(result.ttft_s * 1000, 2), "total_ms": round(result.total_s * 1000, 2),
                             "transfer_id": result.headers.get("x-kvpush-transfer-id", "")})
        time.sleep(0.5)  # the last peer_added line, if any, is written by now
        loads = peer_loads(prefill_log.read_text(errors="replace"))
    finally:
        stack.stop()
    return {"variant": variant, "round": round_index, "requests": requests,
            "peer_load_ms": loads, "peers_loaded_before_first_request": len(loaded_before)}


def summary(rounds: list[dict]) -> dict:
    out = {}
    for variant in VARIANTS:
        mine = [r for r in rounds if r["variant"] == variant]
        out[variant] = {
            "rounds": len(mine),
            "first_ttft_ms": _median([r["requests"][0]["ttft_ms"] for r in mine]),
            "first_total_ms": _median([r["requests"][0]["total_ms"] for r in mine]),
            "later_ttft_ms": _median([statistics.median(q["ttft_ms"] for q in r["requests"][1:]) for r in mine
                                      if len(r["requests"]) > 1]),
            "later_total_ms": _median([statistics.median(q["total_ms"] for q in r["requests"][1:]) for r in mine
                                       if len(r["requests"]) > 1]),
            "peer_load_ms": _median([ms for r in mine for ms in r["peer_load_ms"]]),
            "rounds_with_peer_loaded_before_first_request": sum(r["peers_loaded_before_first_request"] > 0
                                                                for r in mine),
        }
    return out


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="stacks per variant")
    parser.add_argument("--requests", type=int, default=6, help="requests per stack, one at a time")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp") / f"kvpush-first-contact-{int(time.time())}")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.requests < 1:
        parser.error("--rounds and --requests must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    order = list(VARIANTS)
    rounds = []
    for index in range(args.rounds):
        for variant in (order if index % 2 == 0 else order[::-1]):
            rounds.append(run_round(variant, args, len(rounds)))
    result = {"bench": "first_contact", "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "config": {"model": "tiny (localstack TinyModelSpec)", "link": "loopback", "rounds": args.rounds,
                         "requests": args.requests, "prompt_tokens": args.prompt_tokens,
                         "max_tokens": args.max_tokens, "first_token_from_prefill": True},
              "summary": summary(rounds), "rounds": rounds}
    print(f"wrote {emit(result, args.out, 'first-contact')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
