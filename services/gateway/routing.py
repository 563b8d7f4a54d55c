"""Routing strategies: where a request's two legs go and what kv_transfer_params each carries.

One strategy per deployment (`GatewayConfig.mode`):
- `kvpush`      plans at the KV directory (PlanTransfer mints the transfer id and picks the engines);
                both legs go out at once; a failed leg cancels the transfer (CancelTransfer).
- `nixl-pull`   vLLM's NixlConnector proxy logic: prefill leg first, then the decode leg carrying
                the prefill response's kv_transfer_params (sequential by design).
- `nixl-push`   vLLM's NixlPushConnector: both legs at once, matched by the shared X-Request-Id;
                decode learns prefill's engine id and side channel from static configuration.
The two NIXL modes exist so that benchmarks compare kvpush with vLLM's own connectors through the
same gateway code.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from kvpush.observability import get_logger
from kvpush.services.client import ChannelConfig, DirectoryCallError, DirectoryClient
from kvpush.services.gateway.config import GatewayConfig
from kvpush.services.gateway.errors import GatewayError, bad_gateway, unavailable
from kvpush.v1 import types_pb2

_log = get_logger("gateway.routing")
# How long the registered-engine list is reused for model checks and /tokenize endpoints.
ENGINE_CACHE_S = 2.0


@dataclass
class Route:
    """Where one request's legs go, and the parameters each leg carries."""

    prefill_url: str
    decode_url: str
    prefill_params: dict[str, Any]
    # None: the decode leg waits for the prefill response and carries its kv_transfer_params (pull).
    decode_params: dict[str, Any] | None
    transfer_id: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def concurrent(self) -> bool:
        """True when both legs are sent at the same time."""
        return self.decode_params is not None


class Router(Protocol):
    """A routing strategy (see the module docstring)."""

    async def plan(self, request_id: str, prompt_token_count: int, traceparent: str, model: str = "") -> Route:
        """Choose engines (serving `model` when given) and build both legs' parameters; GatewayError when impossible."""

    async def tokenizer_url(self, model: str) -> str | None:
        """An engine URL whose /tokenize counts prompt tokens for `model` (None: do not count)."""

    async def fits_every_decode_engine(self, token_count: int, model: str) -> bool:
        """True when every decode engine for `model` last reported room for `token_count` tokens."""

    async def cancel(self, route: Route, reason: str) -> None:
        """Give up a route after a failed leg (never raises)."""

    async def report_unreachable(self, route: Route, leg: str, reason: str) -> str | None:
        """Report that `leg`'s engine of `route` could not be reached (never raises). The result: "marked",
        "stale" (the engine restarted since the plan) or "failed" (the report failed), and the request may be
        planned again; None: this strategy has no other engine, so planning again cannot help."""

    async def healthy(self) -> tuple[bool, str]:
        """Whether requests can be routed now, and why not."""

    async def model_source_url(self) -> str | None:
        """An engine URL whose /v1/models answers for the deployment."""

    async def close(self) -> None:
        """Release connections."""


# ---------------------------------------------------------------- kvpush (directory)

# gRPC codes from PlanTransfer, mapped to what the client sees.
_PLAN_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: 503,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.NOT_FOUND: 503,
    grpc.StatusCode.FAILED_PRECONDITION: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.UNAUTHENTICATED: 502,
    grpc.StatusCode.PERMISSION_DENIED: 502,
    grpc.StatusCode.INVALID_ARGUMENT: 502,
}


