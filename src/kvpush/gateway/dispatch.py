"""One disaggregated request, start to end: plan, send both legs, return the decode answer.

Life cycle (concurrent routes: kvpush, nixl-push):
  1. `router.plan` (kvpush: PlanTransfer at the directory) gives the engines and the legs' params. Prefill
     before plan (kvpush, on by default): `router.pick_prefill` names the prefill engine and the transfer and
     the prefill leg leaves at once, PlanTransfer alongside it (the directory holds readiness that comes first);
     a directory that refuses the pick gets the leg stopped and the request planned the usual way.
  2. The prefill leg (max_tokens=1, not streamed) and the decode leg (the client's request) are sent
     at the same time (prefill before plan: the decode leg once the plan returns), both with the same
     X-Request-Id and the request's traceparent.
  3. Non-streaming: wait for both; the first failure cancels the other leg and the transfer, and
     ends the request with that leg's error. Streaming: wait for either the prefill failing or the
     decode's first chunk; only then are headers sent to the client, so a failed prefill still gets
     a clean error status; after that, chunks pass through as they come.
Sequential routes (nixl-pull) run the prefill leg first and build the decode leg from its answer.
First token from prefill (kvpush, on by default; `first_token`): a streamed request sends both legs at
once as well (the prefill leg streamed); prefill's token goes to the client as soon as its leg's token event
comes, reaches decode with the transfer's completion, and decode continues from the second token. max_tokens=1
needs the prefill leg only.
A client that disconnects cancels the handler, which cancels both legs and the transfer.
Failover: a leg whose engine cannot be reached (`errors.EngineUnreachable`: refused, reset, closed before any
response byte) ends that attempt (the other leg and the transfer are cancelled as for any failure), the engine
is reported to the directory (`Router.report_unreachable`, which leaves it out of plans until it renews its
lease) and the request is planned again, at most `max_failovers` times and only while no byte reached the client.
An engine that takes a streamed leg's connection but sends no response headers within the leg's first-byte bound
(`errors.EngineUnresponsive`: frozen, hung) is treated the same way; with first token from prefill, prefill's token
goes to the client only once decode's headers came, so a frozen decode engine is still failed over.
A stream that breaks after its headers ends with an SSE error event and no [DONE], and counts as a failure
(`metrics`: its error's status, `kvpush_gateway_stream_errors_total`). A cancellation the directory does not take is
tried again in the background (CANCEL_RETRY_DELAYS_S) and counted when it never is.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from opentelemetry import propagate, trace
from structlog.contextvars import bound_contextvars

from kvpush.api.params import TransferParams
from kvpush.client import PLAN_CLIENT_ID, client_id_of
from kvpush.gateway import first_token, legs
from kvpush.gateway.config import GatewayConfig
from kvpush.gateway.errors import EngineUnreachable, EngineUnresponsive, GatewayError, LegTimeout, bad_gateway
from kvpush.gateway.in_process import InProcessSession
from kvpush.gateway.metrics import RECORD_KEY, GatewayMetrics, RequestRecord, TokenClock
from kvpush.gateway.routing import LegParams, PickRefused, PrefillPick, Route, Router, pull_decode_params
from kvpush.gateway.streams import ClientGone, StreamWatch, end, error_event, event_error_status, open_client, send
from kvpush.gateway.validation import (
    CHAT_COMPLETIONS,
    ClientRequest,
    decode_body,
    prefill_body,
    prompt_token_upper_bound,
    tokenize_body,
)
from kvpush.observability import get_logger, get_tracer
from kvpush.observability.logs import remember_transfer

# A hosted gateway (`hosted`) plans after its local prefill engine has the leg, at most this long after the leg left.
HOSTED_PLAN_WAIT_S = 0.02
# Waits before each further CancelTransfer attempt after the first failed (bounded: 3.1 s in all, then counted).
CANCEL_RETRY_DELAYS_S = (0.1, 0.2, 0.4, 0.8, 1.6)

_log = get_logger("gateway.dispatch")
_tracer = get_tracer("kvpush.gateway")

TRANSFER_ID_HEADER = "X-KVPush-Transfer-Id"
# On streamed answers: the prefill leg's kv_transfer_params (kvpush: transfer id and push timeline) as JSON.
PREFILL_PARAMS_HEADER = "X-KVPush-Prefill-Params"


@dataclass
class Outcome:
    """What one request did, for the canonical log line and the span."""

    request_id: str
    # The tokens as they go to the client (a stream's time to first token, inter-token latency) and where the first
    # came from.
    clock: TokenClock
    transfer_id: str = ""
    prefill_ms: float = 0.0
    first_token_ms: float = 0.0  # first token from prefill: when its event went to the client
    decode_first_byte_ms: float = 0.0
    total_ms: float = 0.0
    status: int = 0
    error: str = ""
    prefill_params: dict[str, Any] | None = None
    # Decode streamed a token: its KV had landed, so a later disconnect has no transfer left to cancel.
    kv_delivered: bool = False
    plan_ms: float | None = None
    prefill_ok: bool = False
    cancelled: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    # A stream that broke after its headers: the status its error event said (the request's outcome), and why.
    stream_error_status: int = 0
    stream_error_reason: str = ""
    # The stream's last event ([DONE]) was written: a client that goes away after it was answered in full.
    answered: bool = False
    # Set once the prefill engine has the leg: a streamed leg's response headers came (vLLM sends them after it has
    # handed the request to its engine core), or the leg ended; at once for a leg not streamed (its headers come
    # with the whole answer).
    prefill_leg_accepted: asyncio.Event = field(default_factory=asyncio.Event)


def current_traceparent() -> str:
    """The W3C traceparent of the current span ('' when there is none)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent", "")


