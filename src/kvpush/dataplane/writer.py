"""PushWriter: posts a prefill worker's KV WRITEs into decode blocks, on the agent's I/O thread.

Life of a write (`WriteRequest`, one per layer or layer group of a transfer):
1. `submit()` (any thread) plans it (`plan.plan_write`; a one-layer write of blocks and tokens already
   planned for another layer is that plan moved, `plan.LayerPlanCache`): bad layers, block ids, token ranges or an
   unknown peer raise `WriteRequestError` there and then, before anything is queued.
2. The I/O thread queues it FIFO. At the head of the queue it waits for `ready_event` (polled with
   `.query()` when it has one, else `.synchronize()`; bounded by `post_timeout_s`), so no byte is read
   before the kernel that computes it finished.
3. Posting: one `make_prepped_xfer` over the cached tables (+ one `initialize_xfer` for token-exact
   edge descriptors, when the range has partial granules), then `transfer()`. Every handle is fresh,
   so NIXL's sticky per-handle notification never repeats. Writes of the same transfer queued behind
   it whose events are already complete ride on the same handle (up to `max_group_writes`): a
   writer that fell behind catches up with one handle instead of one per layer.
4. Completion: `check_xfer_state` on in-flight handles, only while some are in flight, with a sleep between
   rounds (the agent's back-off); each transfer's oldest first, stopping at the first still in progress
   (`check_in_post_order`); DONE, ERR, an exception or `transfer_timeout_s` ends the handle; handles are
   released (a release that fails is retried, never forgotten).
5. Outcomes: `on_request_done(WriteOutcome)` per write as soon as it completes or fails;
   `on_transfer_done(WriteOutcome)` once per transfer after its closing write (one with `notify`,
   or `ends_transfer`) and every earlier write completed, or after a failure/cancel once none of its
   handles is in flight: only then may the source blocks be reused.

Notification: the decode side must see `notify` only after *every* write of the transfer landed,
and NIXL does not order notifications across handles. If the closing write is a single handle and
no other write of the transfer is in flight when it is posted, the notification rides on its
`transfer()` (arrives with the data, no extra round); otherwise the writer sends it with
`send_notif` once all the transfer's handles are DONE.

A failed write fails its transfer: its queued writes are dropped (each reported), its in-flight
handles are left to finish or time out. Nothing is retried here; the connector decides.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol, cast

import numpy as np
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvpush.api.outcome import PushOutcome, PushStop, StopCause
from kvpush.dataplane.agent import TransferAgent
from kvpush.dataplane.layout import HeadSlice, KVLayoutSpec, LayoutError, slice_heads
from kvpush.dataplane.nixl_api import XferHandle
from kvpush.dataplane.plan import LayerPlanCache, WritePlan, WriteRequestError, plan_state_write
from kvpush.observability import get_logger, get_tracer

_log = get_logger("kvpush.dataplane.writer")
_ENDED_MEMORY = 4096
_SLICE_MEMORY = 1024
_PROPAGATOR = TraceContextTextMapPropagator()


class QueryableEvent(Protocol):
    """An event polled without blocking (`torch.cuda.Event`)."""

    def query(self) -> bool:
        """True once complete."""
        ...


class SynchronizableEvent(Protocol):
    """An event that can only be waited for."""

    def synchronize(self) -> None:
        """Block until complete."""
        ...


# A write's ready event: polled with `.query()` when it has one, else waited for with `.synchronize()`.
ReadyEvent = QueryableEvent | SynchronizableEvent


@dataclass(frozen=True)
class WriteRequest:
    """Write the KV of tokens [token_start, token_end) of `layers` into a peer's blocks.

    src_block_ids: this worker's blocks holding tokens [0, token_end), in token order.
    dst_block_ids: the peer's blocks for the whole prompt, in token order from token 0.
    notify: sent to the peer after this and every earlier write of the transfer completed;
        makes this the transfer's closing write.
    ready_event: optional object with `.query()` and/or `.synchronize()` (a CUDA event recorded
        after the layer's KV write); waited on before posting.
    ends_transfer: close the transfer after this write without a notification.
    traceparent: W3C traceparent of the request, parent of this write's span.
    post_guard: called on the I/O thread right before posting: None to post, else the reason the write may
        no longer be posted (the prefill worker's lease: it posts only within it, docs/connector.md).
    head_slice: write only these KV heads of this worker into those of the peer (TP sizes differ); None: every
        head to the same position. Every write of one transfer must carry the same slice.
    state: a state layer's write (hybrid models): the whole state of block src_block_ids[0] of the one layer into
        the peer's block dst_block_ids[0] (`plan.plan_state_write`); the token range is informational.
    """

    transfer_id: str
    peer_agent: str
    layers: Sequence[int]
    src_block_ids: Sequence[int]
    dst_block_ids: Sequence[int]
    token_start: int
    token_end: int
    notify: bytes | None = None
    ready_event: ReadyEvent | None = None
    ends_transfer: bool = False
    traceparent: str = ""
    post_guard: Callable[[], str | None] | None = None
    head_slice: HeadSlice | None = None
    state: bool = False

    @property
    def closes_transfer(self) -> bool:
        """True when the transfer ends with this write."""
        return self.notify is not None or self.ends_transfer


@dataclass(frozen=True)
class WriteOutcome:
    """How one write (per-request callback) or one whole transfer (per-transfer callback) ended.

    bytes / descriptor_count: moved (descriptors after merging; NIXL's count when telemetry is on).
    post_seconds: time spent in make_prepped_xfer + transfer(); summed over writes for a transfer.
    transfer_seconds: first post to observed completion.
    outcome: DONE (landed; for a transfer: every write landed and the notification, if any, went out),
        CANCELLED (dropped or ended by `cancel`), FAILED (anything else).
    error: why it did not land (None when DONE).
    write_count: 1 for a write; for a transfer, every write it accepted (failed and dropped ones
        included), so 0 only when a cancelled transfer never had a write.
    handle_write_count: writes that shared this write's NIXL handle (they share post time and
        telemetry); 1 when it had its own.
    """

    transfer_id: str
    outcome: PushOutcome
    bytes: int
    descriptor_count: int
    post_seconds: float
    transfer_seconds: float
    error: str | None = None
    peer_agent: str = ""
    write_count: int = 1
    layers: tuple[int, ...] = ()
    notified: bool = False
    telemetry: dict[str, float] | None = None
    handle_write_count: int = 1

    @property
    def ok(self) -> bool:
        """True when the write (or transfer) landed."""
        return self.outcome is PushOutcome.DONE


# What `cancel` ends a transfer with: its dropped writes and its end are CANCELLED, every other stop FAILED.
_CANCEL = PushStop(StopCause.CANCELLED, "cancelled")


def _failed(reason: str) -> PushStop:
    return PushStop(StopCause.WRITE_FAILED, reason)


@dataclass
class _Write:
    request: WriteRequest
    plan: WritePlan
    submitted_at: float
    handles: list[XferHandle] = field(default_factory=list)
    open_handles: list[XferHandle] = field(default_factory=list)
    posted_at: float = 0.0
    post_seconds: float = 0.0
    error: str | None = None
    reported: bool = False
    notif_attached: bool = False
    telemetry: dict[str, float] | None = None
    wall_start_ns: int = 0
    # Later writes of the same transfer posted on this write's handle (see _gather).
    group: list[_Write] = field(default_factory=list)
    post_plan: WritePlan | None = None
    # Fault injection (NixlConfig.fault_hold_posted_s): posted, but its bytes move only from this time on.
    held_until: float | None = None
    hold_done: bool = False

    @property
    def members(self) -> list[_Write]:
        """This write and the writes riding on its handle, in submission order."""
        return [self, *self.group]

    @property
    def handle_layers(self) -> list[int]:
        """Every layer this write's handle carries (its own and its group's)."""
        return [layer for member in self.members for layer in member.request.layers]


@dataclass
class _Transfer:
    transfer_id: str
    peer: str
    queued: int = 0
    in_flight: list[_Write] = field(default_factory=list)
    stop: PushStop | None = None          # the first failure, or the cancel: no write is accepted after it
    closing: _Write | None = None         # the landed write that carried (or makes the writer send) the notification
    last_accepted_closes: bool = False    # the latest accepted write closes the transfer: none may follow it
    bytes: int = 0
    descriptors: int = 0
    post_seconds: float = 0.0
    writes: int = 0
    first_post: float | None = None
    last_done: float | None = None
    layers: set[int] = field(default_factory=set)
    waiters: list[Future[WriteOutcome]] = field(default_factory=list)
    posts: int = 0
    head_slice: HeadSlice | None = None


class PushWriter:
    """Posts WriteRequests on a TransferAgent's I/O thread and reports their outcomes."""

    def __init__(
        self,
        agent: TransferAgent,
        on_request_done: Callable[[WriteOutcome], None] | None = None,
        on_transfer_done: Callable[[WriteOutcome], None] | None = None,
        tracer: trace.Tracer | None = None,
    ) -> None:
        """Attach to `agent`; callbacks run on its I/O thread and must not block.

        Each write becomes a `kvpush.dataplane.write` span (child of its `traceparent`) from
        `tracer`, by default the process's (a no-op unless OTLP export is configured).
        """
        self._agent = agent
        self._config = agent.config
        self._on_request_done = on_request_done
        self._on_transfer_done = on_transfer_done
        self._pending: deque[_Write] = deque()
        self._transfers: dict[str, _Transfer] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()
        self._zombies: list[tuple[XferHandle, float]] = []
        self._tracer = tracer or get_tracer("kvpush.dataplane")
        self._plans = LayerPlanCache()
        self._slices: dict[tuple[str, int, int], tuple[KVLayoutSpec, KVLayoutSpec]] = {}
        self._slices_lock = threading.Lock()
        self._watched: list[tuple[QueryableEvent, Callable[[float], None], float]] = []  # I/O thread only
        self.max_group_writes = self._config.max_group_writes
        self._trace = agent.io_trace
        agent.attach(self)

    # ---- caller side ----------------------------------------------------------------------------
    def submit(self, request: WriteRequest) -> WritePlan:
        """Validate and plan `request`, queue it for the I/O thread; return the plan.

        Raises WriteRequestError (nothing queued) for an unknown peer, layers or block ids out of
        range, a source or destination list too short for the token range, or an empty range.
        """
        try:
            peer_layout = self._agent.peer_layout(request.peer_agent)
        except KeyError:
            raise WriteRequestError(f"unknown peer {request.peer_agent!r}") from None
        if not request.transfer_id:
            raise WriteRequestError("transfer_id is empty")
        local_layout, plan_key = self._agent.layout, request.peer_agent
        if request.state:
            plan = self._state_plan(local_layout, peer_layout, request)
            submitted_at = time.monotonic()
            self._agent.post(lambda: self._enqueue(_Write(request, plan, submitted_at)))
            return plan
        if request.head_slice is not None:
            cut = request.head_slice
            try:
                local_layout = self._sliced("", local_layout, cut.source_start, cut.count)
                peer_layout = self._sliced(request.peer_agent, peer_layout, cut.destination_start, cut.count)
            except LayoutError as exc:
                raise WriteRequestError(f"head slice {cut}: {exc}") from exc
            plan_key = f"{request.peer_agent}#heads{cut.source_start}:{cut.destination_start}:{cut.count}"
        plan = self._plans.plan(
            local_layout,
            peer_layout,
            plan_key,
            request.layers,
            request.src_block_ids,
            request.dst_block_ids,
            request.token_start,
            request.token_end,
        )
        submitted_at = time.monotonic()
        self._agent.post(lambda: self._enqueue(_Write(request, plan, submitted_at)))
        return plan

    @staticmethod
    def _state_plan(local: KVLayoutSpec, peer: KVLayoutSpec, request: WriteRequest) -> WritePlan:
        """A state write's plan (never cached: its key would not tell it from an attention write of the same ids)."""
        if request.head_slice is not None or len(request.layers) != 1:
            raise WriteRequestError("a state write moves one layer's whole state, without a head slice")
        if not request.src_block_ids or not request.dst_block_ids:
            raise WriteRequestError("a state write needs its source and destination state block")
        return plan_state_write(local, peer, int(request.layers[0]), int(request.src_block_ids[0]),
                                int(request.dst_block_ids[0]))

    def _sliced(self, owner: str, layout: KVLayoutSpec, start: int, count: int) -> KVLayoutSpec:
        """`slice_heads(layout, ...)`, one object per (owner, heads) while `layout` stays (plans are cached by
        layout identity)."""
        key = (owner, start, count)
        with self._slices_lock:
            cached = self._slices.get(key)
            if cached is not None and cached[0] is layout:
                return cached[1]
        sliced = slice_heads(layout, start, count)
        with self._slices_lock:
            if len(self._slices) >= _SLICE_MEMORY:
                self._slices.clear()
            self._slices[key] = (layout, sliced)
        return sliced

    def when_complete(self, event: QueryableEvent, callback: Callable[[float], None]) -> None:
        """Call `callback(unix time)` from the I/O thread once `event.query()` is true.

        A CUDA event's completion time, as close as the I/O thread's polling gets (it polls every
        iteration while anything is watched, and before posting, so the callback runs before any write
        waiting on the same event is reported done). Dropped after `post_timeout_s`, like a ready event.
        """
        watched_at = time.monotonic()
        self._agent.post(lambda: self._watched.append((event, callback, watched_at)))

    def cancel(self, transfer_id: str) -> Future[WriteOutcome]:
        """Drop the transfer's queued writes; the Future resolves once none of its handles is in flight.

        Later writes for this transfer id are refused (reported as failed).
        """
        future: Future[WriteOutcome] = Future()

        def do() -> None:
            transfer = self._transfers.get(transfer_id)
            if transfer is None:
                self._remember_ended(transfer_id, _CANCEL.detail)
                future.set_result(WriteOutcome(transfer_id, PushOutcome.CANCELLED, 0, 0, 0.0, 0.0, _CANCEL.detail,
                                               write_count=0))
                return
            transfer.waiters.append(future)
            self._fail_transfer(transfer, _CANCEL)

        self._agent.call_soon(do)
        return future

    # ---- I/O thread: LoopParticipant ------------------------------------------------------------
    def poll(self, now: float) -> bool:
        """Post what is ready, check in-flight handles; True while anything is pending or in flight."""
        self._stamp_completed_events()
        self._post_ready(now)
        in_flight = self._check_in_flight(time.monotonic())
        self._retry_zombies(now)
        return bool(self._pending) or in_flight or bool(self._zombies) or bool(self._watched)

    def on_peer_leaving(self, peer: str, reason: str) -> None:
        """Fail every transfer to `peer`; their in-flight handles finish or time out."""
        for transfer in [t for t in self._transfers.values() if t.peer == peer]:
            self._fail_transfer(transfer, _failed(reason))
            for write in transfer.in_flight:
                self._report_failure(write, reason)

    def peer_in_flight(self, peer: str) -> int:
        """Writes with handles still in flight towards `peer`."""
        return sum(len(t.in_flight) for t in self._transfers.values() if t.peer == peer)

    def shutdown(self, reason: str) -> None:
        """Fail every transfer; queued writes are dropped and reported."""
        for transfer in list(self._transfers.values()):
            self._fail_transfer(transfer, _failed(reason))

    # ---- I/O thread internals -------------------------------------------------------------------
    def _stamp_completed_events(self) -> None:
        if not self._watched:
            return
        waiting = []
        for event, callback, watched_at in self._watched:
            if self._query(event):
                try:
                    callback(time.time())
                except Exception:  # a caller's bug must not stop the I/O thread
                    _log.exception("event completion callback failed")
            elif time.monotonic() - watched_at <= self._config.post_timeout_s:
                waiting.append((event, callback, watched_at))
            else:
                _log.warning("watched event not complete in time; dropped", bound_s=self._config.post_timeout_s)
        self._watched = waiting

    def _enqueue(self, write: _Write) -> None:
        req = write.request
        ended = self._ended.get(req.transfer_id)
        if ended is not None:
            self._report_failure(write, f"transfer already ended ({ended})")
            return
        transfer = self._transfers.get(req.transfer_id)
        if transfer is None:
            transfer = self._transfers[req.transfer_id] = _Transfer(req.transfer_id, req.peer_agent)
        if transfer.peer != req.peer_agent:
            self._report_failure(write, f"transfer writes to {transfer.peer!r}, not {req.peer_agent!r}")
            return
        if transfer.writes and transfer.head_slice != req.head_slice:
            self._report_failure(write, f"transfer writes head slice {transfer.head_slice}, not {req.head_slice}")
            return
        transfer.head_slice = req.head_slice
        if transfer.last_accepted_closes:
            self._report_failure(write, "transfer already has its closing write")
            return
        if transfer.stop is not None:
            self._report_failure(write, transfer.stop.detail, transfer.stop.outcome)
            return
        transfer.last_accepted_closes = req.closes_transfer
        transfer.writes += 1
        transfer.queued += 1
        self._pending.append(write)

    def _post_ready(self, now: float) -> None:
        while self._pending:
            write = self._pending[0]
            if not self._is_ready(write, now) or self._waits_for_shared_block(write):
                return
            self._pending.popleft()
            transfer = self._transfers[write.request.transfer_id]
            transfer.queued -= 1
            if write.error is None:
                self._gather(write, transfer)
            self._post(write, transfer)

    def _gather(self, leader: _Write, transfer: _Transfer) -> None:
        """Put the following writes of the same transfer that are ready now on the leader's handle.

        When the writer falls behind (several layers ready at once), one handle instead of one per
        layer saves per-handle costs (measured on H200: 32 per-layer handles of 32 MiB posted at once
        ran at 83-140 GiB/s, one handle at 247-281, grouped 148). Streaming, where layers become ready one by one,
        is unchanged.
        """
        limit = self.max_group_writes
        if limit <= 1 or leader.plan.shared_blocks or leader.request.closes_transfer:
            return
        while self._pending and len(leader.group) + 1 < limit:
            nxt = self._pending[0]
            req = nxt.request
            if (
                req.transfer_id != leader.request.transfer_id
                or req.head_slice != leader.request.head_slice
                or nxt.plan.table != leader.plan.table
                or nxt.plan.granule != leader.plan.granule
                or nxt.plan.shared_blocks
                or not _ready_without_waiting(req.ready_event)
            ):
                break
            self._pending.popleft()
            transfer.queued -= 1
            leader.group.append(nxt)
            if req.closes_transfer:
                break
        if leader.group:
            plans = [m.plan for m in leader.members]
            leader.post_plan = WritePlan(
                table=leader.plan.table,
                granule=leader.plan.granule,
                local_indices=np.concatenate([p.local_indices for p in plans]),
                remote_indices=np.concatenate([p.remote_indices for p in plans]),
                explicit=np.concatenate([p.explicit for p in plans]),
                total_bytes=sum(p.total_bytes for p in plans),
                descriptor_count=sum(p.descriptor_count for p in plans),
            )

    def _waits_for_shared_block(self, write: _Write) -> bool:
        """True while an in-flight write of the same transfer copies a block this one copies too."""
        shared = write.plan.shared_blocks
        if not shared:
            return False
        transfer = self._transfers.get(write.request.transfer_id)
        return transfer is not None and any(
            (other.open_handles or other.held_until is not None) and not shared.isdisjoint(other.plan.shared_blocks)
            for other in transfer.in_flight
        )

    def _is_ready(self, write: _Write, now: float) -> bool:
        event = write.request.ready_event
        if event is None:
            return True
        if hasattr(event, "query"):
            if self._query(cast(QueryableEvent, event)):
                # Events complete in stream order: stamp every watched one that is done before this write can
                # post (and be reported done within this same iteration).
                self._stamp_completed_events()
                return True
            if now - write.submitted_at > self._config.post_timeout_s:
                write.request = _without_event(write.request)
                write.error = f"ready_event not complete within {self._config.post_timeout_s}s"
                return True  # _post reports it
            return False
        event.synchronize()
        return True

    def _query(self, event: QueryableEvent) -> bool:
        if self._trace is None:
            return event.query()
        started = time.perf_counter()
        done = event.query()
        self._trace.call("event", time.perf_counter() - started)
        return done

    def _post(self, write: _Write, transfer: _Transfer) -> None:
        req = write.request
        if write.error is not None:
            self._report_failure(write, write.error)
            self._fail_transfer(transfer, _failed(write.error))
            return
        peer = self._agent.peer(req.peer_agent)
        if peer is None or peer.leaving:
            reason = peer.leaving_reason if peer is not None else f"peer {req.peer_agent!r} is not loaded"
            self._report_failure(write, reason)
            self._fail_transfer(transfer, _failed(reason))
            return
        refused = req.post_guard() if req.post_guard is not None and not write.hold_done else None
        if refused is not None:
            self._report_failure(write, f"not posted: {refused}")
            self._fail_transfer(transfer, _failed(f"not posted: {refused}"))
            return
        if not write.hold_done:
            transfer.posts += len(write.members)  # writes, not handles: ready writes may share one
            if (self._config.fault_hold_posted_s > 0 and transfer.posts > self._config.fault_hold_after_writes
                    and max(m.request.token_end for m in write.members) > self._config.fault_hold_from_token):
                # Fault injection: posted now, its bytes move later (see _check_in_flight).
                write.posted_at = time.monotonic()
                write.held_until = write.posted_at + self._config.fault_hold_posted_s
                transfer.first_post = transfer.first_post or write.posted_at
                transfer.in_flight.append(write)
                _log.warning("fault injection: posted write held", transfer_id=req.transfer_id,
                             layers=write.handle_layers, hold_s=self._config.fault_hold_posted_s)
                return
        nixl = self._agent.nixl
        plan = write.post_plan or write.plan
        notify = next((m.request.notify for m in write.members if m.request.notify is not None), None)
        attach = notify is not None and not transfer.in_flight and (
            (plan.local_indices.size > 0) != (plan.explicit.shape[0] > 0)
        )
        write.wall_start_ns = time.time_ns()
        started = time.perf_counter()
        if not write.hold_done:
            write.posted_at = time.monotonic()
        if transfer.first_post is None:
            transfer.first_post = write.posted_at
        try:
            if plan.local_indices.size:
                local_tables, remote_tables = self._agent.local_tables(), peer.tables
                if req.head_slice is not None:
                    cut = req.head_slice
                    local_tables = local_tables.heads(cut.source_start, cut.count)
                    remote_tables = remote_tables.heads(cut.destination_start, cut.count)
                local = local_tables.table(plan.table, plan.granule)
                remote = remote_tables.table(plan.table, plan.granule)
                write.handles.append(
                    nixl.make_prepped_xfer("WRITE", local, plan.local_indices, remote, plan.remote_indices)
                )
            if plan.explicit.shape[0]:
                local_layout = self._agent.layout
                ex = plan.explicit
                local_descs = np.stack(
                    [ex[:, 0], ex[:, 2], np.full(len(ex), local_layout.device_id)], axis=1
                ).astype(np.uint64)
                remote_descs = np.stack(
                    [ex[:, 1], ex[:, 2], np.full(len(ex), peer.layout.device_id)], axis=1
                ).astype(np.uint64)
                write.handles.append(
                    nixl.initialize_xfer(
                        "WRITE",
                        nixl.get_xfer_descs(local_descs, local_layout.memory_kind),
                        nixl.get_xfer_descs(remote_descs, peer.layout.memory_kind),
                        req.peer_agent,
                    )
                )
            for handle in write.handles:
                state = nixl.transfer(handle, notify if attach and notify is not None else b"")
                write.open_handles.append(handle)
                if state == "ERR":
                    raise RuntimeError("transfer() returned ERR")
            write.notif_attached = attach
        except Exception as exc:
            write.post_seconds = time.perf_counter() - started
            # Handles never posted can be released now; posted ones are tracked until they end.
            for handle in write.handles:
                if handle not in write.open_handles:
                    self._release(handle)
            reason = f"post failed: {exc!r}"
            if write.open_handles:
                transfer.in_flight.append(write)
            self._report_failure(write, reason)
            self._fail_transfer(transfer, _failed(reason))
            return
        write.post_seconds = time.perf_counter() - started
        if self._trace is not None:
            self._trace.call("post", write.post_seconds)
        transfer.post_seconds += write.post_seconds
        transfer.in_flight.append(write)
        _log.debug("write posted", transfer_id=req.transfer_id, layers=write.handle_layers,
                   queued_ms=round((time.monotonic() - write.submitted_at) * 1000, 2),
                   post_ms=round(write.post_seconds * 1000, 3))

    def _check_in_flight(self, now: float) -> bool:
        nixl = self._agent.nixl
        trace = self._trace
        in_order = self._config.check_in_post_order
        any_open = False
        for transfer in list(self._transfers.values()):
            earlier_open = False  # an earlier write of this transfer is still in progress
            for write in list(transfer.in_flight):
                if write.held_until is not None:
                    any_open = self._release_held(write, transfer, now) or any_open
                    continue
                if in_order and earlier_open and now - write.posted_at <= self._config.transfer_timeout_s:
                    # Posted after one still in progress: checked once that one is done (config.py says why).
                    any_open = True
                    continue
                for handle in list(write.open_handles):
                    started = time.perf_counter()
                    try:
                        state = nixl.check_xfer_state(handle)
                    except Exception as exc:
                        state, detail = "ERR", repr(exc)
                    else:
                        detail = "transfer state ERR"
                    if trace is not None:
                        trace.call("check", time.perf_counter() - started)
                        if state == "DONE":
                            trace.handle_done()
                    if state == "DONE":
                        write.open_handles.remove(handle)
                        self._collect_telemetry(write, handle)
                        self._release(handle)
                    elif state == "ERR":
                        write.open_handles.remove(handle)
                        self._release(handle)
                        self._report_failure(write, detail)
                        self._fail_transfer(transfer, _failed(detail))
                    elif now - write.posted_at > self._config.transfer_timeout_s:
                        # The bound every posted WRITE is held to (max_write_s): release the handle (NIXL cancels
                        # its UCX requests) and drop the peer's endpoint (a forced close ends what the NIC may
                        # still retry), so nothing of it lands after the bound (docs/connector.md).
                        write.open_handles.remove(handle)
                        self._release(handle)
                        reason = f"transfer not done within {self._config.transfer_timeout_s}s"
                        self._report_failure(write, reason)
                        self._fail_transfer(transfer, _failed(reason))
                        self._agent.remove_peer(transfer.peer, f"a write to it was aborted: {reason}")
                if write.open_handles:
                    any_open = earlier_open = True
                    continue
                transfer.in_flight.remove(write)
                if write.error is None:
                    _log.debug("write done", transfer_id=write.request.transfer_id,
                               layers=write.handle_layers)
                    self._report_success(write, transfer, now)
            self._maybe_finish(transfer, now)
        return any_open

    def _release_held(self, write: _Write, transfer: _Transfer, now: float) -> bool:
        """Fault injection: post a held write once its hold ends, or abort it at the bound; True while held."""
        if now - write.posted_at > self._config.transfer_timeout_s:
            write.held_until = None
            transfer.in_flight.remove(write)
            reason = f"transfer not done within {self._config.transfer_timeout_s}s"
            self._report_failure(write, reason)
            self._fail_transfer(transfer, _failed(reason))
            return False
        if write.held_until is not None and now < write.held_until:
            return True
        write.held_until = None
        write.hold_done = True
        transfer.in_flight.remove(write)
        _log.warning("fault injection: held write posted", transfer_id=write.request.transfer_id,
                     layers=write.handle_layers)
        self._post(write, transfer)
        return bool(write.open_handles)

    def _collect_telemetry(self, write: _Write, handle: XferHandle) -> None:
        if not self._config.capture_telemetry:
            return
        try:
            t = self._agent.nixl.get_xfer_telemetry(handle)
        except Exception:
            return
        acc = write.telemetry or {"post_us": 0.0, "xfer_us": 0.0, "bytes": 0.0, "descriptors": 0.0}
        acc["post_us"] += float(t.postDuration)
        acc["xfer_us"] = max(acc["xfer_us"], float(t.xferDuration))
        acc["bytes"] += float(t.totalBytes)
        acc["descriptors"] += float(t.descCount)
        write.telemetry = acc

    def _release(self, handle: XferHandle) -> None:
        try:
            self._agent.nixl.release_xfer_handle(handle)
        except Exception:
            self._zombies.append((handle, time.monotonic()))

    def _retry_zombies(self, now: float) -> None:
        if not self._zombies:
            return
        keep = []
        for handle, since in self._zombies:
            try:
                self._agent.nixl.release_xfer_handle(handle)
            except Exception:
                if now - since < self._config.transfer_timeout_s:
                    keep.append((handle, since))
                else:
                    _log.error("xfer_handle_abandoned", handle=repr(handle))
        self._zombies = keep

    def _report_success(self, write: _Write, transfer: _Transfer, now: float) -> None:
        """Report the write and every write on its handle (they share post time and telemetry)."""
        alone = not write.group
        for member in write.members:
            req = member.request
            member.reported = True
            descriptors = (int(write.telemetry["descriptors"]) if (alone and write.telemetry)
                           else member.plan.descriptor_count)
            transfer.bytes += member.plan.total_bytes
            transfer.descriptors += descriptors
            transfer.layers.update(int(layer) for layer in req.layers)
            transfer.last_done = now
            if req.closes_transfer:
                transfer.closing = write  # the handle that carried (or will send) the notification
            outcome = WriteOutcome(
                req.transfer_id, PushOutcome.DONE, member.plan.total_bytes, descriptors, write.post_seconds,
                now - write.posted_at, None, req.peer_agent, 1, tuple(int(x) for x in req.layers),
                write.notif_attached and req.notify is not None, write.telemetry, len(write.members),
            )
            self._span(member, outcome, write.wall_start_ns)
            self._emit(self._on_request_done, outcome)

    def _report_failure(self, write: _Write, reason: str, outcome: PushOutcome = PushOutcome.FAILED) -> None:
        """Report the write (and every write on its handle) failed (or CANCELLED: dropped by `cancel`), once."""
        elapsed = time.monotonic() - write.posted_at if write.posted_at else 0.0
        for member in write.members:
            if member.reported:
                continue
            member.reported = True
            member.error = reason
            req = member.request
            failed = WriteOutcome(
                req.transfer_id, outcome, 0, 0, write.post_seconds, elapsed, reason, req.peer_agent, 1,
                tuple(int(x) for x in req.layers),
            )
            _log.warning("write_failed", transfer_id=req.transfer_id, peer=req.peer_agent, error=reason)
            self._span(member, failed, write.wall_start_ns)
            self._emit(self._on_request_done, failed)
        write.error = write.error or reason

    def _fail_transfer(self, transfer: _Transfer, stop: PushStop) -> None:
        if transfer.stop is None:
            transfer.stop = stop
        if transfer.queued:
            keep: deque[_Write] = deque()
            for write in self._pending:
                if write.request.transfer_id == transfer.transfer_id:
                    self._report_failure(write, f"dropped: {stop.detail}", stop.outcome)
                else:
                    keep.append(write)
            self._pending = keep
            transfer.queued = 0
        self._maybe_finish(transfer, time.monotonic())

    def _maybe_finish(self, transfer: _Transfer, now: float) -> None:
        if self._transfers.get(transfer.transfer_id) is not transfer:
            return  # already finished
        if transfer.in_flight or transfer.queued:
            return
        if transfer.stop is None and transfer.closing is None:
            return
        notified = False
        stop = transfer.stop
        if stop is None and transfer.closing is not None:
            closing = transfer.closing
            notified = closing.notif_attached
            notify = next((m.request.notify for m in closing.members if m.request.notify is not None), None)
            if notify is not None and not notified:
                try:
                    self._agent.nixl.send_notif(transfer.peer, notify)
                    notified = True
                except Exception as exc:
                    stop = _failed(f"send_notif failed: {exc!r}")
        error = stop.detail if stop is not None else None
        outcome = WriteOutcome(
            transfer.transfer_id,
            PushOutcome.DONE if stop is None else stop.outcome,
            transfer.bytes,
            transfer.descriptors,
            transfer.post_seconds,
            (transfer.last_done or now) - transfer.first_post if transfer.first_post is not None else 0.0,
            error,
            transfer.peer,
            transfer.writes,
            tuple(sorted(transfer.layers)),
            notified,
        )
        del self._transfers[transfer.transfer_id]
        self._remember_ended(transfer.transfer_id, "ok" if error is None else error)
        self._emit(self._on_transfer_done, outcome)
        for waiter in transfer.waiters:
            if not waiter.done():
                waiter.set_result(outcome)

    def _remember_ended(self, transfer_id: str, how: str) -> None:
        self._ended[transfer_id] = how
        while len(self._ended) > _ENDED_MEMORY:
            self._ended.popitem(last=False)

    def _emit(self, callback: Callable[[WriteOutcome], None] | None, outcome: WriteOutcome) -> None:
        if callback is None:
            return
        try:
            callback(outcome)
        except Exception as exc:
            _log.error("outcome_callback_failed", transfer_id=outcome.transfer_id, error=repr(exc))

    def _span(self, write: _Write, outcome: WriteOutcome, start_ns: int = 0) -> None:
        req = write.request
        context = _PROPAGATOR.extract({"traceparent": req.traceparent}) if req.traceparent else None
        start = start_ns or time.time_ns()
        span = self._tracer.start_span("kvpush.dataplane.write", context=context, start_time=start)
        if span.is_recording():
            span.set_attribute("kvpush.transfer_id", req.transfer_id)
            span.set_attribute("kvpush.peer_agent", req.peer_agent)
            layers = [int(x) for x in req.layers]
            span.set_attribute("kvpush.layer_first", layers[0] if layers else -1)
            span.set_attribute("kvpush.layer_count", len(layers))
            span.set_attribute("kvpush.token_start", req.token_start)
            span.set_attribute("kvpush.token_end", req.token_end)
            span.set_attribute("kvpush.bytes", outcome.bytes)
            span.set_attribute("kvpush.descriptor_count", outcome.descriptor_count)
            span.set_attribute("kvpush.post_seconds", outcome.post_seconds)
            if not outcome.ok:
                span.set_status(trace.Status(trace.StatusCode.ERROR, outcome.error or "failed"))
        span.end()


def _ready_without_waiting(event: ReadyEvent | None) -> bool:
    """True when `event` is absent or reports completion without blocking."""
    if event is None:
        return True
    query = getattr(event, "query", None)
    return bool(query()) if query is not None else False


def _without_event(request: WriteRequest) -> WriteRequest:
    from dataclasses import replace

    return replace(request, ready_event=None)
