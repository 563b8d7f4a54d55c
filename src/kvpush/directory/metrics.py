"""Prometheus metrics of the KV-directory, served on `--metrics-port` at /metrics (off when 0).

Sources (one registry per server, so several directories in one process never mix):
- `DirectoryMetrics` is a `TransferObserver`: counters and histograms move on transfer milestones
  (planned, dispatched, ended with its state and cause; bytes, layers and each prefill rank's timing).
- `on_reap(effects)`: lease expiries and the directory's own stalls, from the reaper's `Effects`.
- `RpcMetricsInterceptor`: every RPC's duration by method and status code (streams: their whole life).
- At scrape time, read from the state on the event loop that owns it: live transfers by state, registered
  workers by role, queued prefill messages (the StreamPrefill backlog), open streams.

Failure causes are a closed set (`CAUSES`), derived from the end reason, so label cardinality stays bounded.
The HTTP endpoint is an aiohttp server on the directory's own event loop: scrapes never race the state.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING, Any

import grpc
from aiohttp import web
from google.protobuf import timestamp_pb2
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvpush.directory.records import PREFILL, Effects, TransferObserver, TransferRecord
from kvpush.v1 import types_pb2 as tpb

if TYPE_CHECKING:
    from kvpush.directory.servicer import DirectoryServicer
    from kvpush.directory.state import DirectoryState

# Seconds: a transfer spans a prefill (ms to s); a tail or a post is micro- to milliseconds.
_TRANSFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_FAST_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_RPC_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 300.0, 3600.0)

# Why a transfer did not complete, from its end reason (first match wins); "" for COMPLETE.
CAUSES = ("lease_expired", "deregistered", "write_failed", "stream_broken", "deadline", "cancelled", "other")


def failure_cause(record: TransferRecord) -> str:
    """The bounded cause label of an ended transfer ("none" when it completed)."""
    if record.state == tpb.TRANSFER_STATE_COMPLETE:
        return "none"
    if record.state == tpb.TRANSFER_STATE_EXPIRED:
        return "deadline"
    reason = record.failure_reason.lower()
    for needle, cause in (("lease expired", "lease_expired"), ("deregistered", "deregistered"),
                          ("write failed", "write_failed"), ("stream", "stream_broken"),
                          ("session", "stream_broken")):
        if needle in reason:
            return cause
    return "cancelled" if record.state == tpb.TRANSFER_STATE_CANCELLED else "other"


def _seconds_between(later: timestamp_pb2.Timestamp, earlier: timestamp_pb2.Timestamp) -> float | None:
    if (not later.seconds and not later.nanos) or (not earlier.seconds and not earlier.nanos):
        return None
    return float(later.ToNanoseconds() - earlier.ToNanoseconds()) / 1e9


class DirectoryMetrics(TransferObserver):
    """The directory's metrics (module docstring); `bind()` to a state before serving scrapes."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.transfers_planned = Counter("kvpush_directory_transfers_planned", "Transfers minted by PlanTransfer.",
                                         registry=r)
        self.transfers_ended = Counter("kvpush_directory_transfers_ended",
                                       "Transfers that reached a terminal state, by state and failure cause.",
                                       ["state", "cause"], registry=r)
        self.transfer_duration = Histogram("kvpush_directory_transfer_duration_seconds",
                                           "From PlanTransfer to the terminal state, by state.", ["state"],
                                           buckets=_TRANSFER_BUCKETS, registry=r)
        self.dispatch_delay = Histogram("kvpush_directory_transfer_dispatch_delay_seconds",
                                        "From PlanTransfer to the push instruction (allocation and first "
                                        "readiness both known).", buckets=_TRANSFER_BUCKETS, registry=r)
        self.bytes_written = Counter("kvpush_directory_transfer_written_bytes",
                                     "Bytes prefill reported written, summed over ranks, at each transfer's end.",
                                     registry=r)
        self.layers_written = Counter("kvpush_directory_transfer_written_layers",
                                      "Layers written for every token, at each transfer's end.", registry=r)
        self.exposed_tail = Histogram("kvpush_directory_exposed_tail_seconds",
                                      "Per prefill rank of a COMPLETE transfer: last WRITE end minus prefill end "
                                      "(negative values count in the lowest bucket).", buckets=_FAST_BUCKETS,
                                      registry=r)
        self.write_post = Histogram("kvpush_directory_write_post_seconds",
                                    "Per prefill rank of a COMPLETE transfer: time spent posting its WRITEs.",
                                    buckets=_FAST_BUCKETS, registry=r)
        self.early_readiness = Counter("kvpush_directory_early_readiness",
                                       "Unplanned transfers whose readiness (plan_in_flight) was held for their plan, "
                                       "by how the hold ended: planned, expired, dropped.", ["outcome"], registry=r)
        self.engines_skipped = Counter("kvpush_directory_plan_skipped_engines",
                                       "Candidate engines a plan left out, by reason: late_renewal (its lease "
                                       "renewal is late: a frozen or starved engine), client_share (the client "
                                       "holds its share of the engine's transfer cap).", ["reason"], registry=r)
        self.lease_expiries = Counter("kvpush_directory_lease_expiries",
                                      "Worker leases that lapsed without renewal, by role.", ["role"], registry=r)
        self.stalls = Counter("kvpush_directory_stalls", "Reaper gaps over the stall threshold (leases extended).",
                              registry=r)
        self.rpc_duration = Histogram("kvpush_directory_rpc_duration_seconds",
                                      "RPC handling time by method and status code (streams: their whole life).",
                                      ["method", "code"], buckets=_RPC_BUCKETS, registry=r)
        self._state: DirectoryState | None = None
        self._servicer: DirectoryServicer | None = None

    def bind(self, state: DirectoryState, servicer: DirectoryServicer | None) -> None:
        """Read live gauges from this state and servicer at scrape time."""
        self._state, self._servicer = state, servicer
        self.registry.register(_LiveCollector(self))

    # ---------------------------------------------------------------- TransferObserver

    def on_planned(self, transfer: TransferRecord) -> None:
        """Count the plan."""
        self.transfers_planned.inc()

    def on_engine_skipped(self, reason: str) -> None:
        """Count an engine a plan left out."""
        self.engines_skipped.labels(reason).inc()

    def on_early_readiness(self, outcome: str) -> None:
        """Count how a hold of early readiness ended."""
        self.early_readiness.labels(outcome).inc()

    def on_dispatched(self, transfer: TransferRecord) -> None:
        """Observe plan -> instruction."""
        if transfer.dispatch_wall is not None:
            self.dispatch_delay.observe(max(0.0, transfer.dispatch_wall - transfer.create_wall))

    def on_ended(self, transfer: TransferRecord) -> None:
        """Count the end (state, cause), its duration, bytes, layers and each rank's tail and post time."""
        state = tpb.TransferState.Name(transfer.state).removeprefix("TRANSFER_STATE_").lower()
        self.transfers_ended.labels(state, failure_cause(transfer)).inc()
        if transfer.end_wall is not None:
            self.transfer_duration.labels(state).observe(max(0.0, transfer.end_wall - transfer.create_wall))
        self.bytes_written.inc(transfer.total_bytes_written())
        if transfer.layers_written and len(transfer.layers_written) == transfer.tp_size:
            self.layers_written.inc(min(transfer.layers_written.values()))
        if transfer.state != tpb.TRANSFER_STATE_COMPLETE:
            return
        for timing in transfer.timing.values():
            tail = _seconds_between(timing.last_write_end_time, timing.prefill_end_time)
            if tail is not None:
                self.exposed_tail.observe(tail)
            self.write_post.observe(timing.post_duration.ToNanoseconds() / 1e9)

    # ---------------------------------------------------------------- reaper

    def on_reap(self, effects: Effects) -> None:
        """Count lease expiries and stalls a reap produced."""
        for role in effects.expired_lease_roles:
            self.lease_expiries.labels(tpb.EngineRole.Name(role).removeprefix("ENGINE_ROLE_").lower()).inc()
        if effects.stall_s:
            self.stalls.inc()

    # ---------------------------------------------------------------- HTTP

    def exposition(self) -> bytes:
        """The text exposition format of every metric."""
        return generate_latest(self.registry)

    async def start_http(self, host: str, port: int) -> web.AppRunner:
        """Serve GET /metrics on host:port from the running event loop; returns the runner (to clean up)."""
        async def metrics(request: web.Request) -> web.Response:
            return web.Response(body=self.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        return runner


class _LiveCollector:
    """Gauges read from the state at scrape time (on the loop that owns the state)."""

    def __init__(self, metrics: DirectoryMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        state, servicer = self._metrics._state, self._metrics._servicer
        if state is None:  # registered by bind(), which sets it
            return
        live = GaugeMetricFamily("kvpush_directory_live_transfers", "Non-terminal transfers by state.",
                                 labels=["state"])
        by_state: dict[str, int] = {}
        for record in state.live_transfers():
            name = tpb.TransferState.Name(record.state).removeprefix("TRANSFER_STATE_").lower()
            by_state[name] = by_state.get(name, 0) + 1
        for name in ("planned", "allocated", "streaming"):
            live.add_metric([name], by_state.get(name, 0))
        yield live
        workers = GaugeMetricFamily("kvpush_directory_workers", "Registered workers (TP ranks) by role.",
                                    labels=["role"])
        backlog = 0
        counts = {"prefill": 0, "decode": 0}
        for group in state.engines.groups.values():
            role = "prefill" if group.role == PREFILL else "decode"
            counts[role] += len(group.workers)
            backlog += sum(len(worker.outbox) for worker in group.workers.values())
        for role, count in counts.items():
            workers.add_metric([role], count)
        yield workers
        yield GaugeMetricFamily("kvpush_directory_early_transfers",
                                "Unplanned transfers whose early readiness (plan_in_flight) is held now, or was "
                                "stopped and is still remembered.", value=state.early_transfer_count())
        yield GaugeMetricFamily("kvpush_directory_prefill_stream_backlog_messages",
                                "Instructions and cancellations queued for prefill workers, not yet written "
                                "to their StreamPrefill streams.", value=backlog)
        if servicer is not None:
            streams = GaugeMetricFamily("kvpush_directory_open_streams", "Open streams by kind.", labels=["kind"])
            streams.add_metric(["stream_prefill"], servicer.open_prefill_session_count())
            streams.add_metric(["watch_transfers"], servicer.open_watch_count())
            yield streams
            # Refusals are logged rate-limited (servicer.ThrottledLog); every one is counted here.
            refusals = CounterMetricFamily("kvpush_directory_refusals", "Refused calls and stream events by kind "
                                           "(registration, renewal, plan, allocation, event, stream).",
                                           labels=["kind"])
            for kind, count in sorted(servicer.refusals.counts.items()):
                refusals.add_metric([kind], count)
            yield refusals
            limits = CounterMetricFamily("kvpush_directory_limit_refusals",
                                         "Calls refused because a configured limit was reached, by limit: "
                                         "client_share, engine_transfer_cap, late_renewal (plans), "
                                         "identity_streams, open_streams (streams), caller_calls, caller_bytes "
                                         "(requests in flight per caller).", labels=["limit"])
            for limit, count in sorted(servicer.limit_refusals.items()):
                limits.add_metric([limit], count)
            yield limits
            yield GaugeMetricFamily("kvpush_directory_queued_rejections",
                                    "Event rejections queued for StreamPrefill sessions, not yet written "
                                    "(capped per session and in all).", value=servicer.pending_rejection_count)
            replica = getattr(servicer, "replica", None)
            if replica is not None:  # one of several replicas on etcd (docs/directory-replicas.md)
                shards = GaugeMetricFamily("kvpush_directory_replica_shards",
                                           "Transfer shards this replica serves (draining: minting no new transfers).",
                                           labels=["kind"])
                shards.add_metric(["served"], sum(replica.serves(k) for k in range(replica.config.shard_count)))
                shards.add_metric(["draining"], len(replica.draining))
                yield shards
                yield CounterMetricFamily("kvpush_directory_replica_fences",
                                          "Times this replica stopped serving shards it could no longer prove "
                                          "its own (etcd unreachable, session or claim gone).",
                                          value=len(replica.facts.fences))
                yield CounterMetricFamily("kvpush_directory_replica_claims",
                                          "Shards this replica claimed (and adopted the stored transfers of).",
                                          value=len(replica.facts.claims))
                yield CounterMetricFamily("kvpush_directory_etcd_calls",
                                          "etcd calls this replica made (unary calls, keep-alives, Txns).",
                                          value=replica.etcd.round_trip_count)
                yield GaugeMetricFamily("kvpush_directory_etcd_queued_writes",
                                        "Transfer writes queued for etcd, not yet committed.",
                                        value=replica.queued_write_count)


def _method_name(full_method: str) -> str:
    return full_method.rsplit("/", 1)[-1] or full_method


def _code_name(context: Any, failed: BaseException | None) -> str:  # Any: grpc ships no stubs
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return str(code.name)
    if failed is None:
        return "OK"
    return "CANCELLED" if isinstance(failed, asyncio.CancelledError) else "UNKNOWN"


class RpcMetricsInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc ships no stubs
    """Observes every RPC's duration and final status code (outermost interceptor: refusals count too)."""

    def __init__(self, metrics: DirectoryMetrics) -> None:
        self._histogram = metrics.rpc_duration

    # Any (here and below): grpc's handlers, call details and contexts are untyped (grpc ships no stubs).
    async def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        """Wrap the handler so its duration and code are recorded when it ends."""
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = _method_name(handler_call_details.method)
        histogram = self._histogram
        kwargs = dict(request_deserializer=handler.request_deserializer,
                      response_serializer=handler.response_serializer)

        def observe(context: Any, started: float, failed: BaseException | None) -> None:
            histogram.labels(method, _code_name(context, failed)).observe(time.perf_counter() - started)

        if handler.response_streaming:
            inner_stream = handler.stream_stream if handler.request_streaming else handler.unary_stream

            async def streaming(request_or_iterator: Any, context: Any) -> AsyncIterator[Any]:
                started, failed = time.perf_counter(), None
                try:
                    async for response in inner_stream(request_or_iterator, context):
                        yield response
                except BaseException as error:
                    failed = error
                    raise
                finally:
                    observe(context, started, failed)

            factory = (grpc.stream_stream_rpc_method_handler if handler.request_streaming
                       else grpc.unary_stream_rpc_method_handler)
            if inspect.isasyncgenfunction(inner_stream):
                return factory(streaming, **kwargs)
            inner = inner_stream  # a handler that writes with context.write(): a coroutine, wrapped as one
        else:
            inner = handler.stream_unary if handler.request_streaming else handler.unary_unary

        async def unary(request_or_iterator: Any, context: Any) -> Any:
            started, failed = time.perf_counter(), None
            try:
                return await inner(request_or_iterator, context)
            except BaseException as error:
                failed = error
                raise
            finally:
                observe(context, started, failed)

        if handler.response_streaming:
            factory = (grpc.stream_stream_rpc_method_handler if handler.request_streaming
                       else grpc.unary_stream_rpc_method_handler)
        else:
            factory = (grpc.stream_unary_rpc_method_handler if handler.request_streaming
                       else grpc.unary_unary_rpc_method_handler)
        return factory(unary, **kwargs)


class TransferObservers(TransferObserver):
    """Several observers called in order (spans, then metrics)."""

    def __init__(self, *observers: TransferObserver) -> None:
        self._observers = observers

    def on_planned(self, transfer: TransferRecord) -> None:
        """Fan out."""
        for observer in self._observers:
            observer.on_planned(transfer)

    def on_early_readiness(self, outcome: str) -> None:
        """Fan out."""
        for observer in self._observers:
            observer.on_early_readiness(outcome)

    def on_engine_skipped(self, reason: str) -> None:
        """Fan out."""
        for observer in self._observers:
            observer.on_engine_skipped(reason)

    def on_allocated(self, transfer: TransferRecord) -> None:
        """Fan out."""
        for observer in self._observers:
            observer.on_allocated(transfer)

    def on_first_ready(self, transfer: TransferRecord) -> None:
        """Fan out."""
        for observer in self._observers:
            observer.on_first_ready(transfer)

    def on_dispatched(self, transfer: TransferRecord) -> None:
        """Fan out."""
        for observer in self._observers:
            observer.on_dispatched(transfer)

    def on_ended(self, transfer: TransferRecord) -> None:
        """Fan out."""
        for observer in self._observers:
            observer.on_ended(transfer)
