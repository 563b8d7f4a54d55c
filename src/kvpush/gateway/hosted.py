"""The gateway hosted in a prefill engine's API server: vLLM's `--middleware` loads `HostedGateway`, which serves the
gateway's routes on a port of their own from the API server's event loop.

What it changes: no gateway process to deploy or scale (one per prefill engine, clients spread over them by any
L4 balancer), and each request's prefill leg stays in the process (`--local-prefill-engine`), as an ASGI call into
vLLM's app below this middleware (`in_process`), not HTTP. It is not faster: on the H200 host a request through it
took as long as through the standalone gateway, in-process legs included (docs/performance-log.md, 2026-12-04).
The gateway's cost is its own work, which here shares vLLM's event loop, not the extra process or the leg's HTTP;
hence the plan waits for vLLM to take the local leg first (`dispatch.HOSTED_PLAN_WAIT_S`: without it, 1 ms slower).
The gateway acts as the operator at the directory: its credentials live in the engine's process (docs/security.md).

    KVPUSH_GATEWAY_ARGS="--port 8080 --directory dir:50051 --local-prefill-engine prefill-0" \\
        vllm serve MODEL --kv-transfer-config '{...KVPushConnector, kv_producer...}' \\
        --middleware kvpush.gateway.hosted.HostedGateway

`KVPUSH_GATEWAY_ARGS` takes the standalone gateway's flags (`python -m kvpush.gateway --help`). The gateway
starts after vLLM's own start-up and stops before vLLM's shutdown; bad flags, or a port it cannot bind, fail vLLM's
start-up with the reason (uvicorn exits). Every other request passes through to vLLM untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import shlex

from aiohttp import web

from kvpush.gateway.app import create_app
from kvpush.gateway.config import GatewayConfig, parse_args
from kvpush.gateway.in_process import InProcessSession
from kvpush.observability import configure_logging, configure_tracing, get_logger, shutdown_tracing

ARGS_ENV = "KVPUSH_GATEWAY_ARGS"
_log = get_logger("gateway.hosted")


def hosted_config(environ: dict[str, str] | None = None) -> GatewayConfig:
    """The gateway's config from `KVPUSH_GATEWAY_ARGS`; ValueError with argparse's message when it is bad."""
    text = (os.environ if environ is None else environ).get(ARGS_ENV)
    if text is None:
        raise ValueError(f"{ARGS_ENV} is not set: it holds the gateway's flags (e.g. '--port 8080 --directory "
                         f"HOST:PORT --local-prefill-engine ENGINE_ID')")
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return dataclasses.replace(parse_args(shlex.split(text)), hosted=True)
    except SystemExit as error:  # argparse's way of refusing flags; keep its message, not the exit
        message = stderr.getvalue().strip().splitlines()
        raise ValueError(f"{ARGS_ENV}: {message[-1] if message else f'bad flags (exit {error.code})'}") from None


class HostedGateway:
    """ASGI middleware: the gateway's aiohttp server on the API server's loop, bound to vLLM's lifespan."""

    def __init__(self, app) -> None:
        self.app = app
        self._runner: web.AppRunner | None = None
        self._lifespan_scope: dict | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return
        self._lifespan_scope = scope

        async def receive_stopping_first():
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                await self._stop()  # no new gateway requests once vLLM starts to go
            return message

        async def send_starting_after(message):
            if message["type"] == "lifespan.startup.complete":
                try:
                    await self._start()
                except Exception as error:
                    _log.error("hosted gateway did not start", error=str(error))
                    await self._stop()
                    message = {"type": "lifespan.startup.failed", "message": f"kvpush hosted gateway: {error}"}
            await send(message)

        await self.app(scope, receive_stopping_first, send_starting_after)

    async def _start(self) -> None:
        config = hosted_config()
        configure_logging()
        configure_tracing("kvpush-gateway")
        local_legs = InProcessSession(self.app, self._lifespan_scope) if config.local_prefill_engine_id else None
        runner = web.AppRunner(create_app(config, local_legs), handler_cancellation=True, access_log=None,
                               shutdown_timeout=10.0)
        await runner.setup()
        self._runner = runner
        await web.TCPSite(runner, config.host, config.port, reuse_port=config.reuse_port or None).start()
        _log.info("hosted gateway serving", host=config.host, port=config.port,
                  local_prefill_engine=config.local_prefill_engine_id or None,
                  directory=config.directory_address or None)

    async def _stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
            shutdown_tracing()


__all__ = ["ARGS_ENV", "HostedGateway", "hosted_config"]
