"""Prometheus metrics of an engine's connector, served over HTTP when `metrics_port` is set.

Where they are served: vLLM runs the connector's scheduler half in EngineCore and its worker half in each
worker process; vLLM's own /metrics lives in the API-server process and cannot see either, so each process
that runs a worker half serves its own /metrics: TP rank r on `metrics_port + r` (TP = 1: `metrics_port`, in
EngineCore, where vLLM runs its one worker). Every series carries `engine_id`, `role` and `tp_rank`.

Where they come from (hooks at the connector's stable points, `connector.py`):
- prefill worker: every WRITE's settlement (`WriteDone`, on the data plane's I/O thread): outcome, bytes,
  post time, post-to-completion time; the writer going quiet ends a push in flight; each push's final
  timeline (`build_connector_worker_meta`): pushes by state, push duration, exposed tail.
- decode worker: receives begun (`bind_connector_metadata`) and finished (`get_transfer_results`), by outcome,
  with the wait; receives in flight.
- both: leases lost, and the StreamPrefill backlog (events queued, not yet written to the directory).
- decode scheduler half (EngineCore; served where a worker half serves in that process, i.e. TP = 1): how long
  each leg waited for its prefill to start before its blocks were allocated (`DecodeSchedulerMetrics`).
One process-wide registry (`registry()`), separate from vLLM's, so the endpoint shows kvpush's series only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from kvpush.api.outcome import PushOutcome
from kvpush.observability import get_logger

if TYPE_CHECKING:
    from kvpush.connector.metadata import TimelineReport
    from kvpush.connector.worker.push_machine import WriteDone, WriterQuiet

_log = get_logger("connector.metrics")
_FAST_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_TRANSFER_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_WORKER_LABELS = ("engine_id", "role", "tp_rank")


@dataclass(frozen=True, slots=True)
class _Families:
    """Every metric family of the process's registry (labelled per worker by `WorkerMetrics`)."""

    writes: Counter
    bytes: Counter
    layers: Counter
    post: Histogram
    write_time: Histogram
    pushes: Counter
    push_time: Histogram
    tail: Histogram
    pushes_in_flight: Gauge
    receives: Counter
    receive_wait: Histogram
    receives_in_flight: Gauge
    lease_losses: Counter
    backlog: Gauge
    allocation_deferred: Histogram


_lock = threading.Lock()
_registry: CollectorRegistry | None = None
_families: _Families | None = None
_process_port: int | None = None


def registry() -> CollectorRegistry:
    """This process's connector registry (created with every metric on first use)."""
    return _registry_and_families()[0]


def _registry_and_families() -> tuple[CollectorRegistry, _Families]:
    global _registry, _families
    with _lock:
        if _registry is None or _families is None:
            _registry = CollectorRegistry(auto_describe=True)
            _families = _define(_registry)
        return _registry, _families


def _define(r: CollectorRegistry) -> _Families:
    worker = _WORKER_LABELS
    return _Families(
        writes=Counter("kvpush_connector_writes", "Prefill NIXL WRITEs settled, by outcome (ok, failed).",
                       [*worker, "outcome"], registry=r),
        bytes=Counter("kvpush_connector_written_bytes", "Bytes of successful prefill WRITEs.", worker, registry=r),
        layers=Counter("kvpush_connector_written_layers",
                       "Layer writes (one layer of one chunk's blocks) that succeeded.", worker, registry=r),
        post=Histogram("kvpush_connector_write_post_seconds", "Time spent posting one WRITE (prep + transfer()).",
                       worker, buckets=_FAST_BUCKETS, registry=r),
        write_time=Histogram("kvpush_connector_write_duration_seconds",
                             "One successful WRITE, from its post to its completion.", worker,
                             buckets=_FAST_BUCKETS, registry=r),
        pushes=Counter("kvpush_connector_pushes", "Prefill pushes that ended, by state (done, failed, cancelled).",
                       [*worker, "state"], registry=r),
        push_time=Histogram("kvpush_connector_push_duration_seconds",
                            "A completed push, from its first WRITE's post to its last WRITE's end.", worker,
                            buckets=_TRANSFER_BUCKETS, registry=r),
        tail=Histogram("kvpush_connector_exposed_tail_seconds",
                       "A completed push: last WRITE end minus prefill end (what decode waits beyond prefill).",
                       worker, buckets=_FAST_BUCKETS, registry=r),
        pushes_in_flight=Gauge("kvpush_connector_pushes_in_flight",
                               "Prefill transfers with WRITEs the data plane still holds.", worker, registry=r),
        receives=Counter("kvpush_connector_receives",
                         "Decode receives that ended, by outcome (complete, failed).", [*worker, "outcome"],
                         registry=r),
        receive_wait=Histogram("kvpush_connector_receive_wait_seconds",
                               "A decode request's wait for pushed KV, from the step that began it to the step "
                               "that reported it finished.", worker, buckets=_TRANSFER_BUCKETS, registry=r),
        receives_in_flight=Gauge("kvpush_connector_receives_in_flight",
                                 "Decode requests waiting for pushed KV.", worker, registry=r),
        lease_losses=Counter("kvpush_connector_lease_losses",
                             "Directory leases this worker lost (it re-registers).", worker, registry=r),
        backlog=Gauge("kvpush_connector_directory_stream_backlog_messages",
                      "Readiness events and write results queued for the directory's StreamPrefill.",
                      worker, registry=r),
        allocation_deferred=Histogram(
            "kvpush_connector_decode_allocation_deferred_seconds",
            "A decode leg's wait without blocks, from its arrival to its allocation, by what ended it "
            "(prefill_started: the directory saw its prefill's first readiness; wait_bound: "
            "decode_allocation_wait_s passed).", ["engine_id", "ended_by"], buckets=_TRANSFER_BUCKETS, registry=r),
    )


