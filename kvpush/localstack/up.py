"""`kvpush up`: bring the local P/D stack up, print where it is and how to use it, keep it up until Ctrl-C.

Steps:
  1. build (or reuse) the tiny model; start the directory, a prefill and a decode vLLM engine with
     KVPushConnector (and, with --colocated, a reference engine without one) and the gateway, printing progress;
  2. print every URL (gateway, engines, directory, metrics, logs) and ready-to-paste curl and `openai` examples;
  3. wait for SIGINT (Ctrl-C) or SIGTERM; then stop every process (each stop bounded) and exit 0.
A signal during start-up stops what had started. `make run` stays the checked demo (`kvpush.demo`).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from kvpush.localstack.model import TinyModelSpec
from kvpush.localstack.stack import LocalStack
from kvpush.observability import configure_logging


def _say(message: str) -> None:
    print(message, flush=True)


def usage_text(stack: LocalStack) -> str:
    """The URLs of a started stack and examples to paste."""
    lines = ["", "kvpush stack is up.", f"  gateway (OpenAI API)  {stack.gateway_url}/v1",
             f"  directory (gRPC)      {stack.directory.address}",
             f"  prefill engine        {stack.prefill.url}", f"  decode engine         {stack.decode.url}"]
    if stack.hosted_gateway:
        lines.insert(3, f"  gateway in prefill    {stack.hosted_gateway_url}/v1  (hosted in its API server)")
    if stack.colocated is not None:
        lines.append(f"  colocated (reference) {stack.colocated.url}")
    for name, url in stack.metrics_urls().items():
        lines.append(f"  metrics {name:<13} {url}")
    lines.append(f"  process logs          {stack.log_dir}")
    pids = ", ".join(f"{p.name} {p.pid}" for p in stack.processes())
    lines.append(f"  processes             {pids}")
    model = stack.prefill.spec.served_model_name
    lines += ["", "Try it:",
              f"  curl -s {stack.gateway_url}/v1/completions -H 'Content-Type: application/json' \\",
              f"       -d '{{\"model\": \"{model}\", \"prompt\": \"The capital of France is\", \"max_tokens\": 12}}'",
              "",
              "  python - <<'EOF'",
              "  from openai import OpenAI",
              f"  client = OpenAI(base_url=\"{stack.gateway_url}/v1\", api_key=\"unused\")",
              f"  answer = client.chat.completions.create(model=\"{model}\", max_tokens=12,",
              "      messages=[{\"role\": \"user\", \"content\": \"Tell me a story about a lighthouse.\"}])",
              "  print(answer.choices[0].message.content)",
              "  EOF",
              "",
              f"  kvpush transfers --address {stack.directory.address}          # recent transfers",
              f"  kvpush trace TRANSFER_ID --address {stack.directory.address}  # one transfer's timeline "
              "(id: X-KVPush-Transfer-Id header)",
              "",
              "Ctrl-C stops everything."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `kvpush up`; returns the exit code."""
    parser = argparse.ArgumentParser(prog="kvpush up", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `kvpush up`."""
    parser.add_argument("--colocated", action="store_true", help="also start a reference engine without a connector")
    parser.add_argument("--gateway-port", type=int, default=0, help="gateway port (default: a free one)")
    parser.add_argument("--hosted-gateway", action="store_true",
                        help="also serve a gateway from the prefill engine's API server (docs/gateway.md)")
    parser.add_argument("--engine-timeout", type=float, default=600.0, help="seconds for the engines to load")
    parser.add_argument("--no-metrics", action="store_true", help="do not serve /metrics on the directory and engines")


def run(args: argparse.Namespace) -> int:
    """Start, print, wait for a signal, stop."""
    configure_logging(level="WARNING", fmt="console")
    stopping = threading.Event()
    received: list[int] = []

    def on_signal(signum, frame):
        received.append(signum)
        stopping.set()
        if not started.is_set():
            raise KeyboardInterrupt(f"signal {signum}")  # interrupts start-up; start() stops what started

    started = threading.Event()
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    stack = LocalStack(spec=TinyModelSpec(), progress=lambda m: _say("  " + m), engine_timeout_s=args.engine_timeout,
                       with_colocated=args.colocated, serve_metrics=not args.no_metrics,
                       gateway_port=args.gateway_port or None, hosted_gateway=args.hosted_gateway)
    _say("kvpush up: starting the local P/D stack (directory, prefill and decode vLLM engines, gateway)")
    try:
        try:
            stack.start()
        except KeyboardInterrupt:
            _say("interrupted during start-up; everything that had started is stopped")
            return 130
        except Exception as error:
            _say(f"FAILED to start the stack: {error}\nProcess logs: {stack.log_dir}")
            return 1
        started.set()
        _say(usage_text(stack))
        while not stopping.wait(1.0):
            dead = [p.name for p in stack.processes() if not p.alive()]
            if dead:
                _say(f"{', '.join(dead)} exited; stopping the stack (logs: {stack.log_dir})")
                return 1
        _say(f"\n{signal.Signals(received[0]).name}: stopping the stack ...")
        return 0
    finally:
        stack.stop()
        _say("stopped.")


if __name__ == "__main__":
    sys.exit(main())
