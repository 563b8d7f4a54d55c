"""What the gateway adds to the time to first token, with stand-in engines (no vLLM, no GPU), side by side in one run.

The engines are stand-ins that answer as vLLM does (a FastAPI app under uvicorn, each in a process of its own): a
streamed completion's token event comes `--prefill-ms` after the request, decode's events 5 ms later. Every round
sends one streamed request of each kind, in rotating order, the same token-id prompt:
  direct      straight to the prefill stand-in (max_tokens=1, no kv_transfer_params): "P alone"
  standalone  through the standalone gateway (`python -m kvpush.gateway`, first token from prefill)
  hosted      through the gateway hosted in the prefill stand-in's server (`HostedGateway`, in-process legs)
  standalone_b  with --gateway-b-pythonpath DIR and/or --gateway-b-args ARGS: a second standalone gateway, run from
              another checkout (A/B of the gateway's code in one run: `git worktree add /tmp/before COMMIT`, then
              --gateway-b-pythonpath /tmp/before) or with other flags (e.g. --gateway-b-args=--no-uvloop)
TTFT is the request sent -> the first SSE event read by the client. The figures are the medians of each kind's
per-round difference from `direct` with a 95 % bootstrap interval: what the gateway's own work and hops cost, free of
the engines' noise, so on any host (the H200 host included: it needs only kvpush's wheel set).

    .venv/bin/python bench/gateway_latency_bench.py --rounds 200 [--prefill-ms 15] [--kinds direct,standalone,hosted]

JSON to stdout and bench/results/gateway-latency-<UTC>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import platform
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

from bench_io import emit  # bench/, this script's folder

ROOT = Path(__file__).resolve().parent.parent
# Appended, not prepended: where kvpush is installed as a wheel (the H200 host), the checkout's own kvpush/ folder must
# not shadow it; tests/ and bench/ come from the checkout.
sys.path.extend([str(ROOT), str(ROOT / "bench")])

KINDS = ("direct", "standalone", "hosted")
TOKEN_ID, TOKEN_TEXT = 17, " sea"
DECODE_LAG_S = 0.005


def _events(body: dict, role: str) -> list[dict]:
    """The streamed answer's events as vLLM sends them: prefill one token (ids when asked), decode three."""
    created, model = int(time.time()), body.get("model", "tiny")
    want_ids = bool(body.get("return_token_ids"))
    tokens = [(TOKEN_ID, TOKEN_TEXT)] if role == "prefill" else [(TOKEN_ID, TOKEN_TEXT), (18, " w"), (19, "s")]
    max_tokens = body.get("max_tokens") or len(tokens)
    tokens = tokens[:max_tokens]
    events = []
    for index, (token_id, text) in enumerate(tokens):
        last = index == len(tokens) - 1
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length" if last else None,
                  "stop_reason": None}
        if want_ids:
            choice["token_ids"] = [token_id]
            if index == 0:
                choice["prompt_token_ids"] = body.get("prompt")
        events.append({"id": "cmpl-standin", "object": "text_completion", "created": created, "model": model,
                       "choices": [choice]})
    if (body.get("stream_options") or {}).get("include_usage"):
        prompt_tokens = len(body.get("prompt") or [])
        events.append({"id": "cmpl-standin", "object": "text_completion", "created": created, "model": model,
                       "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(tokens),
                                                "total_tokens": prompt_tokens + len(tokens)}})
    return events


def serve_standin(role: str, port: int, prefill_s: float) -> None:
    """A stand-in engine's process: FastAPI under uvicorn (as vLLM's API server), hosting the gateway when its
    environment carries the hosted gateway's flags (`KVPUSH_GATEWAY_ARGS`)."""
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    from kvpush.gateway.hosted import ARGS_ENV, HostedGateway

    app = FastAPI()

    async def completions(request):  # Starlette's form: the request, as vLLM's handlers get it
        body = await request.json()
        events = _events(body, role)
        delay_s = prefill_s + (DECODE_LAG_S if role == "decode" else 0.0)
        if not body.get("stream"):
            await asyncio.sleep(delay_s)
            return JSONResponse(events[0])

        async def stream():
            await asyncio.sleep(delay_s)
            for event in events:
                yield b"data: " + json.dumps(event).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        return StreamingResponse(stream(), media_type="text/event-stream")

    app.router.add_route("/v1/completions", completions, methods=["POST"])

    if os.environ.get(ARGS_ENV):
        app.add_middleware(HostedGateway)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")