class DirectoryRouter:
    """kvpush routing: PlanTransfer at the directory, concurrent legs, CancelTransfer on failure.

    Goes through the client library (`DirectoryClient`): per-call deadlines, one retry on UNAVAILABLE.
    """

    def __init__(self, config: GatewayConfig) -> None:
        if not config.directory_address:
            raise ValueError("kvpush mode needs a directory address (--directory or KVPUSH_DIRECTORY_ADDRESS)")
        self._config = config
        overrides = {"address": config.directory_address, "timeout_s": config.plan_timeout_s, "max_attempts": 2}
        if config.directory_token:
            overrides["token"] = config.directory_token
        self._client = DirectoryClient(ChannelConfig.from_env(**overrides))
        self._engines: list[tpb.Engine] = []
        self._engines_read_at: float | None = None  # monotonic time of the last read that succeeded
        self._engines_reading: asyncio.Task | None = None

    async def _registered(self) -> list[tpb.Engine]:
        """Registered workers (for model checks, /tokenize and free-block checks), at most ENGINE_CACHE_S + one
        ListEngines round trip old.

        Only a gateway that has never read the list waits for it; after that an old list is used as it is and
        re-read in the background, one read at a time, so no request pays a ListEngines round trip on its way
        to PlanTransfer (with requests more than ENGINE_CACHE_S apart, every request did).
        """
        if self._engines_read_at is None:
            await self._read_engines()
        elif (time.monotonic() - self._engines_read_at >= ENGINE_CACHE_S
              and (self._engines_reading is None or self._engines_reading.done())):
            self._engines_reading = asyncio.create_task(self._read_engines())
        return self._engines

    async def _read_engines(self) -> None:
        started = time.monotonic()
        try:
            self._engines = await self._client.list_engines()
            self._engines_read_at = started
        except DirectoryCallError as error:
            _log.warning("engine list unavailable", code=error.code.name, details=error.details)

    async def _check_model(self, model: str) -> None:
        engines = await self._registered()
        if engines and not any(e.model == model for e in engines):
            served = sorted({e.model for e in engines if e.model})
            raise GatewayError(404, f"model {model!r} is not served here; served: {', '.join(served) or 'none'}",
                               "invalid_request_error", "model")

    async def tokenizer_url(self, model: str) -> str | None:
        """A prefill engine's endpoint for `model` (its /tokenize applies the model's tokenizer and chat template)."""
        for engine in await self._registered():
            if engine.role == types_pb2.ENGINE_ROLE_PREFILL and engine.endpoint and (not model or engine.model == model):
                return engine.endpoint.rstrip("/")
        return None

    async def fits_every_decode_engine(self, token_count: int, model: str) -> bool:
        """From the cached engine list: every decode worker for `model` has free blocks for `token_count` tokens."""
        decodes = [e for e in await self._registered()
                   if e.role == types_pb2.ENGINE_ROLE_DECODE and (not model or e.model == model)]
        if not decodes:
            return False
        for engine in decodes:
            free = engine.load.free_block_count if engine.HasField("load") else engine.layout.block_count
            if free * engine.layout.block_size_tokens < token_count:
                return False
        return True

    async def plan(self, request_id: str, prompt_token_count: int, traceparent: str, model: str = "") -> Route:
        """PlanTransfer (by model), then build the kvpush legs' params from the transfer id and endpoints."""
        if model:
            await self._check_model(model)
        try:
            response = await self._client.plan_transfer(
                request_id=request_id, prompt_token_count=prompt_token_count, trace_context=traceparent,
                ttl_s=self._config.transfer_ttl_s or None, model=model)
        except DirectoryCallError as error:
            status = _PLAN_STATUS.get(error.code, 502)
            raise GatewayError(status, f"directory PlanTransfer failed: {error.code.name}: {error.details}",
                               "service_unavailable" if status == 503 else "bad_gateway") from error
        transfer = response.transfer
        if not response.prefill_endpoint or not response.decode_endpoint:
            await self.cancel(Route("", "", {}, {}, transfer.transfer_id), "engine has no endpoint")
            raise unavailable(f"planned engines have no HTTP endpoint (prefill {transfer.prefill_engine_id!r}: "
                              f"{response.prefill_endpoint!r}, decode {transfer.decode_engine_id!r}: "
                              f"{response.decode_endpoint!r}); set engine_endpoint in kv_connector_extra_config")
        common = {"transfer_id": transfer.transfer_id, "traceparent": traceparent}
        return Route(prefill_url=response.prefill_endpoint.rstrip("/"), decode_url=response.decode_endpoint.rstrip("/"),
                     prefill_params={**common, "do_remote_decode": True, "do_remote_prefill": False},
                     decode_params={**common, "do_remote_prefill": True, "do_remote_decode": False},
                     transfer_id=transfer.transfer_id,
                     extra={"prefill_engine_id": transfer.prefill_engine_id,
                            "decode_engine_id": transfer.decode_engine_id})

    async def cancel(self, route: Route, reason: str) -> None:
        """CancelTransfer with a bound; a failure to cancel is logged (the transfer's TTL still ends it)."""
        if not route.transfer_id:
            return
        try:
            await self._client.cancel_transfer(route.transfer_id, reason[:500])
        except DirectoryCallError as error:
            _log.warning("cancel transfer failed", transfer_id=route.transfer_id, code=error.code.name,
                         details=error.details)

    async def report_unreachable(self, route: Route, leg: str, reason: str) -> str | None:
        """ReportEngineUnreachable for `leg`'s planned engine ("prefill" or "decode"), bounded; see `Router`."""
        engine_id = route.extra.get(f"{leg}_engine_id", "")
        if not engine_id:
            return "failed"
        try:
            marked = await self._client.report_engine_unreachable(engine_id, route.transfer_id, reason[:1000])
        except DirectoryCallError as error:
            _log.warning("unreachable report failed", engine_id=engine_id, code=error.code.name,
                         details=error.details)
            return "failed"
        self._engines_read_at = -ENGINE_CACHE_S  # the cached engine list is out of date now
        return "marked" if marked else "stale"

    async def get_transfer(self, transfer_id: str) -> types_pb2.Transfer:
        """GetTransfer (for timelines); raises DirectoryCallError."""
        return await self._client.get_transfer(transfer_id)

    async def healthy(self) -> tuple[bool, str]:
        """Healthy when the directory answers and lists at least one prefill and one decode engine."""
        try:
            prefill = await self._client.list_engines(types_pb2.ENGINE_ROLE_PREFILL)
            decode = await self._client.list_engines(types_pb2.ENGINE_ROLE_DECODE)
        except DirectoryCallError as error:
            return False, f"directory unreachable: {error}"
        if not prefill or not decode:
            return False, f"directory lists {len(prefill)} prefill and {len(decode)} decode workers; need both"
        return True, f"{len(prefill)} prefill and {len(decode)} decode workers registered"

    async def directory_reachable(self) -> tuple[bool, str]:
        """Whether the directory answers at all (the gateway's own liveness)."""
        try:
            status = await self._client.health()
        except DirectoryCallError as error:
            return False, f"directory unreachable: {error}"
        return status == "SERVING", f"directory health {status}"

    async def model_source_url(self) -> str | None:
        """The first registered decode engine's endpoint."""
        try:
            for worker in await self._client.list_engines(types_pb2.ENGINE_ROLE_DECODE):
                if worker.endpoint:
                    return worker.endpoint.rstrip("/")
        except DirectoryCallError:
            return None
        return None

    async def close(self) -> None:
        """Stop a background engine-list read; close the gRPC channel."""
        if self._engines_reading is not None and not self._engines_reading.done():
            self._engines_reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._engines_reading
        await self._client.close()


