"""Routing strategies: where a request's two legs go and what kv_transfer_params each carries.

One strategy per deployment (`GatewayConfig.mode`):
- `kvpush`      plans at the KV directory (PlanTransfer mints the transfer id and picks the engines);
                both legs go out at once; a failed leg cancels the transfer (CancelTransfer). With
                `prefill_before_plan` the gateway picks the prefill engine itself (`pick_prefill`, from its
                engine list) and names the transfer, so the prefill leg leaves with PlanTransfer, not after it.
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
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from kvpush.api.params import TransferParams
from kvpush.client import ChannelConfig, DirectoryCallError, DirectoryClient
from kvpush.gateway.config import GatewayConfig
from kvpush.gateway.errors import GatewayError, bad_gateway, directory_reason, unavailable
from kvpush.observability import get_logger
from kvpush.v1 import types_pb2

_log = get_logger("gateway.routing")
# How long the registered-engine list is reused for model checks and /tokenize endpoints.
ENGINE_CACHE_S = 2.0
# CancelTransfer's reason when the directory refused the one given.
CANCEL_REASON = "cancelled by the gateway"
# CancelTransfer codes that another attempt cannot change (the transfer is not this caller's, or a bad request).
_CANCEL_FINAL = {grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT}


# A leg's kv_transfer_params: kvpush's typed record (kvpush.api.params), or the JSON object of one of vLLM's NIXL
# connectors (the baseline modes), passed on as it is.
LegParams = TransferParams | dict[str, Any]


@dataclass
class Route:
    """Where one request's legs go, and the parameters each leg carries."""

    prefill_url: str
    decode_url: str
    prefill_params: LegParams
    # None: the decode leg waits for the prefill response and carries its kv_transfer_params (pull).
    decode_params: LegParams | None
    transfer_id: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # First token from prefill may serve this route: its decode engine registered that it forces prefill's token
    # (and a prefill leg sent before the plan was sent for it). False: decode produces every token.
    first_token_capable: bool = True

    @property
    def concurrent(self) -> bool:
        """True when both legs are sent at the same time."""
        return self.decode_params is not None


@dataclass(frozen=True)
class PrefillPick:
    """A prefill engine and a transfer id chosen by the gateway, so the prefill leg can leave before the plan."""

    engine_id: str
    url: str
    transfer_id: str
    # Every decode engine listed for the model forces prefill's first token: the early leg may be sent for it.
    first_token_capable: bool = True

    def early_route(self, traceparent: str) -> Route:
        """The route as far as the prefill leg needs it before the plan (its params say the plan is in flight)."""
        return Route(prefill_url=self.url, decode_url="",
                     prefill_params=TransferParams.prefill(self.transfer_id, traceparent, plan_in_flight=True),
                     decode_params={}, transfer_id=self.transfer_id, extra={"prefill_engine_id": self.engine_id},
                     first_token_capable=self.first_token_capable)


class PickRefused(GatewayError):
    """The directory would not plan with the gateway's `PrefillPick` (engine gone, busy or incompatible, id
    taken): the request is planned again without it."""