def first_event_s(port: int, body: dict) -> float:
    """Send a streamed completion; seconds from sending to the first `data:` line; the rest is read to [DONE]."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    payload = json.dumps(body).encode()
    try:
        sent = time.monotonic()
        connection.request("POST", "/v1/completions", payload, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status} from port {port}: {response.read()[:300]!r}")
        first = None
        while True:  # chunked framing lines pass by; only the events matter
            line = response.fp.readline()
            if not line:
                raise RuntimeError(f"stream from port {port} ended without [DONE]")
            if first is None and line.startswith(b"data:"):
                first = time.monotonic()
            if b"[DONE]" in line:
                return first - sent
    finally:
        connection.close()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--prefill-ms", type=float, default=15.0, help="the stand-in prefill's time to its token")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--kinds", default=",".join(KINDS), help="which kinds besides direct (always sent)")
    parser.add_argument("--gateway-b-pythonpath", default=None,
                        help="a checkout whose gateway runs as kind standalone_b beside this one's")
    parser.add_argument("--gateway-b-args", default="", help="more flags for the standalone_b gateway")
    parser.add_argument("--gap-s", type=float, default=0.02, help="pause between requests")
    parser.add_argument("--pin-gateways", action="store_true",
                        help="standalone gateways on the last CPU, everything else on the others: on a machine with "
                             "few cores, so that the gateway's own work is what the figures show")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    # Internal: the bench starts each stand-in engine as this script with these two flags.
    parser.add_argument("--serve-standin", choices=("prefill", "decode"), help=argparse.SUPPRESS)
    parser.add_argument("--standin-port", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.serve_standin:
        serve_standin(args.serve_standin, args.standin_port, args.prefill_ms / 1000)
        return 0
    from hops_bench import _median, _median_ci95  # after kvpush: it puts the checkout first on sys.path

    from kvpush.client import ChannelConfig, SyncDirectoryClient
    from kvpush.localstack.processes import ManagedProcess, free_port, start_directory, start_gateway, tcp_open
    from kvpush.localstack.stack import hosted_gateway_env
    from kvpush.v1 import types_pb2 as tpb
    from tests.unit.services.gateway.test_gateway import register_standin

    kinds = ["direct"] + [k for k in args.kinds.split(",") if k and k != "direct"]
    if args.gateway_b_pythonpath or args.gateway_b_args:
        kinds.append("standalone_b")
    log_dir = Path(tempfile.mkdtemp(prefix="kvpush-gateway-latency-"))
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin_gateways and len(cpus) > 1:
        os.sched_setaffinity(0, cpus[:-1])  # inherited by every process started from here on
    directory = start_directory(log_dir)
    ports = {"prefill": free_port(), "decode": free_port(), "hosted": free_port()}
    hosted_env = (hosted_gateway_env(ports["hosted"], directory.address, "standin-prefill")
                  if "hosted" in kinds else {})
    standins = {role: ManagedProcess(f"standin-{role}", [sys.executable, __file__, "--serve-standin", role,
                                                          "--standin-port", str(ports[role]),
                                                          "--prefill-ms", str(args.prefill_ms)],
                                     log_dir / f"standin-{role}.log", env=hosted_env if role == "prefill" else {})
                for role in ("prefill", "decode")}
    client = SyncDirectoryClient(ChannelConfig(address=directory.address, timeout_s=5.0))
    gateways = {}
    try:
        for role, process in standins.items():
            process.start().wait_ready(lambda port=ports[role]: tcp_open("127.0.0.1", port), 60.0, poll_s=0.1)
        for role, engine_role in (("prefill", tpb.ENGINE_ROLE_PREFILL), ("decode", tpb.ENGINE_ROLE_DECODE)):
            register_standin(client, role, engine_role, f"http://127.0.0.1:{ports[role]}",
                             block_count=max(64, args.prompt_tokens // 4))
        flags = ["--prefill-timeout", "10", "--decode-timeout", "10"]
        if "standalone" in kinds:
            gateways["standalone"] = start_gateway(log_dir, directory_address=directory.address, extra_args=flags)
        if "standalone_b" in kinds:
            pythonpath = [p for p in (args.gateway_b_pythonpath, os.environ.get("PYTHONPATH")) if p]
            gateways["standalone_b"] = start_gateway(
                log_dir, directory_address=directory.address, extra_args=flags + shlex.split(args.gateway_b_args),
                name="gateway-b", env={"PYTHONPATH": os.pathsep.join(pythonpath)})
        if args.pin_gateways and len(cpus) > 1:
            for handle in gateways.values():
                os.sched_setaffinity(handle.process.popen.pid, cpus[-1:])
        if "hosted" in kinds:  # it starts after the prefill stand-in's own start-up
            standins["prefill"].wait_ready(lambda: tcp_open("127.0.0.1", ports["hosted"]), 30.0, poll_s=0.1)
        port_of = {"direct": ports["prefill"], "hosted": ports["hosted"],
                   **{kind: handle.port for kind, handle in gateways.items()}}
        rng = random.Random(0)
        prompt = [rng.randrange(3, 1000) for _ in range(args.prompt_tokens)]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "stream": True}
        ttft_ms: dict[str, list[float]] = {kind: [] for kind in kinds}
        for index in range(args.warmup + args.rounds):
            shift = index % len(kinds)
            for kind in kinds[shift:] + kinds[:shift]:
                seconds = first_event_s(port_of[kind], {**body, "max_tokens": 1} if kind == "direct" else body)
                if index >= args.warmup:
                    ttft_ms[kind].append(seconds * 1000)
                time.sleep(args.gap_s)
    finally:
        for handle in gateways.values():
            handle.process.stop(grace_s=5.0)
        client.close()
        for process in standins.values():
            process.stop(grace_s=5.0)
        directory.process.stop(grace_s=5.0)
    over_direct = {kind: [a - b for a, b in zip(ttft_ms[kind], ttft_ms["direct"])] for kind in kinds[1:]}
    result = {
        "bench": "gateway_latency", "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": {"rounds": args.rounds, "prefill_ms": args.prefill_ms, "prompt_tokens": args.prompt_tokens,
                   "kinds": kinds, "gateway_b_pythonpath": args.gateway_b_pythonpath,
                   "gateway_b_args": args.gateway_b_args, "pin_gateways": args.pin_gateways,
                   "host": platform.node(), "cpu_count": os.cpu_count(), "python": platform.python_version()},
        "ttft_median_ms": {kind: _median(values) for kind, values in ttft_ms.items()},
        "over_direct_median_ms": {kind: _median(values) for kind, values in over_direct.items()},
        "over_direct_ci95": {kind: _median_ci95(values) for kind, values in over_direct.items()},
    }
    if "standalone_b" in kinds:
        b_minus_a = [b - a for a, b in zip(ttft_ms["standalone"], ttft_ms["standalone_b"])]
        result["standalone_b_minus_standalone_median_ms"] = _median(b_minus_a)
        result["standalone_b_minus_standalone_ci95"] = _median_ci95(b_minus_a)
    emit(result, args.out, "gateway-latency")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