# ---------------------------------------------------------------- vLLM NIXL baselines (static engines)


class StaticRouter:
    """One fixed prefill and decode engine, with vLLM's NixlConnector (pull) or NixlPushConnector params."""

    def __init__(self, config: GatewayConfig) -> None:
        if not config.prefill_url or not config.decode_url:
            raise ValueError(f"mode {config.mode} needs --prefill-url and --decode-url")
        if config.mode == "nixl-push" and not (config.prefill_engine_id and config.prefill_side_channel):
            raise ValueError("nixl-push needs --prefill-engine-id and --prefill-side-channel HOST:PORT")
        self._config = config

    async def tokenizer_url(self, model: str) -> str | None:
        """None: vLLM's connectors plan nothing, so nothing needs the count."""
        return None

    async def fits_every_decode_engine(self, token_count: int, model: str) -> bool:
        """Nothing is checked for static engines."""
        return True

    async def plan(self, request_id: str, prompt_token_count: int, traceparent: str, model: str = "") -> Route:
        """Static engines; params as vLLM's own proxies build them."""
        config = self._config
        prefill_params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                          "remote_block_ids": None, "remote_host": None, "remote_port": None}
        if config.mode == "nixl-pull":
            return Route(config.prefill_url, config.decode_url, prefill_params, None)
        host, _, port = config.prefill_side_channel.rpartition(":")
        decode_params = {"do_remote_prefill": True, "do_remote_decode": False,
                         "remote_engine_id": config.prefill_engine_id, "remote_request_id": request_id,
                         "remote_host": host, "remote_port": int(port), "tp_size": 1, "pp_size": 1}
        return Route(config.prefill_url, config.decode_url, prefill_params, decode_params)

    async def cancel(self, route: Route, reason: str) -> None:
        """Nothing to cancel: vLLM's connectors rely on leases and watchdogs."""

    async def report_unreachable(self, route: Route, leg: str, reason: str) -> str | None:
        """None: one static engine per role, nothing else to plan."""
        return None

    async def healthy(self) -> tuple[bool, str]:
        """Static engines are assumed present; their own /health is the real check."""
        return True, "static engines"

    async def model_source_url(self) -> str | None:
        """The decode engine."""
        return self._config.decode_url

    async def close(self) -> None:
        """Nothing to release."""


def make_router(config: GatewayConfig) -> Router:
    """The strategy for `config.mode`; ValueError for an unknown mode or missing settings."""
    if config.mode == "kvpush":
        return DirectoryRouter(config)
    if config.mode in ("nixl-pull", "nixl-push"):
        return StaticRouter(config)
    raise ValueError(f"unknown gateway mode {config.mode!r}: use kvpush, nixl-pull or nixl-push")


def pull_decode_params(prefill_response: dict) -> dict:
    """The decode leg's params in pull mode: the prefill response's kv_transfer_params; 502 if missing."""
    params = prefill_response.get("kv_transfer_params") if isinstance(prefill_response, dict) else None
    if not isinstance(params, dict):
        raise bad_gateway("prefill response carries no kv_transfer_params (is the prefill engine a kv_producer?)")
    return params


__all__ = ["Route", "Router", "DirectoryRouter", "StaticRouter", "make_router", "pull_decode_params"]