def serve(port: int) -> bool:
    """Serve this process's registry on `port` (all interfaces) unless the process already serves one.

    Returns True when a server runs in this process afterwards. Never raises: a port in use is logged, and the
    engine keeps running without its metrics endpoint.
    """
    global _process_port
    process_registry = registry()
    with _lock:
        if _process_port is not None:
            return True
        try:
            start_http_server(port, registry=process_registry)
        except OSError as error:
            _log.warning("connector metrics port unavailable; metrics not served", port=port, error=str(error))
            return False
        _process_port = port
    _log.info("connector metrics served", port=port, path="/metrics")
    return True


class WorkerMetrics:
    """One worker half's metrics (engine id, role and TP rank bound as labels)."""

    def __init__(self, engine_id: str, role: str, tp_rank: int) -> None:
        _, m = _registry_and_families()
        labels = (engine_id, role, str(tp_rank))
        self._writes_ok = m.writes.labels(*labels, "ok")
        self._writes_failed = m.writes.labels(*labels, "failed")
        self._bytes = m.bytes.labels(*labels)
        self._layers = m.layers.labels(*labels)
        self._post = m.post.labels(*labels)
        self._write_time = m.write_time.labels(*labels)
        self._pushes = {state: m.pushes.labels(*labels, state) for state in ("done", "failed", "cancelled")}
        self._push_time = m.push_time.labels(*labels)
        self._tail = m.tail.labels(*labels)
        self._pushes_in_flight = m.pushes_in_flight.labels(*labels)
        self._receives = {outcome: m.receives.labels(*labels, outcome) for outcome in ("complete", "failed")}
        self._receive_wait = m.receive_wait.labels(*labels)
        self._receives_in_flight = m.receives_in_flight.labels(*labels)
        self._lease_losses = m.lease_losses.labels(*labels)
        self._backlog = m.backlog.labels(*labels)
        self._writing: set[str] = set()
        self._receiving: dict[str, float] = {}
        self._completed_seen = 0
        self._failed_seen = 0
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- prefill

    def on_write_done(self, done: WriteDone) -> None:
        """A WRITE settled (WriteDone; data-plane I/O thread)."""
        if done.outcome is not PushOutcome.DONE:
            self._writes_failed.inc()
        else:
            self._writes_ok.inc()
            self._bytes.inc(done.bytes_written)
            self._layers.inc()
            if done.start_time is not None:
                self._write_time.observe(max(0.0, done.end_time - done.start_time))
        self._post.observe(done.post_duration_s)
        with self._lock:
            self._writing.add(done.transfer_id)
            self._pushes_in_flight.set(len(self._writing))

    def on_writer_quiet(self, quiet: WriterQuiet) -> None:
        """The data plane holds nothing more of a transfer (WriterQuiet)."""
        with self._lock:
            self._writing.discard(quiet.transfer_id)
            self._pushes_in_flight.set(len(self._writing))

    def on_timelines(self, timelines: dict[str, TimelineReport]) -> None:
        """This rank's push timelines reported this step; a final one (it carries the end reason) counts the push."""
        for report in timelines.values():
            timeline = report.timeline
            if timeline is None or not timeline.settled or timeline.state not in self._pushes:
                continue  # a snapshot of a push still going; its settled timeline follows, once
            self._pushes[timeline.state].inc()
            if timeline.state != PushOutcome.DONE.value:
                continue
            first, last, end = timeline.first_write_start_time, timeline.last_write_end_time, report.prefill_end_time
            if first is not None and last is not None:
                self._push_time.observe(max(0.0, last - first))
            if last is not None and end is not None:
                self._tail.observe(last - end)

    # ---------------------------------------------------------------- decode

    def on_receives_begun(self, request_ids: list[str]) -> None:
        """Decode requests that began waiting for pushed KV this step."""
        now = time.monotonic()
        for request_id in request_ids:
            self._receiving.setdefault(request_id, now)
        self._receives_in_flight.set(len(self._receiving))

    def on_receives_finished(self, request_ids: set[str], completed_count: int, failed_count: int) -> None:
        """Receives reported finished; the worker's running completed/failed counts split them by outcome."""
        now = time.monotonic()
        for request_id in request_ids:
            started = self._receiving.pop(request_id, None)
            if started is not None:
                self._receive_wait.observe(now - started)
        if completed_count > self._completed_seen:
            self._receives["complete"].inc(completed_count - self._completed_seen)
        if failed_count > self._failed_seen:
            self._receives["failed"].inc(failed_count - self._failed_seen)
        self._completed_seen, self._failed_seen = completed_count, failed_count
        self._receives_in_flight.set(len(self._receiving))

    # ---------------------------------------------------------------- both

    def on_lease_lost(self) -> None:
        """The directory lease lapsed or was refused."""
        self._lease_losses.inc()

    def watch_backlog(self, queued: Callable[[], int]) -> None:
        """Read the StreamPrefill backlog at scrape time."""
        self._backlog.set_function(queued)


class DecodeSchedulerMetrics:
    """The decode scheduler half's metrics (engine id bound as a label)."""

    def __init__(self, engine_id: str) -> None:
        _, m = _registry_and_families()
        self._deferred = {ended_by: m.allocation_deferred.labels(engine_id, ended_by)
                          for ended_by in ("prefill_started", "wait_bound")}

    def on_allocation_deferred(self, seconds: float, ended_by: str) -> None:
        """A leg's blocks are being allocated `seconds` after it arrived (engine thread)."""
        self._deferred[ended_by].observe(max(0.0, seconds))
