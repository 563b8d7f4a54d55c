"""What counting a text prompt's tokens costs the gateway's TTFT: one stack, two gateways, side by side.

The gateway counts text and chat prompts with a prefill engine's /tokenize before PlanTransfer (so the directory
can check decode's free blocks); that is one more HTTP round trip on the request's critical path. This runs the
local CPU stack (tiny model; directory, prefill, decode) with two gateways on the same directory: one counting
(the default), one with --no-count-prompt-tokens. Each round sends the same fresh prompt to both, in
alternating order, streamed, and records time to first token; ratios are taken per round.
Text prompts whose UTF-8 length already fits every decode engine skip /tokenize (the byte bound is planned
with); chat prompts are always counted (a chat template's tokens have no byte bound), so the chat case shows
the round trip's cost.

Usage:  python bench/gateway_tokenize_bench.py [--rounds 15] [--words 100 1000] [--chat-words 100 1000]
Prints JSON and writes bench/results/gateway_tokenize_bench.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from kvpush.localstack.client import stream_completion
from kvpush.localstack.model import TinyModelSpec
from kvpush.localstack.processes import start_gateway
from kvpush.localstack.stack import LocalStack
from kvpush.observability import configure_logging

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(RESULTS.parent))
from bench_io import write_result  # bench/, this script's folder

WORDS = ["prefill", "engine", "writes", "every", "layer", "of", "the", "key", "and", "value", "cache", "into",
         "blocks", "that", "decode", "allocated", "before", "the", "prompt", "was", "computed", "while", "the",
         "directory", "watches", "each", "transfer"]


def text_prompt(words: int, seed: int) -> str:
    """A fresh prompt of `words` words (seeded: no prefix cache helps)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def main() -> None:
    """Run the rounds, print and write JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--words", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--chat-words", type=int, nargs="*", default=[100, 1000])
    parser.add_argument("--control", action="store_true",
                        help="A/A control: the second gateway counts too (measures the two instances' difference)")
    args = parser.parse_args()
    configure_logging(level="WARNING", fmt="console")
    stack = LocalStack(spec=TinyModelSpec(), progress=None, with_colocated=False, serve_metrics=False).start()
    try:
        plain = start_gateway(stack.log_dir, directory_address=stack.directory.address,
                              extra_args=[] if args.control else ["--no-count-prompt-tokens"])
        gateways = {"counting": stack.gateway_url, "not_counting": plain.url}
        cases = []
        for kind, words in [("text", w) for w in args.words] + [("chat", w) for w in args.chat_words]:
            ttft: dict[str, list[float]] = {name: [] for name in gateways}
            ratios = []
            for index in range(args.rounds + 1):  # round 0 warms both paths up and is dropped
                prompt = text_prompt(words, words * 1000 + index + (500 if kind == "chat" else 0))
                path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
                body = ({"messages": [{"role": "user", "content": prompt}]} if kind == "chat" else {"prompt": prompt})
                order = list(gateways) if index % 2 == 0 else list(reversed(gateways))
                got = {}
                for name in order:
                    result = stream_completion(gateways[name] + path,
                                               {"model": "tiny", **body, "max_tokens": 4, "temperature": 0.0,
                                                "ignore_eos": True}, timeout_s=120)
                    if result.status != 200 or result.error:
                        raise RuntimeError(f"{name}: HTTP {result.status} {result.error}")
                    got[name] = result.ttft_s
                    time.sleep(0.05)
                if index:
                    for name, value in got.items():
                        ttft[name].append(value)
                    ratios.append(got["counting"] / got["not_counting"])
            cases.append({
                "kind": kind, "words": words, "rounds": args.rounds,
                "ttft_ms_median": {n: round(statistics.median(v) * 1e3, 2) for n, v in ttft.items()},
                "ttft_ms_p90": {n: round(sorted(v)[int(0.9 * (len(v) - 1))] * 1e3, 2) for n, v in ttft.items()},
                "added_ms_median": round((statistics.median(ttft["counting"]) - statistics.median(ttft["not_counting"]))
                                         * 1e3, 2),
                "ratio_counting_over_not_median": round(statistics.median(ratios), 3)})
        plain.process.stop(grace_s=5.0)
    finally:
        stack.stop()
    results = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
               "model": "tiny (2 layers, CPU)", "control_a_a": args.control, "cases": cases}
    RESULTS.mkdir(exist_ok=True)
    write_result(RESULTS / ("gateway_tokenize_bench_control.json" if args.control else "gateway_tokenize_bench.json"),
                 results)


if __name__ == "__main__":
    main()