class Dispatcher:
    """Runs requests through a router over one shared HTTP client session."""

    def __init__(self, config: GatewayConfig, router: Router, session: aiohttp.ClientSession,
                 metrics: GatewayMetrics | None = None, local_legs: InProcessSession | None = None) -> None:
        self._config = config
        self._router = router
        self._session = session
        # Hosted: prefill legs to the hosting engine go into its app, not over HTTP (`in_process`).
        self._local_legs = local_legs
        self._metrics = metrics or GatewayMetrics()
        # Streamed prefill legs still being read after their token's event (`_prefill`), cancellations being retried.
        self._drains: set[asyncio.Task] = set()

    async def handle(self, http_request: web.Request, request: ClientRequest, request_id: str) -> web.StreamResponse:
        """Serve one validated request; raise GatewayError for a clean error response."""
        PLAN_CLIENT_ID.set(client_id_of(peer=http_request.remote or ""))  # the directory bounds each client's share
        started = time.monotonic()
        record: RequestRecord = http_request.get(RECORD_KEY) or RequestRecord(started=started)
        record.route = "chat" if request.path == CHAT_COMPLETIONS else "completions"
        outcome = Outcome(request_id=request_id,
                          clock=TokenClock(self._metrics, record.route, record.started, request.stream))
        parent = propagate.extract(dict(http_request.headers))
        with _tracer.start_as_current_span("gateway.request", context=parent, kind=trace.SpanKind.SERVER) as span, \
                bound_contextvars(request_id=request_id):
            span.set_attribute("http.route", request.path)
            span.set_attribute("kvpush.request_id", request_id)
            span.set_attribute("kvpush.gateway.mode", self._config.mode)
            try:
                response = await self._run(http_request, request, request_id, outcome)
                outcome.status = response.status
                return response
            except ClientGone as gone:
                # Its stream had begun: the legs are stopped and the transfer cancelled (`_legs`); nothing to send.
                outcome.status, outcome.error = 499, "client disconnected"
                return gone.response
            except GatewayError as error:
                if isinstance(error, LegTimeout):
                    self._metrics.leg_timeouts.labels(error.leg).inc()
                outcome.status, outcome.error = error.status, error.message
                error.headers.update(_route_headers(Route("", "", {}, {}, outcome.transfer_id), request_id))
                span.set_status(trace.Status(trace.StatusCode.ERROR, error.message))
                raise
            except asyncio.CancelledError:
                # A client that closed after its stream's [DONE] had its whole answer: that is a normal end.
                if outcome.status == 0 or not outcome.answered:
                    outcome.status, outcome.error = 499, "client disconnected"
                raise
            finally:
                outcome.total_ms = (time.monotonic() - started) * 1000
                status = outcome.stream_error_status or outcome.status
                record.status, record.completed = status, status == 200
                record.mode = outcome.clock.mode
                span.set_attribute("kvpush.transfer_id", outcome.transfer_id)
                span.set_attribute("http.status_code", outcome.status)
                if outcome.stream_error_status:
                    span.set_status(trace.Status(trace.StatusCode.ERROR, outcome.error))
                _log.info("request", request_id=request_id, transfer_id=outcome.transfer_id, path=request.path,
                          stream=request.stream, status=status, error=outcome.error or None,
                          stream_error=outcome.stream_error_reason or None, prefill_ms=round(outcome.prefill_ms, 1),
                          first_token_ms=round(outcome.first_token_ms, 1) or None, total_ms=round(outcome.total_ms, 1))
                self._metrics.observe_dispatch(None if outcome.plan_ms is None else outcome.plan_ms / 1000,
                                               outcome.prefill_ms / 1000 if outcome.prefill_ok else None,
                                               outcome.cancelled)

    async def _run(self, http_request: web.Request, request: ClientRequest, request_id: str,
                   outcome: Outcome) -> web.StreamResponse:
        traceparent = current_traceparent()
        named = request.body.get("model")
        model = named if isinstance(named, str) else ""
        prompt_token_count = request.prompt_token_count
        bound = prompt_token_upper_bound(request) if not prompt_token_count and self._config.count_prompt_tokens else 0
        if bound and await self._router.fits_every_decode_engine(bound, model):
            # Even the byte-length bound fits every decode engine: the free-block check passes with it as with
            # the exact count, so the /tokenize round trip is skipped (it would only add to TTFT).
            prompt_token_count = bound
        elif not prompt_token_count:
            prompt_token_count = await self._count_prompt_tokens(request, model)
            bound = 0
        failovers = 0
        while True:
            headers = {"X-Request-Id": request_id}
            propagate.inject(headers)
            # After a failover the directory chooses: it knows which engine was just reported unreachable.
            pick = await self._router.pick_prefill(model, prompt_token_count) if failovers == 0 else None
            route, prefill_task = await self._plan_with_prefill(request, request_id, prompt_token_count, bound,
                                                                traceparent, model, outcome, headers, pick)
            try:
                with bound_contextvars(**({"transfer_id": route.transfer_id} if route.transfer_id else {})):
                    return await self._legs(http_request, request, request_id, route, headers, outcome, prefill_task)
            except EngineUnreachable as error:
                # `_legs` already cancelled the other leg and the transfer.
                if not await self._fail_over(route, error, outcome, failovers):
                    raise
                failovers += 1
                outcome.prefill_ok, outcome.prefill_params, outcome.kv_delivered = False, None, False

    async def _fail_over(self, route: Route, error: EngineUnreachable, outcome: Outcome, failovers: int) -> bool:
        """Report the unreachable engine; True when the request is to be planned again (see module docstring)."""
        if isinstance(error, EngineUnresponsive):
            self._metrics.first_byte_timeouts.labels(error.leg).inc()
        result = await asyncio.shield(self._router.report_unreachable(route, error.leg, error.message))
        if result is not None:
            self._metrics.unreachable_reports.labels(error.leg, result).inc()
        engine_id = route.extra.get(f"{error.leg}_engine_id", "")
        if result is None or outcome.status != 0 or failovers >= self._config.max_failovers:
            if result is not None and outcome.status == 0:
                self._metrics.failovers_exhausted.inc()
            _log.warning("engine unreachable", leg=error.leg, engine_id=engine_id, report=result,
                         failover_count=failovers, error=error.message)
            return False
        self._metrics.failovers.labels(error.leg).inc()
        _log.warning("engine unreachable; planning the request again", leg=error.leg, engine_id=engine_id,
                     report=result, failover_count=failovers + 1, error=error.message)
        return True

    async def _plan_with_prefill(self, request: ClientRequest, request_id: str, prompt_token_count: int, bound: int,
                                 traceparent: str, model: str, outcome: Outcome, headers: dict[str, str],
                                 pick: PrefillPick | None) -> tuple[Route, asyncio.Task | None]:
        """The route, and with a `pick` the prefill leg already on its way (sent before PlanTransfer)."""
        if pick is None:
            return await self._plan(request, request_id, prompt_token_count, bound, traceparent, model, outcome), None
        prefill_task = self._start_prefill(request, pick.early_route(traceparent), headers, outcome)
        try:
            # One loop turn for the leg before PlanTransfer's set-up: on Python >= 3.12 aiohttp writes the request at
            # once (an eagerly started write task), so the leg is on the wire before the plan's CPU work, which is
            # off the critical path (decode's allocation has the whole prefill to arrive). Inside the try: a client
            # gone during that turn stops the leg too.
            await asyncio.sleep(0)
            if self._config.hosted and pick.engine_id == self._config.local_prefill_engine_id:
                # Hosted, the gateway and vLLM's API server share one event loop: the plan's CPU work would run
                # ahead of vLLM's intake of the leg, on the time to first token. Let vLLM take the leg first.
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(outcome.prefill_leg_accepted.wait(), HOSTED_PLAN_WAIT_S)
            route = await self._plan(request, request_id, prompt_token_count, bound, traceparent, model, outcome,
                                     pick)
        except PickRefused as error:
            # The leg's readiness, if the directory holds any, is let go within its hold bound.
            await _stop(prefill_task)
            outcome.prefill_ok, outcome.prefill_params, outcome.prefill_ms = False, None, 0.0
            self._metrics.prefill_before_plan.labels("replanned").inc()
            _log.info("prefill pick refused; planning the usual way", prefill_engine_id=pick.engine_id,
                      error=error.message)
            return await self._plan(request, request_id, prompt_token_count, bound, traceparent, model, outcome), None
        except BaseException:
            await asyncio.shield(_stop(prefill_task))
            raise
        self._metrics.prefill_before_plan.labels("planned").inc()
        return route, prefill_task

    async def _plan(self, request: ClientRequest, request_id: str, prompt_token_count: int, bound: int,
                    traceparent: str, model: str, outcome: Outcome, pick: PrefillPick | None = None) -> Route:
        """PlanTransfer (through the router) under a `gateway.plan` span; records the route in `outcome`."""
        planning = time.monotonic()
        with _tracer.start_as_current_span("gateway.plan") as span:
            span.set_attribute("kvpush.prompt_token_count", prompt_token_count)
            span.set_attribute("kvpush.prompt_token_count_is_bound", bool(bound))
            span.set_attribute("kvpush.prefill_before_plan", pick is not None)
            try:
                route = await self._router.plan(request_id, prompt_token_count, traceparent, model, pick)
            except PickRefused:
                raise
            except GatewayError as error:
                if not bound or error.status != 503:
                    raise
                # The directory's view of free blocks was tighter than the cached one: plan with the exact count.
                route = await self._router.plan(request_id, await self._count_prompt_tokens(request, model),
                                                traceparent, model, pick)
        outcome.plan_ms = (outcome.plan_ms or 0.0) + (time.monotonic() - planning) * 1000
        outcome.transfer_id = route.transfer_id
        remember_transfer(route.transfer_id, request_id, trace.get_current_span())
        return route

    async def _legs(self, http_request: web.Request, request: ClientRequest, request_id: str, route: Route,
                    headers: dict[str, str], outcome: Outcome,
                    prefill_task: asyncio.Task | None = None) -> web.StreamResponse:
        """Run the legs of a planned route; `prefill_task`: its prefill leg, already sent (`_start_prefill`)."""
        try:
            if route.concurrent and prefill_task is None:
                prefill_task = self._start_prefill(request, route, headers, outcome)
            if route.concurrent:
                assert prefill_task is not None  # started above
                if self._first_token_applies(request, route):  # only for concurrent routes
                    return await self._first_token(http_request, request, route, headers, outcome, prefill_task)
                return await self._concurrent(http_request, request, route, headers, outcome, prefill_task)
            return await self._sequential(http_request, request, route, headers, outcome)
        except BaseException as error:
            if prefill_task is not None and not prefill_task.done() and not outcome.kv_delivered:
                prefill_task.cancel()
            if not outcome.kv_delivered:
                reason = error.message if isinstance(error, GatewayError) else f"gateway: {type(error).__name__}"
                outcome.cancelled = bool(route.transfer_id)
                # Shielded: a cancelled handler must still tell the directory to stop the transfer.
                with contextlib.suppress(BaseException):
                    await asyncio.shield(self._cancel(route, reason))
            raise

    async def _cancel(self, route: Route, reason: str) -> None:
        """Cancel the route's transfer (the router makes the reason safe); when the directory failed to take it, try
        again in the background (CANCEL_RETRY_DELAYS_S), so an error answer does not wait for a struggling directory,
        and count a transfer that could not be cancelled at all."""
        result = await self._router.cancel(route, reason)
        if result == "failed":
            retry = asyncio.create_task(self._retry_cancel(route, reason))
            self._drains.add(retry)
            retry.add_done_callback(self._drains.discard)
        elif result == "refused":
            self._metrics.cancel_failures.inc()

    async def _retry_cancel(self, route: Route, reason: str) -> None:
        result = "failed"
        for delay in CANCEL_RETRY_DELAYS_S:
            await asyncio.sleep(delay)
            result = await self._router.cancel(route, reason)
            if result != "failed":
                break
        if result != "cancelled":
            self._metrics.cancel_failures.inc()
            _log.error("transfer not cancelled; it holds its engines' capacity until its TTL ends it",
                       transfer_id=route.transfer_id, attempt_count=1 + len(CANCEL_RETRY_DELAYS_S), result=result)

    async def _count_prompt_tokens(self, request: ClientRequest, model: str) -> int:
        """A text or chat prompt's token count from a prefill engine's /tokenize (0 when it cannot say).

        The count lets the directory check decode's free blocks before planning; failing to get one only skips
        that check, so errors are logged, not raised.
        """
        if not self._config.count_prompt_tokens:
            return 0
        url = await self._router.tokenizer_url(model)
        if url is None:
            return 0
        body = tokenize_body(request)
        with _tracer.start_as_current_span("gateway.tokenize", kind=trace.SpanKind.CLIENT):
            try:
                answer = await legs.post_json(self._session, "tokenize", url + "/tokenize", body, {},
                                              self._config.connect_timeout_s, self._config.connect_timeout_s)
            except GatewayError as error:
                if error.status < 500:  # the engine refused the prompt: the legs will say why, precisely
                    return 0
                _log.warning("prompt not tokenized; planning without its length", error=error.message)
                return 0
        count = answer.get("count")
        if isinstance(count, int) and count > 0:
            self._metrics.prompt_tokens.observe(count)
            return count
        return 0

    def _prefill(self, request: ClientRequest, route: Route, headers: dict[str, str], outcome: Outcome,
                 want_token: bool = False, streamed: bool = False):
        """The prefill leg's answer. `streamed` (first token from prefill): the leg is streamed and this returns at
        its token's event (`first_token.StreamedPrefillAnswer`); the rest of its stream is read in the background,
        so the connection goes back to the pool. A streamed answer carries no kv_transfer_params."""
        local = (self._local_legs is not None
                 and route.extra.get("prefill_engine_id") == self._config.local_prefill_engine_id)
        session = self._local_legs if local and self._local_legs is not None else self._session

        async def run() -> dict[str, Any]:
            started = time.monotonic()
            url = route.prefill_url + request.path
            if not streamed:
                outcome.prefill_leg_accepted.set()
            with _tracer.start_as_current_span("gateway.prefill_leg", kind=trace.SpanKind.CLIENT) as span:
                span.set_attribute("server.address", route.prefill_url)
                span.set_attribute("kvpush.in_process", local)
                body = prefill_body(request, _leg_params(route.prefill_params), first_token=want_token,
                                    streamed=streamed)
                try:
                    if streamed:
                        answer = await self._streamed_prefill_answer(session, request, url, body, headers, outcome)
                    else:
                        # A frozen remote engine is failed over (legs.post_json); an in-process one would be this
                        # process, frozen too.
                        answer = await legs.post_json(session, "prefill", url, body, _leg_headers(headers),
                                                      self._config.prefill_timeout_s, self._config.connect_timeout_s,
                                                      self._config.prefill_first_byte_timeout_s,
                                                      "" if local else route.prefill_url + legs.HEALTH_PATH)
                finally:
                    outcome.prefill_leg_accepted.set()
            outcome.prefill_ms = (time.monotonic() - started) * 1000
            outcome.prefill_ok = True
            outcome.prefill_params = answer.get("kv_transfer_params")
            return answer
        return run()

    async def _streamed_prefill_answer(self, session, request: ClientRequest, url: str, body: dict,
                                       headers: dict[str, str], outcome: Outcome) -> dict[str, Any]:
        total_s = self._config.prefill_timeout_s
        response = await legs.open_stream(session, "prefill", url, body, _leg_headers(headers), total_s,
                                          self._config.connect_timeout_s, self._config.prefill_first_byte_timeout_s)
        outcome.prefill_leg_accepted.set()
        folded = first_token.StreamedPrefillAnswer(request)
        # The token's event carries the whole prompt's ids (the leg asks for token ids); only a client that asked for
        # them needs them, and parsing an 8,192-token prompt's took ~0.5 ms of the time to first token on the H200 host.
        events = legs.sse_events(response, "prefill", url, total_s,
                                 drop_prompt_token_ids=not request.body.get("return_token_ids"))
        try:
            async for event in events:
                folded.feed(event)
                if folded.complete:
                    break
        except BaseException:
            await events.aclose()
            response.release()
            raise
        # The rest (usage, [DONE]) changes nothing; reading it keeps the connection reusable. The response's
        # timeout bounds it; a failure there only costs the connection.
        drain = asyncio.create_task(self._drain(events, response))
        self._drains.add(drain)
        drain.add_done_callback(self._drains.discard)
        return folded.answer()

    @staticmethod
    async def _drain(events, response: aiohttp.ClientResponse) -> None:
        try:
            async for _ in events:
                pass
        except GatewayError:
            response.close()  # a broken rest: the connection is not reused
        finally:
            await events.aclose()
            response.release()

    def _start_prefill(self, request: ClientRequest, route: Route, headers: dict[str, str],
                       outcome: Outcome) -> asyncio.Task:
        """A concurrent route's prefill leg, started, in the form the leg handler (`_legs`) reads: first token
        from prefill wants prefill's token (streamed unless it is the whole answer); otherwise the plain leg."""
        if self._first_token_applies(request, route):
            if first_token.client_max_tokens(request) == 1:
                leg = self._prefill(request, route, headers, outcome, want_token=True, streamed=request.stream)
            else:
                route = dataclasses.replace(route, prefill_params=_first_token_from_prefill(route.prefill_params))
                leg = self._prefill(request, route, headers, outcome, want_token=True, streamed=True)
        else:
            leg = self._prefill(request, route, headers, outcome)
        return asyncio.create_task(leg)

    async def _concurrent(self, http_request: web.Request, request: ClientRequest, route: Route,
                          headers: dict[str, str], outcome: Outcome, prefill_task: asyncio.Task) -> web.StreamResponse:
        assert route.decode_params is not None
        decode_url = route.decode_url + request.path
        try:
            if not request.stream:
                decode_task = asyncio.create_task(self._decode_json(decode_url, request, route.decode_params, headers,
                                                                    route.decode_url + legs.HEALTH_PATH))
                answer = await _both(prefill_task, decode_task)
                return self._json_response(answer, route, outcome)
            stream_task = asyncio.create_task(self._first_chunk(decode_url, request, route.decode_params, headers))
            response, first_chunk = await _both_until_second(prefill_task, stream_task)
        except BaseException:
            if not prefill_task.done():
                prefill_task.cancel()
            raise
        # From here on the prefill leg is left to finish: cancelling it could abort a prefill whose
        # KV is still being handed over.
        return await self._pass_through(http_request, response, first_chunk, route, outcome, prefill_task)

    def _first_token_applies(self, request: ClientRequest, route: Route) -> bool:
        """First token from prefill: kvpush routes, when streamed (TTFT) or when one token is all (no decode)."""
        return (self._config.first_token_from_prefill and bool(route.transfer_id) and route.concurrent
                and route.first_token_capable
                and (request.stream or first_token.client_max_tokens(request) == 1))

    async def _first_token(self, http_request: web.Request, request: ClientRequest, route: Route,
                           headers: dict[str, str], outcome: Outcome, prefill_task: asyncio.Task) -> web.StreamResponse:
        """Both legs at once; prefill's token to the client when its leg returns; decode from the second token.

        The decode leg says `first_token_from_prefill`: its engine waits for prefill's token, which comes with
        the transfer's COMPLETE event, and samples it first (module docstring; docs/gateway.md). Prefill's token
        goes out only once decode's engine answered its leg's headers (it has the request): until the first byte
        reaches the client, a decode engine that does not (frozen) is failed over.
        """
        assert route.decode_params is not None
        if first_token.client_max_tokens(request) == 1:
            return await self._prefill_only(http_request, request, route, outcome, prefill_task)
        started = time.monotonic()
        decode_url = route.decode_url + request.path
        decode_params = _first_token_from_prefill(route.decode_params)
        stream_task = asyncio.create_task(self._open_decode_stream(decode_url, request, decode_params, headers))
        try:
            answer = await _prefill_unless_decode_fails(prefill_task, stream_task)
            try:
                token = first_token.prefill_token(request, answer)
            except ValueError as error:
                raise bad_gateway(f"prefill engine at {route.prefill_url}: {error}") from error
            finished = first_token.prefill_finished(request, token)
            response = None if finished else await stream_task
        except BaseException:
            for task in (prefill_task, stream_task):
                task.cancel()
            with contextlib.suppress(BaseException):
                (await asyncio.gather(stream_task, return_exceptions=True))
            if stream_task.done() and not stream_task.cancelled() and stream_task.exception() is None:
                stream_task.result().release()
            raise
        if response is None:
            # Prefill's answer is the whole answer (EOS or a stop on its first token): end the stream now and stop
            # the decode leg, whose engine would only produce the same token.
            out = await self._open_client_stream(http_request, route, outcome)
            events, done, _ = first_token.first_events(request, token).partition(first_token.DONE_EVENT)
            outcome.clock.mode = "prefill"
            await send(out, events)
            outcome.clock.sent(1)
            outcome.first_token_ms = (time.monotonic() - started) * 1000
            await self._stop_decode_leg(stream_task, route, "the prefill leg finished the request")
            await send(out, done)  # the stream ends once the transfer is ended
            outcome.answered = True
            await end(out)
            return out
        held_back = first_token.hold_back_reason(request, token)
        if held_back:
            # The token's text cannot go out alone; decode's stream, first token forced, is passed whole.
            try:
                first_chunk = await response.content.readany()
            except BaseException:
                response.release()
                raise
            return await self._pass_through(http_request, response, first_chunk, route, outcome, None)
        try:
            out = await self._open_client_stream(http_request, route, outcome)
            outcome.clock.mode = "prefill"
            await send(out, first_token.first_events(request, token))
        except BaseException:
            response.release()
            raise
        outcome.clock.sent(1)
        outcome.first_token_ms = (time.monotonic() - started) * 1000
        rewriter = first_token.DecodeStreamRewriter(request, token)
        failure: BaseException | None = None
        try:
            with legs.transport_errors("decode", route.decode_url, self._config.decode_timeout_s):
                async for chunk in response.content.iter_any():
                    outcome.kv_delivered = True
                    await self._send_rewritten(out, rewriter, chunk, outcome)
                    if rewriter.error is not None:
                        break
                await self._send_rewritten(out, rewriter, None, outcome)
        except (GatewayError, first_token.FirstTokenMismatch) as error:
            failure = error
        finally:
            response.release()
        await self._end_stream(out, route, outcome, rewriter.error, failure)
        return out

    async def _end_stream(self, out: web.StreamResponse, route: Route, outcome: Outcome, engine_error: Any,
                          failure: BaseException | None) -> None:
        """End a begun stream. After an engine's error event (`engine_error`, already passed on) or a `failure` of the
        decode stream, it is a broken stream (`_stream_failed`): a failure is said with an SSE error event, the only way
        left once headers are gone, and no [DONE] follows either. A decode stream that just stopped before its [DONE]
        is such a failure too."""
        if engine_error is None and failure is None and not outcome.answered:
            failure = bad_gateway(f"decode engine at {route.decode_url}: its stream ended before [DONE]")
        if engine_error is not None:
            self._stream_failed(outcome, "engine_error", event_error_status(engine_error),
                                f"decode engine streamed an error: {str(engine_error)[:500]}")
        elif failure is not None:
            message = failure.message if isinstance(failure, GatewayError) else f"decode stream broke: {failure}"
            code = failure.status if isinstance(failure, GatewayError) else 502
            if isinstance(failure, EngineUnreachable):  # too late to plan again, but later requests avoid it
                await self._fail_over(route, failure, outcome, self._config.max_failovers)
            elif isinstance(failure, LegTimeout):
                self._metrics.leg_timeouts.labels("decode").inc()
            _log.warning("decode stream broke", transfer_id=route.transfer_id, error=message)
            self._stream_failed(outcome, _stream_error_reason(failure), code, message)
            if not outcome.kv_delivered:  # decode never streamed a token: prefill may still be writing
                outcome.cancelled = True
                await asyncio.shield(self._cancel(route, message))
                outcome.kv_delivered = True
            await send(out, error_event(message, code))
        await end(out)

    async def _send_rewritten(self, out: web.StreamResponse, rewriter: first_token.DecodeStreamRewriter,
                              chunk: bytes | None, outcome: Outcome) -> None:
        """Rewrite decode's `chunk` (None: what is left at its end) and send it, timing the tokens it carries."""
        tokens_before = rewriter.token_count
        data = rewriter.flush() if chunk is None else rewriter.feed(chunk)
        if not data:
            return
        await send(out, data)
        outcome.clock.sent(rewriter.token_count - tokens_before)
        outcome.answered = outcome.answered or data.endswith(first_token.DONE_EVENT)

    def _stream_failed(self, outcome: Outcome, reason: str, status: int, message: str) -> None:
        """Record a stream that broke after its headers (its outcome's status, the error, the counter)."""
        outcome.stream_error_status, outcome.stream_error_reason, outcome.error = status, reason, message
        self._metrics.stream_errors.labels(reason).inc()

    async def _prefill_only(self, http_request: web.Request, request: ClientRequest, route: Route,
                            outcome: Outcome, prefill_task: asyncio.Task) -> web.StreamResponse:
        """max_tokens=1: prefill's answer is the whole answer; no decode leg, the transfer is cancelled."""
        started = time.monotonic()
        answer = await prefill_task
        try:
            token = first_token.prefill_token(request, answer)
        except ValueError as error:
            raise bad_gateway(f"prefill engine at {route.prefill_url}: {error}") from error
        # Decode never allocated, so ending the transfer frees prefill's blocks and changes nothing on decode.
        outcome.kv_delivered = True  # nothing left for a later failure to cancel
        # The cancellation's round trip runs while the answer goes out; the answer ends only after it.
        cancelled = asyncio.ensure_future(
            self._cancel(route, "first token only: the prefill leg finished the request"))
        outcome.clock.mode = "prefill"
        if not request.stream:
            answer.pop("kv_transfer_params", None)
            if not request.body.get("return_token_ids"):
                for choice in answer.get("choices") or []:
                    choice.pop("token_ids", None)
                    choice.pop("prompt_token_ids", None)
                answer.pop("prompt_token_ids", None)
            await asyncio.shield(cancelled)
            return self._json_response(answer, route, outcome)
        try:
            out = await self._open_client_stream(http_request, route, outcome)
            events, done, _ = first_token.first_events(request, token).partition(first_token.DONE_EVENT)
            await send(out, events)
        except BaseException:
            await asyncio.shield(cancelled)
            raise
        outcome.clock.sent(1)
        outcome.first_token_ms = (time.monotonic() - started) * 1000
        await asyncio.shield(cancelled)
        await send(out, done)  # the stream ends ([DONE]) once the transfer is ended, as a JSON answer does
        outcome.answered = True
        await end(out)
        return out

    async def _open_decode_stream(self, url: str, request: ClientRequest, params: LegParams,
                                  headers: dict[str, str]) -> aiohttp.ClientResponse:
        """The first-token decode leg, opened (its engine answers the headers at once; tokens follow)."""
        with _tracer.start_as_current_span("gateway.decode_leg", kind=trace.SpanKind.CLIENT) as span:
            span.set_attribute("server.address", url)
            span.set_attribute("kvpush.first_token_from_prefill", True)
            body = decode_body(request, _leg_params(params), want_token_ids=True)
            return await legs.open_stream(self._session, "decode", url, body, _leg_headers(headers),
                                          self._config.decode_timeout_s, self._config.connect_timeout_s,
                                          self._config.decode_first_byte_timeout_s)

    async def _stop_decode_leg(self, stream_task: asyncio.Task, route: Route, reason: str) -> None:
        """Close the decode leg (vLLM aborts the request, its connector cancels the transfer) and cancel the
        transfer here too; the client already has its whole answer."""
        stream_task.cancel()
        done = await asyncio.gather(stream_task, return_exceptions=True)
        if isinstance(done[0], aiohttp.ClientResponse):
            done[0].release()
            done[0].close()
        await asyncio.shield(self._cancel(route, reason))

    async def _open_client_stream(self, http_request: web.Request, route: Route,
                                  outcome: Outcome) -> web.StreamResponse:
        """Send the client's stream headers (with the route's ids and prefill's params) and return the stream."""
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                   **_route_headers(route, outcome.request_id)}
        _add_prefill_params_header(headers, outcome)
        out = web.StreamResponse(status=200, headers=headers)
        await open_client(out, http_request)
        outcome.status = 200
        return out

    async def _sequential(self, http_request: web.Request, request: ClientRequest, route: Route,
                          headers: dict[str, str], outcome: Outcome) -> web.StreamResponse:
        prefill_answer = await self._prefill(request, route, headers, outcome)
        decode_params = pull_decode_params(prefill_answer)
        decode_url = route.decode_url + request.path
        if not request.stream:
            answer = await self._decode_json(decode_url, request, decode_params, headers,
                                             route.decode_url + legs.HEALTH_PATH)
            return self._json_response(answer, route, outcome)
        response, first_chunk = await self._first_chunk(decode_url, request, decode_params, headers)
        return await self._pass_through(http_request, response, first_chunk, route, outcome, None)

    async def _decode_json(self, url: str, request: ClientRequest, params: LegParams,
                           headers: dict[str, str], health_url: str) -> dict[str, Any]:
        with _tracer.start_as_current_span("gateway.decode_leg", kind=trace.SpanKind.CLIENT) as span:
            span.set_attribute("server.address", url)
            body = decode_body(request, _leg_params(params))
            return await legs.post_json(self._session, "decode", url, body, _leg_headers(headers),
                                        self._config.decode_timeout_s, self._config.connect_timeout_s,
                                        self._config.decode_first_byte_timeout_s, health_url)

    async def _first_chunk(self, url: str, request: ClientRequest, params: LegParams,
                           headers: dict[str, str]) -> tuple[aiohttp.ClientResponse, bytes]:
        # The span covers the decode leg up to its first chunk (TTFT as the gateway sees it).
        with _tracer.start_as_current_span("gateway.decode_leg", kind=trace.SpanKind.CLIENT) as span:
            span.set_attribute("server.address", url)
            body = decode_body(request, _leg_params(params))
            response = await legs.open_stream(self._session, "decode", url, body, _leg_headers(headers),
                                              self._config.decode_timeout_s, self._config.connect_timeout_s,
                                              self._config.decode_first_byte_timeout_s)
            try:
                with legs.transport_errors("decode", url, self._config.decode_timeout_s):
                    return response, await response.content.readany()
            except BaseException:
                response.release()
                raise

    def _json_response(self, answer: dict[str, Any], route: Route, outcome: Outcome) -> web.Response:
        if route.transfer_id:
            answer["kvpush"] = {"transfer_id": route.transfer_id,
                                "prefill_kv_transfer_params": outcome.prefill_params}
        return web.json_response(answer, headers=_route_headers(route, outcome.request_id))

    async def _pass_through(self, http_request: web.Request, response: aiohttp.ClientResponse, first_chunk: bytes,
                            route: Route, outcome: Outcome, prefill_task: asyncio.Task | None) -> web.StreamResponse:
        engine_error = _stream_error(first_chunk)
        if engine_error is not None:
            # The engine failed before its first token; headers are not sent yet, so say it with a status.
            response.release()
            raise bad_gateway(f"decode engine at {route.decode_url} failed: {engine_error}")
        outcome.kv_delivered = True
        headers = {"Content-Type": response.headers.get("Content-Type", "text/event-stream"),
                   "Cache-Control": "no-cache", **_route_headers(route, outcome.request_id)}
        _add_prefill_params_header(headers, outcome)
        out = web.StreamResponse(status=200, headers=headers)
        watch = StreamWatch()
        failure: GatewayError | None = None
        try:
            await open_client(out, http_request)
            outcome.status = 200
            with legs.transport_errors("decode", route.decode_url, self._config.decode_timeout_s):
                chunk = first_chunk
                while chunk and watch.error is None:
                    await send(out, watch.feed(chunk))
                    outcome.answered = watch.done
                    outcome.clock.sent(watch.token_count)
                    chunk = await response.content.readany()
        except GatewayError as error:
            failure = error
        finally:
            response.release()
        await self._end_stream(out, route, outcome, watch.error, failure)
        if prefill_task is not None:
            # Bounded by the leg's own timeout; the client already has its answer.
            done, _ = await asyncio.wait({prefill_task}, timeout=self._config.prefill_timeout_s)
            if prefill_task in done and not prefill_task.cancelled() and prefill_task.exception() is not None:
                _log.warning("prefill leg failed after decode streamed", transfer_id=route.transfer_id,
                             error=str(prefill_task.exception()))
        return out


