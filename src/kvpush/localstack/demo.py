"""`python -m kvpush.localstack.demo` (what `make run` runs): the whole P/D stack on this machine, checked end to end.

Steps:
  1. build (or reuse) the tiny random Llama and its tokenizer;
  2. start the KV directory, a prefill and a decode vLLM engine with KVPushConnector, a colocated
     reference engine (no connector) and the gateway, printing progress while engines load;
  3. send a few greedy requests (temperature 0; completions and chat; prompts from a few tokens to
     several KV blocks) through the gateway, again through the gateway hosted in the prefill engine's API
     server (docs/gateway.md), and the same requests to the colocated engine;
  4. check each disaggregated output token-for-token against the colocated one and print each
     transfer's timeline (the directory's record, with each prefill rank's push timing);
  5. exit 0 only if every request succeeded and matched; stop every process in all cases.
Any failure is printed with what failed and where its log is; nothing fails silently.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from datetime import UTC, datetime

from kvpush.localstack.client import call
from kvpush.localstack.model import TinyModelSpec
from kvpush.localstack.pki import HAVE_OPENSSL
from kvpush.localstack.stack import LocalStack
from kvpush.observability import configure_logging

_WORDS = ["the", "prefill", "engine", "writes", "every", "layer", "of", "the", "key", "and", "value", "cache", "into",
          "blocks", "that", "the", "decode", "engine", "allocated", "before", "the", "prompt", "was", "computed",
          "while", "the", "directory", "watches", "each", "transfer"]


def _prompt(word_count: int) -> str:
    return " ".join(_WORDS[i % len(_WORDS)] for i in range(word_count))


# (label, path, body) — greedy, fixed length, token ids returned for an exact comparison.
REQUESTS = [
    ("short completion", "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 12}),
    ("~150-token completion", "/v1/completions", {"prompt": _prompt(120), "max_tokens": 12}),
    ("~600-token completion (several KV blocks)", "/v1/completions", {"prompt": _prompt(480), "max_tokens": 12}),
    ("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story about a lighthouse."}],
                                      "max_tokens": 12}),
]


def _say(message: str) -> None:
    print(message, flush=True)


def _tokens(answer: dict) -> list[int] | str:
    choice = answer["choices"][0]
    if choice.get("token_ids"):
        return list(choice["token_ids"])
    return choice.get("text") if "text" in choice else (choice.get("message") or {}).get("content", "")


def _ts(timestamp, origin) -> str:
    if not timestamp.seconds and not timestamp.nanos:
        return "-"
    return f"+{(timestamp.ToNanoseconds() - origin.ToNanoseconds()) / 1e6:.1f} ms"


def _print_timeline(stack: LocalStack, answer: dict) -> None:
    info = answer.get("kvpush") or {}
    transfer_id = info.get("transfer_id")
    if not transfer_id:
        _say("    (no transfer id in the response)")
        return
    from kvpush.client import SyncDirectoryClient
    from kvpush.v1 import types_pb2

    client = SyncDirectoryClient(stack.directory_channel(timeout_s=5.0, max_attempts=2))
    try:
        transfer = client.get_transfer(transfer_id)
    finally:
        client.close()
    origin = transfer.create_time
    _say(f"    transfer {transfer_id}: {types_pb2.TransferState.Name(transfer.state)}"
         f"{' (' + transfer.failure_reason + ')' if transfer.failure_reason else ''}; "
         f"{transfer.prompt_token_count} prompt tokens, {transfer.layers_written_count} layers written, "
         f"{transfer.bytes_written} bytes")
    _say(f"      planned {datetime.fromtimestamp(origin.ToNanoseconds() / 1e9, UTC):%H:%M:%S.%f}"
         f" | decode allocated {_ts(transfer.allocate_time, origin)} | first layer ready "
         f"{_ts(transfer.first_ready_time, origin)} | push dispatched {_ts(transfer.dispatch_time, origin)}"
         f" | ended {_ts(transfer.end_time, origin)}")
    for rank in transfer.rank_timings:
        _say(f"      prefill rank {rank.tp_rank}: " + _describe_push(rank.timing, origin))
    if not transfer.rank_timings:
        _say("      prefill reported no push timing")


def _describe_push(timing, origin) -> str:
    """One line from a prefill rank's TransferTiming (times relative to when the transfer was planned)."""
    tail = "-"
    if timing.HasField("last_write_end_time") and timing.HasField("prefill_end_time"):
        tail_ns = timing.last_write_end_time.ToNanoseconds() - timing.prefill_end_time.ToNanoseconds()
        tail = f"{tail_ns / 1e6:.1f} ms"
    return (f"{timing.layers_written_before_prefill_end_count} layers written before prefill ended; "
            f"{timing.write_count} WRITEs ({timing.descriptor_count} descriptors, "
            f"{timing.post_duration.ToNanoseconds() / 1e6:.2f} ms posting); first write "
            f"{_ts(timing.first_write_start_time, origin)}, prefill end {_ts(timing.prefill_end_time, origin)}, "
            f"last write end {_ts(timing.last_write_end_time, origin)} (exposed tail {tail})")


