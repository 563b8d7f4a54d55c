"""Prometheus metrics of the gateway, served at GET /metrics on the gateway's own port.

One registry per application. The middleware counts every request by route template and status (errors,
404s and client disconnects included) and brackets `in_flight`; the dispatcher adds, per disaggregated
request, the directory's plan time, the prefill leg's time and whether the transfer was cancelled.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 600.0)
_PLAN_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0, 5.0)


class GatewayMetrics:
    """Request counts, latencies and in-flight requests of one gateway."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kvpush_gateway_requests", "Requests answered, by route and HTTP status.",
                                ["route", "status"], registry=r)
        self.request_duration = Histogram("kvpush_gateway_request_duration_seconds",
                                          "From arrival to the last byte of the answer, by route.", ["route"],
                                          buckets=_REQUEST_BUCKETS, registry=r)
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

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        """Record one answered request (every route, errors included; 499: the client went away)."""
        self.requests.labels(route, str(status)).inc()
        self.request_duration.labels(route).observe(seconds)

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
                self.observe_request(route, status, time.monotonic() - started)
        return count

    async def handle(self, request: web.Request) -> web.Response:
        """GET /metrics."""
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})
