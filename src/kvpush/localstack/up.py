"""`kvpush up`: bring a local P/D stack up, print where it is and how to use it, keep it up until Ctrl-C.

Steps:
  1. build (or reuse) the tiny model, or take `--model PATH`; start the directory, a prefill and a decode vLLM
     engine with KVPushConnector (and, with --colocated, a reference engine without one) and the gateway, printing
     progress. The gateway requires an API key, generated here (`--no-api-key`: none);
  2. write the stack's addresses and the key to the state file (`kvpush.cli.up.state_path()`, readable by the user
     alone), which `kvpush engines`, `transfers`, `trace` and `health` read when given no address; print every URL
     (gateway, engines, directory, metrics, logs), the key, once, and ready-to-paste curl and `openai` examples;
  3. wait for SIGINT (Ctrl-C) or SIGTERM; then stop every process (each stop bounded), remove the state file and
     exit 0.
A signal during start-up stops what had started. `make run` stays the checked demo (`kvpush.localstack.demo`).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import threading
from pathlib import Path

from kvpush.cli.up import UpState, add_arguments, remove_state, state_path
from kvpush.localstack.model import TinyModelSpec
from kvpush.localstack.stack import LocalStack
from kvpush.observability import configure_logging

# The tiny model's name at the gateway; a `--model` folder is served under its folder name.
TINY_MODEL_NAME = "tiny"


def _say(message: str) -> None:
    print(message, flush=True)


def usage_text(stack: LocalStack, *, model: str, api_key: str, state_file: Path) -> str:
    """The URLs of a started stack, its API key and examples to paste."""
    assert stack.directory is not None and stack.prefill is not None and stack.decode is not None, "not started"
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
    lines.append(f"  state file            {state_file}  (read by kvpush engines, transfers, trace, health)")
    auth = ""
    if api_key:
        # The key is printed here alone; the examples read it from the variable (the openai client reads it too).
        lines += ["", "The gateway requires this API key (also in the state file):",
                  f"  export OPENAI_API_KEY={api_key}"]
        auth = " -H \"Authorization: Bearer $OPENAI_API_KEY\""
    lines += ["", "Try it:",
              f"  curl -s {stack.gateway_url}/v1/completions -H 'Content-Type: application/json'{auth} \\",
              f"       -d '{{\"model\": \"{model}\", \"prompt\": \"The capital of France is\", \"max_tokens\": 12}}'",
              "",
              "  python - <<'EOF'",
              "  from openai import OpenAI",
              f"  client = OpenAI(base_url=\"{stack.gateway_url}/v1\"" + (")" if api_key else ", api_key=\"unused\")"),
              f"  answer = client.chat.completions.create(model=\"{model}\", max_tokens=12,",
              "      messages=[{\"role\": \"user\", \"content\": \"Tell me a story about a lighthouse.\"}])",
              "  print(answer.choices[0].message.content)",
              "  EOF",
              "",
              "  kvpush engines             # the registered engines",
              "  kvpush transfers           # recent transfers",
              "  kvpush trace TRANSFER_ID   # one transfer's timeline (id: the X-KVPush-Transfer-Id header)",
              "",
              "Ctrl-C stops everything."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `kvpush up`; returns the exit code."""
    parser = argparse.ArgumentParser(prog="kvpush up", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def engine_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The vLLM flags `kvpush up` adds to every engine's (they follow the stack's, so they win)."""
    flags = ["--max-model-len", str(args.max_model_len)]
    if args.device == "cuda":
        flags.append("--no-enforce-eager")
    if args.tensor_parallel_size != 1:
        flags += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    if args.gpu_memory_utilization is not None:
        flags += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    return tuple(flags)


def served_model_name(args: argparse.Namespace) -> str:
    """The model's name at the gateway."""
    if args.served_model_name:
        return args.served_model_name
    return args.model.resolve().name if args.model is not None else TINY_MODEL_NAME


def _build_stack(args: argparse.Namespace, api_key: str) -> LocalStack:
    if args.model is not None and not (args.model / "config.json").is_file():
        raise ValueError(f"--model {args.model}: no config.json there (a Hugging Face model folder is needed)")
    if args.tensor_parallel_size < 1 or args.max_model_len < 1:
        raise ValueError("--tensor-parallel-size and --max-model-len must be at least 1")
    key_env = {"KVPUSH_GATEWAY_API_KEY": api_key} if api_key else {}
    engine_env = {"UCX_NET_DEVICES": "lo", **(key_env if args.hosted_gateway else {})}
    return LocalStack(spec=TinyModelSpec(), model_dir=args.model.resolve() if args.model is not None else None,
                      engine_args=engine_args(args), served_model_name=served_model_name(args),
                      progress=lambda m: _say("  " + m), engine_timeout_s=args.engine_timeout,
                      with_colocated=args.colocated,
                      serve_metrics=not args.no_metrics, gateway_port=args.gateway_port or None,
                      hosted_gateway=args.hosted_gateway, service_env=key_env, engine_env=engine_env)


def run(args: argparse.Namespace) -> int:
    """Start, write the state file, print, wait for a signal, stop."""
    configure_logging(level="WARNING", fmt="console")
    stopping = threading.Event()
    received: list[int] = []

    def on_signal(signum, frame):
        received.append(signum)
        stopping.set()
        if not started.is_set():
            raise KeyboardInterrupt(f"signal {signum}")  # interrupts start-up; start() stops what started

    started = threading.Event()
    api_key = "" if args.no_api_key else secrets.token_urlsafe(24)
    try:
        stack = _build_stack(args, api_key)
    except ValueError as error:
        print(f"kvpush up: {error}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    path = state_path()
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
        model = served_model_name(args)
        assert stack.directory is not None
        UpState(pid=os.getpid(), directory_address=stack.directory.address, gateway_url=stack.gateway_url,
                model=model, api_key=api_key, log_dir=str(stack.log_dir),
                engines={e.spec.name: e.url for e in stack.engines()}).write(path)
        _say(usage_text(stack, model=model, api_key=api_key, state_file=path))
        while not stopping.wait(1.0):
            dead = [p.name for p in stack.processes() if not p.alive()]
            if dead:
                _say(f"{', '.join(dead)} exited; stopping the stack (logs: {stack.log_dir})")
                return 1
        _say(f"\n{signal.Signals(received[0]).name}: stopping the stack ...")
        return 0
    finally:
        remove_state(path)
        stack.stop()
        _say("stopped.")


if __name__ == "__main__":
    sys.exit(main())