def run(args: argparse.Namespace) -> int:
    """Start the stack, run the checks, print a verdict; returns the exit code."""
    _say("kvpush demo: push-based, layer-streamed KV transfer between a prefill and a decode vLLM engine (CPU)")
    stack = LocalStack(spec=TinyModelSpec(), progress=lambda m: _say("  " + m), engine_timeout_s=args.engine_timeout,
                       mutual_tls=args.mutual_tls, hosted_gateway=True)
    failures: list[str] = []
    try:
        try:
            stack.start()
        except Exception as error:
            _say(f"\nFAILED to start the stack: {error}")
            _say(f"Process logs: {stack.log_dir}")
            return 2
        _say("\nSending greedy requests through the gateway, the gateway in the prefill engine and to the colocated "
             "engine:")
        gateways = (("gateway", stack.gateway_url), ("gateway in prefill", stack.hosted_gateway_url))
        for (label, path, body), (gateway, gateway_url) in ((r, g) for r in REQUESTS for g in gateways):
            label = f"{label}, {gateway}"
            body = {"model": "tiny", "temperature": 0.0, "ignore_eos": True, "return_token_ids": True, **body}
            started = time.perf_counter()
            disaggregated = call("POST", gateway_url + path, body, timeout_s=args.request_timeout)
            took_ms = (time.perf_counter() - started) * 1000
            assert stack.colocated is not None
            reference = call("POST", stack.colocated.url + path, body, timeout_s=args.request_timeout)
            if disaggregated.status != 200:
                failures.append(f"{label}: answered HTTP {disaggregated.status}: {disaggregated.text[:300]}")
                _say(f"  [FAIL] {label}: HTTP {disaggregated.status}: {disaggregated.text[:300]}")
                transfer_id = disaggregated.headers.get("x-kvpush-transfer-id")
                if transfer_id:
                    _print_timeline(stack, {"kvpush": {"transfer_id": transfer_id}})
                continue
            if reference.status != 200:
                failures.append(f"{label}: colocated engine answered HTTP {reference.status}")
                _say(f"  [FAIL] {label}: colocated HTTP {reference.status}: {reference.text[:300]}")
                continue
            got, want = _tokens(disaggregated.body), _tokens(reference.body)
            verdict = "OK  " if got == want else "FAIL"
            if got != want:
                failures.append(f"{label}: disaggregated output {got!r} != colocated {want!r}")
            _say(f"  [{verdict}] {label}: {took_ms:.0f} ms via P/D; tokens {'identical' if got == want else 'DIFFER'}"
                 f" ({len(got)} tokens)")
            if got != want:
                _say(f"    P/D:       {got}\n    colocated: {want}")
            try:
                _print_timeline(stack, disaggregated.body)
            except Exception as error:  # the timeline is information; its absence is reported, not fatal
                _say(f"    (timeline unavailable: {error})")
    finally:
        _say("\nStopping the stack ...")
        stack.stop()
    if failures:
        _say(f"\nFAILED: {len(failures)} of {2 * len(REQUESTS)} requests:")
        for failure in failures:
            _say(f"  - {failure}")
        _say(f"Process logs: {stack.log_dir}")
        return 1
    _say(f"\nPASSED: {2 * len(REQUESTS)} disaggregated requests (each of {len(REQUESTS)} through both gateways) "
         "token-identical to the colocated engine.")
    _say("(This 2-layer model computes a prompt in one step of a few ms, faster than the push instruction's round "
         "trip, so its layers are written just after prefill; `python bench/ttft_bench.py` shows the streaming "
         "on an 8-layer model over a shaped link.)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; SIGINT/SIGTERM still stop every process."""
    parser = argparse.ArgumentParser(prog="python -m kvpush.localstack.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--engine-timeout", type=float, default=600.0, help="seconds for all engines to load")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request")
    parser.add_argument("--mutual-tls", action=argparse.BooleanOptionalAction, default=HAVE_OPENSSL,
                        help="mutual TLS with per-engine identities on every directory channel (default on when "
                             "the openssl CLI can make the certificates; docs/security.md)")
    args = parser.parse_args(argv)
    # The demo narrates itself; kvpush's own info lines (process started, ...) would interleave.
    configure_logging(level="WARNING", fmt="console")

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    try:
        return run(args)
    except KeyboardInterrupt:
        _say("interrupted; stack stopped")
        return 130


if __name__ == "__main__":
    sys.exit(main())