def _stream_error_reason(error: BaseException) -> str:
    """The `kvpush_gateway_stream_errors_total` reason of a stream broken by `error` (see `metrics`)."""
    if isinstance(error, LegTimeout):
        return "timeout"
    if isinstance(error, first_token.FirstTokenMismatch):
        return "first_token_mismatch"
    return "connection"


async def _stop(task: asyncio.Task) -> None:
    """Cancel a leg's task and wait for it to end (its outcome, whatever it was, no longer matters)."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _stream_error(first_chunk: bytes) -> str | None:
    """The message of an SSE error event at the start of a stream (vLLM's way to fail after a 200), else None."""
    for line in first_chunk.split(b"\n"):
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        try:
            event = json.loads(line[5:].strip())
        except ValueError:
            return None
        if isinstance(event, dict) and "error" in event:
            error = event["error"]
            return str(error.get("message", error) if isinstance(error, dict) else error)[:500]
        return None
    return None


def _leg_params(params: LegParams) -> dict[str, Any]:
    """A leg's kv_transfer_params as sent: kvpush's with the current (leg) span's traceparent, so the engine's
    spans are children of the leg that reached it; a NIXL connector's as they are."""
    if not isinstance(params, TransferParams):
        return params
    return params.replace(traceparent=current_traceparent() or params.traceparent).to_dict()


def _first_token_from_prefill(params: LegParams) -> LegParams:
    """A kvpush leg's params asking for first token from prefill (only kvpush routes serve it)."""
    return params.replace(first_token_from_prefill=True) if isinstance(params, TransferParams) else params


def _add_prefill_params_header(headers: dict[str, str], outcome: Outcome) -> None:
    """Streams have no body field for it: the prefill's params (push timeline) go in a header, if small."""
    if outcome.prefill_params:
        encoded = json.dumps(outcome.prefill_params, separators=(",", ":"), default=str)
        if len(encoded) <= 4096:
            headers[PREFILL_PARAMS_HEADER] = encoded


def _leg_headers(headers: dict[str, str]) -> dict[str, str]:
    """A leg's headers: the request's, with the traceparent of the current (leg) span."""
    leg = dict(headers)
    propagate.inject(leg)
    return leg


def _route_headers(route: Route, request_id: str) -> dict[str, str]:
    headers = {"X-Request-Id": request_id} if request_id else {}
    if route.transfer_id:
        headers[TRANSFER_ID_HEADER] = route.transfer_id
    return headers


async def _both(prefill_task: asyncio.Task, decode_task: asyncio.Task) -> dict[str, Any]:
    """Wait for both legs; the first failure cancels the other and is raised. Returns decode's answer."""
    try:
        done, _ = await asyncio.wait({prefill_task, decode_task}, return_when=asyncio.FIRST_EXCEPTION)
        for task in (prefill_task, decode_task):
            if task in done and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        await asyncio.wait({prefill_task, decode_task})
        for task in (prefill_task, decode_task):
            if task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return decode_task.result()
    finally:
        for task in (prefill_task, decode_task):
            if not task.done():
                task.cancel()


async def _both_until_second(prefill_task: asyncio.Task, stream_task: asyncio.Task):
    """Wait until the decode stream's first chunk, failing early if the prefill leg fails first."""
    pending = {prefill_task, stream_task}
    try:
        while True:
            # Only the tasks still pending: a prefill leg that answered must not end every later wait at once
            # (that loop spun a core for as long as decode took to its first chunk).
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if prefill_task in done and prefill_task.exception() is not None:
                raise prefill_task.exception()  # type: ignore[misc]
            if stream_task in done:
                return stream_task.result()
    finally:
        if not stream_task.done():
            stream_task.cancel()
        elif not stream_task.cancelled() and stream_task.exception() is None and prefill_task.done() \
                and not prefill_task.cancelled() and prefill_task.exception() is not None:
            stream_task.result()[0].release()


async def _prefill_unless_decode_fails(prefill_task: asyncio.Task, stream_task: asyncio.Task) -> dict[str, Any]:
    """The prefill leg's answer; the decode leg failing first (it cannot answer before prefill's token) is raised."""
    pending = {prefill_task, stream_task}
    while True:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if stream_task in done and stream_task.exception() is not None:
            raise stream_task.exception()  # type: ignore[misc]
        if prefill_task in done:
            return prefill_task.result()