class Router(Protocol):
    """A routing strategy (see the module docstring)."""

    async def pick_prefill(self, model: str, prompt_token_count: int) -> PrefillPick | None:
        """A prefill engine and transfer id for a leg sent before the plan; None: plan first."""

    async def plan(self, request_id: str, prompt_token_count: int, traceparent: str, model: str = "",
                   pick: PrefillPick | None = None) -> Route:
        """Choose engines (serving `model` when given; the picked prefill engine and transfer id when `pick`) and
        build both legs' parameters; GatewayError when impossible (PickRefused: not with that pick)."""

    async def tokenizer_url(self, model: str) -> str | None:
        """An engine URL whose /tokenize counts prompt tokens for `model` (None: do not count)."""

    async def fits_every_decode_engine(self, token_count: int, model: str) -> bool:
        """True when every decode engine for `model` last reported room for `token_count` tokens."""

    async def cancel(self, route: Route, reason: str) -> str:
        """Give up a route after a failed leg (never raises): "cancelled" (or nothing to cancel), "failed" (the
        directory did not answer or failed: worth another try) or "refused" (another try cannot change it)."""

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
# PlanTransfer codes that refuse a gateway's pick (pinned prefill engine, named transfer) rather than the request.
_PICK_REFUSALS = {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
                  grpc.StatusCode.ALREADY_EXISTS}


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
        for name, value in (("root_cert_file", config.directory_tls_root_cert),
                            ("client_cert_file", config.directory_tls_client_cert),
                            ("client_key_file", config.directory_tls_client_key)):
            if value:
                overrides[name] = value
        self._client = DirectoryClient(ChannelConfig.from_env(None, **overrides))
        self._engines: list[types_pb2.EngineWorker] = []
        self._engines_read_at: float | None = None  # monotonic time of the last read that succeeded
        self._engines_reading: asyncio.Task[None] | None = None
        # Prefill picks per engine since the engine list was last read (the list's transfer counts lag them).
        self._picks_since_read: dict[str, int] = {}

    async def _registered(self) -> list[types_pb2.EngineWorker]:
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
            self._picks_since_read = {}
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
            if (engine.role == types_pb2.ENGINE_ROLE_PREFILL and engine.endpoint
                    and (not model or engine.model == model)):
                return engine.endpoint.rstrip("/")
        return None

    async def fits_every_decode_engine(self, token_count: int, model: str) -> bool:
        """From the cached engine list: every decode worker for `model` has room for `token_count` tokens."""
        decodes = [e for e in await self._registered()
                   if e.role == types_pb2.ENGINE_ROLE_DECODE and (not model or e.model == model)]
        if not decodes:
            return False
        return all(_has_room(engine, token_count) for engine in decodes)

    async def pick_prefill(self, model: str, prompt_token_count: int) -> PrefillPick | None:
        """The prefill engine PlanTransfer would choose, as far as the engine list (at most ENGINE_CACHE_S old)
        tells: every rank registered, serving `model`, not marked unreachable; the gateway's local prefill engine
        when it is one of those (`local_prefill_engine_id`: clients spread over hosted gateways already, and the leg
        stays in one process), else fewest active transfers (counting this gateway's picks since the list was
        read), then fewest queued requests. None (plan first) with
        `prefill_before_plan` off, without a candidate, or when no decode engine listed has room for the prompt
        (the plan would most likely be refused, and no leg should have been sent)."""
        if not self._config.prefill_before_plan:
            return None
        engines = await self._registered()
        if prompt_token_count and not any(
                _has_room(w, prompt_token_count) for w in engines
                if w.role == types_pb2.ENGINE_ROLE_DECODE and (not model or w.model == model)):
            return None
        ranks: dict[str, int] = {}
        for worker in engines:
            if worker.role == types_pb2.ENGINE_ROLE_PREFILL:
                ranks[worker.engine_id] = ranks.get(worker.engine_id, 0) + 1
        candidates = [w for w in engines if w.role == types_pb2.ENGINE_ROLE_PREFILL and w.tp_rank == 0 and w.endpoint
                      and (not model or w.model == model) and ranks[w.engine_id] == w.tp_size
                      and not w.HasField("unreachable_time")]
        if not candidates:
            return None
        local = [w for w in candidates if w.engine_id == self._config.local_prefill_engine_id]
        best = local[0] if local else min(
            candidates, key=lambda w: (w.active_transfer_count + self._picks_since_read.get(w.engine_id, 0),
                                       w.load.running_request_count + w.load.waiting_request_count, w.engine_id))
        self._picks_since_read[best.engine_id] = self._picks_since_read.get(best.engine_id, 0) + 1
        decodes = [w for w in engines if w.role == types_pb2.ENGINE_ROLE_DECODE and (not model or w.model == model)]
        return PrefillPick(engine_id=best.engine_id, url=best.endpoint.rstrip("/"), transfer_id=uuid.uuid4().hex,
                           first_token_capable=bool(decodes) and all(w.forces_first_token for w in decodes))

    async def plan(self, request_id: str, prompt_token_count: int, traceparent: str, model: str = "",
                   pick: PrefillPick | None = None) -> Route:
        """PlanTransfer (by model; with `pick`, its engine pinned and its transfer id), then build the kvpush legs'
        params from the transfer id and endpoints."""
        if model:
            await self._check_model(model)
        try:
            response = await self._client.plan_transfer(
                request_id=request_id, prompt_token_count=prompt_token_count, traceparent=traceparent,
                ttl_s=self._config.transfer_ttl_s or None, model=model,
                prefill_engine_id=pick.engine_id if pick else "", transfer_id=pick.transfer_id if pick else "")
        except DirectoryCallError as error:
            status = _PLAN_STATUS.get(error.code, 502)
            message = f"directory PlanTransfer failed: {error.code.name}: {error.details}"
            kind = "service_unavailable" if status == 503 else "bad_gateway"
            if pick is not None and error.code in _PICK_REFUSALS:
                raise PickRefused(status, message, kind) from error
            raise GatewayError(status, message, kind) from error
        transfer = response.transfer
        if pick is not None and (transfer.transfer_id != pick.transfer_id
                                 or transfer.prefill_engine_id != pick.engine_id):
            # A directory that predates caller-named transfers plans as it likes: the early leg is not this one's.
            await self.cancel(Route("", "", {}, {}, transfer.transfer_id), "the directory did not take the pick")
            raise PickRefused(503, f"directory planned {transfer.transfer_id!r} on {transfer.prefill_engine_id!r}, "
                                   f"not the gateway's {pick.transfer_id!r} on {pick.engine_id!r}")
        if not response.prefill_endpoint or not response.decode_endpoint:
            await self.cancel(Route("", "", {}, {}, transfer.transfer_id), "engine has no endpoint")
            raise unavailable(f"planned engines have no HTTP endpoint (prefill {transfer.prefill_engine_id!r}: "
                              f"{response.prefill_endpoint!r}, decode {transfer.decode_engine_id!r}: "
                              f"{response.decode_endpoint!r}); set engine_endpoint in kv_connector_extra_config")
        return Route(prefill_url=response.prefill_endpoint.rstrip("/"), decode_url=response.decode_endpoint.rstrip("/"),
                     prefill_params=TransferParams.prefill(transfer.transfer_id, traceparent),
                     decode_params=TransferParams.decode(transfer.transfer_id, traceparent),
                     transfer_id=transfer.transfer_id,
                     extra={"prefill_engine_id": transfer.prefill_engine_id,
                            "decode_engine_id": transfer.decode_engine_id},
                     # A decode engine that does not force prefill's token decodes the whole answer (never a stream
                     # cut after its first token); an early prefill leg sent without first token stays so.
                     first_token_capable=response.decode_forces_first_token and (pick is None
                                                                                 or pick.first_token_capable))

    async def cancel(self, route: Route, reason: str) -> str:
        """CancelTransfer, bounded, the reason made safe (`directory_reason`; refused anyway: sent again with a plain
        one); see `Router.cancel` for the result."""
        if not route.transfer_id:
            return "cancelled"
        reason = directory_reason(reason) or CANCEL_REASON
        for fallback in (False, True):
            try:
                await self._client.cancel_transfer(route.transfer_id, CANCEL_REASON if fallback else reason)
                return "cancelled"
            except DirectoryCallError as error:
                if error.code == grpc.StatusCode.INVALID_ARGUMENT and not fallback:
                    continue
                _log.warning("cancel transfer failed", transfer_id=route.transfer_id, code=error.code.name,
                             details=directory_reason(error.details))
                if error.code == grpc.StatusCode.NOT_FOUND:
                    return "cancelled"  # unknown (expired and forgotten): nothing left to end
                return "refused" if error.code in _CANCEL_FINAL else "failed"
        return "refused"

    async def report_unreachable(self, route: Route, leg: str, reason: str) -> str | None:
        """ReportEngineUnreachable for `leg`'s planned engine ("prefill" or "decode"), bounded; see `Router`."""
        engine_id = route.extra.get(f"{leg}_engine_id", "")
        if not engine_id:
            return "failed"
        try:
            marked = await self._client.report_engine_unreachable(engine_id, route.transfer_id,
                                                                  directory_reason(reason))
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

    async def pick_prefill(self, model: str, prompt_token_count: int) -> PrefillPick | None:
        """None: vLLM's connectors have no plan to overlap."""
        return None

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

    async def plan(self, request_id: str, prompt_token_count: int, traceparent: str, model: str = "",
                   pick: PrefillPick | None = None) -> Route:
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

    async def cancel(self, route: Route, reason: str) -> str:
        """Nothing to cancel: vLLM's connectors rely on leases and watchdogs."""
        return "cancelled"

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


def _has_room(decode: types_pb2.EngineWorker, token_count: int) -> bool:
    """A listed decode worker's KV cache holds `token_count` tokens (the directory admits by capacity too:
    planning.choose_pair says why the last reported free blocks are not the bound)."""
    return decode.layout.block_count * decode.layout.block_size_tokens >= token_count


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


__all__ = [
    "DirectoryRouter",
    "LegParams",
    "PickRefused",
    "PrefillPick",
    "Route",
    "Router",
    "StaticRouter",
    "make_router",
    "pull_decode_params",
]
