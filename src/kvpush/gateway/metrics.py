"""Prometheus metrics of the gateway, served at GET /metrics on the gateway's own port.

One registry per application. The middleware counts every request by route template and status (errors,
404s and client disconnects included) and brackets `in_flight`; the dispatcher adds, per disaggregated
request, the directory's plan time, the prefill leg's time and whether the transfer was cancelled.

Latency of completion requests, labelled `route` (completions | chat) and `mode` (prefill: the client's first token
came from the prefill leg; decode: from the decode engine's stream):
- `kvpush_gateway_time_to_first_token_seconds`: streams only, from the request's arrival to its first token's event
  going to the client.
- `kvpush_gateway_inter_token_latency_seconds`: streams only, one sample per token after the first (a stream of n
  tokens gives n - 1): the time since the previous event that carried tokens, shared evenly by the tokens of an event.
- `kvpush_gateway_request_duration_seconds`: streamed and not, from arrival to the answer's last byte, for requests
  answered in full (HTTP 200, a stream ended with its [DONE]).
A request's status in `kvpush_gateway_requests_total` is its outcome: a stream that broke after its 200 headers
(an error event went out instead of [DONE]) counts with the status its error event carries (502, 504, or an
engine's 4xx), and once more in `kvpush_gateway_stream_errors_total{reason}`; a client that went away before the end
is 499; a client that closed just after the last byte is 200.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 600.0)
# Time to first token and whole requests: 5 ms (first token from prefill of a short prompt) to 10 minutes.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5,
                    10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# Between tokens: below a millisecond (tokens of one event) to a minute (a stalled stream).
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_PLAN_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0, 5.0)


@dataclass
class RequestRecord:
    """What the dispatcher tells the metrics middleware of one completion request."""

    started: float  # monotonic time of its arrival
    route: str = ""  # "completions" or "chat"; empty: not a completion request
    mode: str = "decode"  # "prefill": the client's first token came from the prefill leg
    status: int = 0  # the outcome when it is not the HTTP status (a stream that broke: its error's; 499)
    completed: bool = False  # answered in full (HTTP 200; a stream ended with [DONE])


# The request's `RequestRecord`, in aiohttp's per-request mapping.
RECORD_KEY = web.RequestKey("kvpush_request_record", RequestRecord)


class TokenClock:
    """One request's tokens as they go to the client, and where its first came from (`mode`). Streamed: time to first
    token at the first, then one inter-token sample per later token (an event's tokens share the time since the
    previous event evenly); not streamed: nothing (the first token is the whole answer)."""

    def __init__(self, metrics: GatewayMetrics, route: str, started: float, streamed: bool) -> None:
        self._metrics = metrics
        self._route = route
        self._started = started
        self._streamed = streamed
        self.mode = "decode"
        self.token_count = 0
        self._last = 0.0

    def sent(self, token_count: int) -> None:
        """`token_count` tokens were just written to the client."""
        if token_count <= 0 or not self._streamed:
            return
        now = time.monotonic()
        if self.token_count == 0:
            self._metrics.time_to_first_token.labels(self._route, self.mode).observe(now - self._started)
            gaps, gap = token_count - 1, 0.0
        else:
            gaps, gap = token_count, (now - self._last) / token_count
        itl = self._metrics.inter_token_latency.labels(self._route, self.mode)
        for _ in range(gaps):
            itl.observe(gap)
        self.token_count += token_count
        self._last = now


class GatewayMetrics:
    """Request counts, latencies and in-flight requests of one gateway."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kvpush_gateway_requests",
                                "Requests answered, by route and the status of their outcome "
                                "(a stream broken after its headers: its error's; see the module docstring).",
                                ["route", "status"], registry=r)
        self.request_duration = Histogram("kvpush_gateway_request_duration_seconds",
                                          "Completion requests answered in full, from arrival to the answer's last "
                                          "byte, by route (completions, chat) and first-token mode (prefill, decode).",
                                          ["route", "mode"], buckets=_LATENCY_BUCKETS, registry=r)
        self.time_to_first_token = Histogram("kvpush_gateway_time_to_first_token_seconds",
                                             "Streams: from arrival to the first token's event going to the client, "
                                             "by route and first-token mode.", ["route", "mode"],
                                             buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("kvpush_gateway_inter_token_latency_seconds",
                                             "Streams: one sample per token after the first, the time since the "
                                             "previous tokens went to the client, by route and first-token mode.",
                                             ["route", "mode"], buckets=_ITL_BUCKETS, registry=r)
        self.stream_errors = Counter("kvpush_gateway_stream_errors",
                                     "Streams that broke after their 200 headers (an error event went out instead of "
                                     "[DONE]), by reason: engine_error (the engine streamed an error), timeout, "
                                     "connection (the engine's stream broke), first_token_mismatch.", ["reason"],
                                     registry=r)
        self.cancel_failures = Counter("kvpush_gateway_cancel_failures",
                                       "Transfers the gateway could not cancel after every retry (they hold their "
                                       "engines' capacity until their TTL ends them).", registry=r)
        self.first_byte_timeouts = Counter("kvpush_gateway_first_byte_timeouts",
                                           "Legs whose engine sent no response headers within the leg's first-byte "
                                           "bound (reported unreachable; the request was planned again while no "
                                           "byte had reached the client).", ["leg"], registry=r)
        self.plan_duration = Histogram("kvpush_gateway_plan_duration_seconds",
                                       "PlanTransfer at the directory, as the gateway waited for it.",
                                       buckets=_PLAN_BUCKETS, registry=r)
        self.prefill_leg_duration = Histogram("kvpush_gateway_prefill_leg_duration_seconds",
                                              "The prefill leg (max_tokens=1), successful ones.",
                                              buckets=_REQUEST_BUCKETS, registry=r)
        self.cancelled_transfers = Counter("kvpush_gateway_cancelled_transfers",
                                           "Transfers the gateway cancelled after a failed or abandoned request.",
                                           registry=r)
        self.prompt_tokens = Histogram("kvpush_gateway_prompt_tokens",
                                       "Text and chat prompts' token counts from an engine's /tokenize (planning "
                                       "checks decode's free blocks with them).",
                                       buckets=(16, 64, 256, 1024, 4096, 16384, 65536, 262144), registry=r)
        self.failovers = Counter("kvpush_gateway_failovers",
                                 "Requests planned again after an engine could not be reached, by the leg whose "
                                 "engine it was (each such engine was reported to the directory).", ["leg"],
                                 registry=r)
        self.failovers_exhausted = Counter("kvpush_gateway_failovers_exhausted",
                                           "Requests answered 503 because an engine was still unreachable after "
                                           "--max-failovers re-plans (or with no other engine to plan).",
                                           registry=r)
        self.unreachable_reports = Counter("kvpush_gateway_unreachable_reports",
                                           "ReportEngineUnreachable calls, by leg and result (marked: the directory "
                                           "marked the engine; stale: it had restarted since; failed: the call "
                                           "failed).", ["leg", "result"], registry=r)
        self.leg_timeouts = Counter("kvpush_gateway_leg_timeouts",
                                    "Legs that exceeded their bound (answered 504, or an error event once streaming).",
                                    ["leg"], registry=r)
        self.prefill_before_plan = Counter("kvpush_gateway_prefill_before_plan",
                                           "Prefill legs sent with PlanTransfer (--prefill-before-plan), by outcome: "
                                           "planned (the directory took the gateway's engine and transfer id), "
                                           "replanned (it refused them: the leg was stopped and the request planned "
                                           "the usual way).", ["outcome"], registry=r)
        self.in_flight = Gauge("kvpush_gateway_requests_in_flight", "Requests being served now.", registry=r)

    def observe_request(self, route: str, status: int, seconds: float, record: RequestRecord | None = None) -> None:
        """Record one answered request (every route, errors included; 499: the client went away); `record`: what the
        dispatcher said of a completion request (its outcome's status, and its duration when answered in full)."""
        if record is not None and record.status:
            status = record.status
        self.requests.labels(route, str(status)).inc()
        if record is not None and record.completed:
            self.request_duration.labels(record.route, record.mode).observe(seconds)

    def observe_dispatch(self, plan_s: float | None, prefill_s: float | None, cancelled: bool) -> None:
        """Record what one disaggregated request did: its plan, its successful prefill leg, a cancellation."""
        if plan_s is not None:
            self.plan_duration.observe(plan_s)
        if prefill_s is not None:
            self.prefill_leg_duration.observe(prefill_s)
        if cancelled:
            self.cancelled_transfers.inc()

    def middleware(self):
        """An aiohttp middleware counting every request by route template and status (outermost)."""
        @web.middleware
        async def count(request: web.Request, handler):
            resource = request.match_info.route.resource
            route = resource.canonical if resource is not None else "unmatched"
            started = time.monotonic()
            record = request[RECORD_KEY] = RequestRecord(started=started)
            status = 500
            self.in_flight.inc()
            try:
                response = await handler(request)
                status = response.status
                return response
            except web.HTTPException as error:
                status = error.status
                raise
            except asyncio.CancelledError:
                status = 499
                raise
            finally:
                self.in_flight.dec()
                self.observe_request(route, status, time.monotonic() - started, record)
        return count

    async def handle(self, request: web.Request) -> web.Response:
        """GET /metrics."""
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})
