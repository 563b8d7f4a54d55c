"""The KV-directory's state machine: engines, leases, transfers, planning, watch events.

No gRPC in here: the servicer validates wire input, calls one method, maps a raised
`errors.DirectoryError` to a status code, and delivers the returned `Effects`.

Life cycle of a transfer (terminal states never change again):

1. `plan()` picks a prefill and a decode engine and mints the transfer: PLANNED. A caller that names the
   transfer (PlanTransferRequest.transfer_id, prefill engine pinned) may have sent the prefill leg first:
   readiness that engine marked `plan_in_flight` for an id not planned yet is held (`EarlyReadiness`, at most
   `Limits.early_readiness_hold_s`) and applied by the plan as if it came after it; a hold that runs out
   tells the engine to stop (Cancellation), and a plan that comes later still is refused.
2. `report_allocation()` (decode's blocks) and `report_ready()` (prefill's first ready layers)
   arrive in either order. The first makes it ALLOCATED (or records readiness while PLANNED);
   when both are known it becomes STREAMING and ONE `PushInstruction` goes to the outbox of
   every prefill rank. Later readiness only records progress.
3. `report_result()` per prefill rank: DONE from every rank -> COMPLETE; FAILED -> FAILED. A DONE
   may carry the token prefill sampled after the prompt (first token from prefill); the COMPLETE
   event then carries it to decode, whose first sampled token is forced to it.
4. Every other end (a cancel, a broken prefill session, a lost engine, the transfer's deadline) is
   first *decided* (`Ending`, prefill told to stop) and becomes terminal only once no WRITE of it can
   still land in decode's blocks (`_end_when_no_write_can_land`): every dispatched prefill rank
   confirmed it is quiescent (DONE/FAILED/CANCELLED), or its lease is gone and the rank's fence
   passed (lease deadline + `Limits.max_write_s`: a prefill worker posts only within its lease and
   its data plane ends each posted WRITE within max_write_s). Nothing dispatched: at once. A live
   rank that does not confirm by `Ending.confirm_by` has its lease revoked (then its fence applies).
   So decode is told (and reuses its blocks) only when no write can land in them: docs/connector.md.
5. `reap(now)` (every ~100 ms) ends leases that lapsed (an engine lost), transfers past their
   deadline (EXPIRED), fences that passed and confirmations overdue.
6. Ending a transfer releases its decode blocks, appends a `TransferEvent` to the decode
   engine's watch log (sequence-numbered) and puts a `Cancellation` in the outbox of every
   prefill rank that may still be working on it.

Peers: a prefill worker's session opens with a `PeerAnnouncement` of every decode worker it may push to, and
gets one for each that registers later, so it loads the peer's NIXL agent before any instruction needs it.

Effects: each mutating call returns an `Effects` naming the prefill outboxes (engine id, rank)
and decode watch logs that received something, so the servicer only wakes those streams.

Bounded memory: caps in `Limits` on workers, live transfers, transfers per engine, readiness
chunks per transfer; terminal transfers and watch events are kept in bounded rings.
"""

from __future__ import annotations

import itertools
import math
import re
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence

from kvpush.api import refusals
from kvpush.directory.errors import (
    AlreadyExists,
    DirectoryError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
)
from kvpush.directory.planning import HeadRoute, can_push_to, choose_pair, head_routes
from kvpush.directory.records import (
    DECODE,
    PREFILL,
    QUIESCENT_RESULTS,
    TERMINAL_STATES,
    Allocation,
    Clock,
    EarlyReadiness,
    Effects,
    Ending,
    EngineGroup,
    Limits,
    StoredTransfer,
    TransferObserver,
    TransferRecord,
    UnreachableReport,
    WatchLog,
    Worker,
    copy_message,
    layer_mask,
)
from kvpush.directory.registry import EngineRegistry
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb

_SEQUENCE_TOKEN = re.compile("[0-9]{1,18}")


def _announcement(decode: Worker) -> dpb.StreamPrefillResponse:
    return dpb.StreamPrefillResponse(peer=dpb.PeerAnnouncement(
        decode_engine_id=decode.engine_id, decode_tp_rank=decode.tp_rank, decode_agent_name=decode.agent_name,
        decode_agent_metadata=decode.agent_metadata, decode_layout=decode.layout))


def _head_slice(route: HeadRoute) -> dpb.KVHeadSlice:
    return dpb.KVHeadSlice(source_head_start=route.source_head_start,
                           destination_head_start=route.destination_head_start, head_count=route.head_count)


def _transfer_of(message: dpb.StreamPrefillResponse) -> str:
    kind = message.WhichOneof("message")
    return getattr(message, kind).transfer_id if kind in ("instruction", "cancellation") else ""
# Re-exported: callers build a state from these without importing `records`.
__all__ = [
    "DECODE",
    "PREFILL",
    "TERMINAL_STATES",
    "Allocation",
    "Clock",
    "DirectoryState",
    "Effects",
    "EngineGroup",
    "Limits",
    "TransferObserver",
    "TransferRecord",
    "Worker",
]


class DirectoryState:
    """Engines, leases and transfers of one directory process. Not thread-safe: one event loop calls it."""

    def __init__(self, limits: Limits | None = None, clock: Clock | None = None,
                 observer: TransferObserver | None = None) -> None:
        self.limits = limits or Limits()
        self.clock = clock or Clock()
        self.observer = observer or TransferObserver()
        self.engines = EngineRegistry(self.limits, self.clock)
        # Every retained transfer, in creation order (live and the last N terminal ones).
        self._transfers: dict[str, TransferRecord] = {}
        self._live: dict[str, TransferRecord] = {}
        # Readiness for transfers not planned yet, by transfer id (see `plan()`).
        self._early: dict[str, EarlyReadiness] = {}
        self._terminal_order: deque[str] = deque()
        # (client id, engine id) -> live transfers of that client on that engine (Limits.max_client_share).
        self._client_transfers: Counter[tuple[str, str]] = Counter()
        # decode engine id -> block id -> transfer id owning it (non-terminal transfers only).
        self._owned_blocks: dict[str, dict[int, str]] = {}
        self._watch_logs: dict[str, WatchLog] = {}
        self._event_sequence = 0
        self._transfer_sequence = itertools.count(1)
        self._session_ids = itertools.count(1)
        self._last_reap: float | None = None
        # Called with a worker whose lease this state revoked; a replica revokes the etcd lease behind it.
        self.on_lease_revoked: Callable[[Worker], None] | None = None
        # Mints transfer ids; a directory replica replaces it to mint only ids of the shards it owns.
        self.new_transfer_id: Callable[[], str] = lambda: uuid.uuid4().hex

    # ---------------------------------------------------------------- engines and leases

    def register(self, request: dpb.RegisterEngineRequest) -> tuple[Worker, Effects]:
        """Register one worker and grant it a lease; a same-agent re-registration gets a fresh one (never the live
        one)."""
        fx = Effects()
        now = self.clock.monotonic()
        existing = self.engines.existing(request, now)
        if existing is not None and existing.lease_deadline >= now:
            self.engines.refresh(existing, request, now)  # same agent (existing() refused another): fresh lease
            return existing, fx
        if existing is not None:  # lapsed but not reaped yet: end it first
            self._remove_worker(existing, "lease expired", fx)
        worker = self.engines.add(request, now)
        self._relink_live(worker.engine_id)
        if request.role == DECODE:
            self._watch_logs.setdefault(
                request.engine_id, WatchLog(self.limits.retained_watch_events_per_engine)).gone_since = None
            self._announce_decode(worker, fx)
        return worker, fx

    def _relink_live(self, engine_id: str) -> None:
        """List an engine's still-live transfers on its (re-)registered group: a transfer whose end waits for a
        fence of the engine's previous registration still counts towards the engine's cap and its active count."""
        group = self.engines.groups[engine_id]
        group.active_transfers.update(t for t, r in self._live.items()
                                      if engine_id in (r.prefill_engine_id, r.decode_engine_id))

    def lease_holder(self, lease_id: str) -> Worker:
        """The worker holding a live lease; NotFound for an unknown or lapsed lease."""
        worker = self.engines.leases.get(lease_id)
        if worker is None or worker.lease_deadline < self.clock.monotonic():
            raise NotFound(f"lease {lease_id!r} is unknown or expired")
        return worker

    def renew(self, lease_id: str, load: tpb.EngineLoad | None) -> Worker:
        """Renew a live lease and record the reported load; NotFound for an unknown or lapsed lease."""
        return self.engines.renew(lease_id, load)

    def deregister(self, engine_id: str, tp_rank: int, lease_id: str) -> Effects:
        """Remove one worker; every live transfer of its engine fails towards the peer."""
        worker = self.engines.worker(engine_id, tp_rank)
        if worker.lease_id != lease_id:
            raise NotFound(f"engine {engine_id!r} rank {tp_rank} holds no lease {lease_id!r}")
        fx = Effects()
        self._remove_worker(worker, f"engine {engine_id} rank {tp_rank} deregistered", fx)
        return fx

    def _remove_worker(self, worker: Worker, reason: str, fx: Effects) -> None:
        """Drop a worker: each live transfer of its engine fails (a decided end keeps its state).

        A prefill rank that may have writes in flight is fenced: it posts nothing after its lease
        deadline, and each posted WRITE ends within max_write_s, so its writes cannot land after
        lease deadline + max_write_s. The transfer ends then (or at once if it confirms earlier).
        """
        group = self.engines.remove(worker)
        self._drop_early(worker.engine_id, worker.tp_rank)
        for transfer_id in list(group.active_transfers):
            record = self._live.get(transfer_id)
            if record is None:
                continue
            if worker.role == PREFILL and record.dispatched and worker.tp_rank not in record.quiescent:
                # A registration mirrored from etcd (replicas) has no deadline here: etcd ended it now, and it
                # was renewed at most a TTL ago, so the worker posts nothing after now + TTL.
                lease_end = (worker.lease_deadline if math.isfinite(worker.lease_deadline)
                             else self.clock.monotonic() + self.limits.lease_ttl_s)
                record.rank_fences[worker.tp_rank] = lease_end + self.limits.max_write_s
            self._decide_end(record, tpb.TRANSFER_STATE_FAILED, reason, fx)
        if not group.workers:
            log = self._watch_logs.get(worker.engine_id)
            if log is not None:
                log.gone_since = self.clock.monotonic()

    def report_unreachable(self, engine_id: str, transfer_id: str, reason: str) -> bool:
        """Mark an engine unreachable (planning leaves it out until its next renewal); True when marked.

        With `transfer_id`, the transfer must name the engine (FailedPrecondition), and a report about a
        registration newer than the transfer (the engine restarted since it was planned) changes nothing.
        """
        group = self.engines.groups.get(engine_id)
        if group is None:
            raise NotFound(f"engine {engine_id!r} is not registered")
        if transfer_id:
            record = self._transfer(transfer_id)
            if engine_id not in (record.prefill_engine_id, record.decode_engine_id):
                raise FailedPrecondition(f"transfer {transfer_id} does not name engine {engine_id!r}")
            if max(w.register_wall for w in group.workers.values()) > record.create_wall:
                return False
        group.unreachable = UnreachableReport(self.clock.wall(), reason)
        return True

    def unreachable_report(self, engine_id: str) -> UnreachableReport | None:
        """The engine's standing unreachable report (None: none, or the engine is not registered)."""
        group = self.engines.groups.get(engine_id)
        return group.unreachable if group is not None else None

    def get_engine(self, engine_id: str) -> list[Worker]:
        """Registered workers of one engine in rank order; NotFound when none."""
        return self.engines.workers_of(engine_id)

    def active_transfer_count(self, engine_id: str) -> int:
        """Live transfers the engine takes part in (0 for an unknown engine)."""
        group = self.engines.groups.get(engine_id)
        return len(group.active_transfers) if group is not None else 0

    def list_workers(self, page_size: int, page_token: str, role: int) -> tuple[list[Worker], str]:
        """One page of workers ordered by (engine id, rank); returns the next page token ("" at the end)."""
        return self.engines.list_workers(page_size, page_token, role)

    # ---------------------------------------------------------------- planning

    def plan(self, request: dpb.PlanTransferRequest, ttl_s: float | None) -> tuple[TransferRecord, Effects]:
        """Pick engines (`planning.choose_pair`) and mint a PLANNED transfer; apply its early readiness, if any."""
        fx = Effects()
        ttl = self.limits.transfer_ttl_s if ttl_s is None else ttl_s
        if ttl > self.limits.max_transfer_ttl_s:
            raise InvalidArgument(f"ttl {ttl}s is over the server maximum {self.limits.max_transfer_ttl_s}s")
        if request.transfer_id:
            known = self._transfers.get(request.transfer_id)
            if known is not None:
                if (known.request_id == request.request_id and known.prefill_engine_id == request.prefill_engine_id
                        and request.decode_engine_id in ("", known.decode_engine_id)):
                    return known, fx  # the same call again (its answer was lost): the same transfer
                raise AlreadyExists(f"transfer {request.transfer_id!r} exists")
            early = self._early.get(request.transfer_id)
            if early is not None and early.stopped:
                raise FailedPrecondition(
                    f"readiness for transfer {request.transfer_id!r} waited over {self.limits.early_readiness_hold_s}s "
                    "for its plan; its prefill engine was told to stop")
        if len(self._live) >= self.limits.max_live_transfers:
            raise ResourceExhausted(f"{len(self._live)} live transfers; the cap is {self.limits.max_live_transfers}")
        now = self.clock.monotonic()
        prefill, decode = choose_pair(self._plannable(PREFILL, request.prefill_engine_id, request.client_id, now),
                                      self._plannable(DECODE, request.decode_engine_id, request.client_id, now),
                                      request.prompt_token_count, self.limits.max_active_transfers_per_engine,
                                      model=request.model, pair_block_sizes=self.limits.pair_block_sizes)
        record = self._mint(request, prefill, decode, ttl)
        early = self._early.pop(record.transfer_id, None)
        if early is not None:
            self._apply_early(record, early, fx)
        return record, fx

    def _plannable(self, role: int, pinned: str, client_id: str, now: float) -> list[EngineGroup]:
        """Candidate engines of a role a plan may use: not late renewing (a frozen or starved engine would hold
        the request), and, for a client at its share of an engine's cap (`Limits.max_client_share`), not that
        engine. ResourceExhausted, naming the bound, when none is left."""
        name = "prefill" if role == PREFILL else "decode"
        groups = self.engines.candidates(role, pinned)
        late = {g.engine_id: since for g in groups if (since := self.engines.late_since(g, now)) is not None}
        for _ in late:
            self.observer.on_engine_skipped("late_renewal")
        groups = [g for g in groups if g.engine_id not in late]
        if not groups:
            engine_id, since = next(iter(late.items()))
            raise ResourceExhausted(
                f"every candidate {name} engine renews its lease late: {engine_id!r} last renewed {since:.1f}s ago, "
                f"over the {self.limits.lease_ttl_s * self.limits.late_renewal_fraction:g}s bound",
                limit="late_renewal")
        if not client_id or self.limits.max_client_share >= 1:
            return groups
        cap = self.limits.client_transfer_cap()
        full = [g for g in groups if self._client_transfers[(client_id, g.engine_id)] >= cap]
        for _ in full:
            self.observer.on_engine_skipped("client_share")
        if len(full) == len(groups):
            raise ResourceExhausted(
                f"client {client_id!r} holds {cap} live transfers on every candidate {name} engine "
                f"({full[0].engine_id!r} included): its share is {self.limits.max_client_share:g} of the "
                f"{self.limits.max_active_transfers_per_engine}-transfer cap per engine", limit="client_share")
        return [g for g in groups if g not in full]

    def _apply_early(self, record: TransferRecord, early: EarlyReadiness, fx: Effects) -> None:
        """Apply readiness held for a transfer that is now planned, as if it had come after the plan."""
        if early.engine_id != record.prefill_engine_id:  # the plan is the authority on who prefills
            self._stop_early(record.transfer_id, early, f"transfer planned for engine {record.prefill_engine_id!r}",
                             fx)
            self.observer.on_early_readiness("dropped")
            return
        self.observer.on_early_readiness("planned")
        for tp_rank, held in early.events.items():
            for event, wall in held:
                try:
                    self._ready_one(early.engine_id, tp_rank, event, fx, wall=wall)
                except DirectoryError as error:  # checked when held; kept as a guard, never silent
                    self._decide_end(record, tpb.TRANSFER_STATE_FAILED, f"held readiness refused: {error}", fx)
                    return

    def _hold_early(self, engine_id: str, tp_rank: int, event: dpb.LayerReady) -> None:
        """Hold `plan_in_flight` readiness for a transfer not planned yet; checked as `_ready_one` would."""
        early = self._early.get(event.transfer_id)
        if early is None:
            group = self.engines.groups.get(engine_id)
            if group is None or tp_rank not in group.workers:
                raise NotFound(f"engine {engine_id!r} rank {tp_rank} is not registered")
            held = sum(1 for e in self._early.values() if e.engine_id == engine_id)
            if held >= self.limits.max_early_transfers_per_engine:
                raise ResourceExhausted(f"engine {engine_id!r} holds readiness for {held} unplanned transfers; "
                                        f"the cap is {self.limits.max_early_transfers_per_engine}")
            early = EarlyReadiness(engine_id=engine_id, since=self.clock.monotonic(),
                                   layer_count=group.layout().layer_count, prompt_token_count=event.prompt_token_count)
        elif early.engine_id != engine_id:
            raise PermissionDenied(f"engine {early.engine_id!r} already reported readiness for this unplanned transfer")
        if early.stopped:
            raise FailedPrecondition(f"transfer {event.transfer_id!r} was not planned within "
                                     f"{self.limits.early_readiness_hold_s}s; stop it")
        if event.layer_end > early.layer_count:
            raise InvalidArgument(f"layer_end {event.layer_end} is out of range (0, {early.layer_count}]")
        if event.prompt_token_count != early.prompt_token_count:
            raise InvalidArgument(
                f"prompt_token_count {event.prompt_token_count} differs from {early.prompt_token_count}")
        if early.event_count() >= self.limits.max_chunks_per_transfer:
            raise ResourceExhausted(f"over {self.limits.max_chunks_per_transfer} readiness chunks")
        early.events.setdefault(tp_rank, []).append((copy_message(event), self.clock.wall()))
        self._early[event.transfer_id] = early

    def _stop_early(self, transfer_id: str, early: EarlyReadiness, reason: str, fx: Effects) -> None:
        """Tell every rank that reported early readiness for `transfer_id` to stop (it confirms with CANCELLED)."""
        group = self.engines.groups.get(early.engine_id)
        for rank in early.events:
            worker = group.workers.get(rank) if group is not None else None
            if worker is not None:
                worker.outbox.append(dpb.StreamPrefillResponse(
                    cancellation=dpb.Cancellation(transfer_id=transfer_id, reason=reason)))
                fx.prefill_outboxes.add((early.engine_id, rank))

    def _drop_early(self, engine_id: str, tp_rank: int) -> None:
        """Forget the early readiness of a rank whose session or registration ended (its work on it stopped); every
        hold of an engine that is no longer registered goes."""
        registered = engine_id in self.engines.groups
        for transfer_id, early in list(self._early.items()):
            if early.engine_id != engine_id:
                continue
            early.events.pop(tp_rank, None)
            if registered and (early.events or early.stopped):
                continue  # other ranks still hold readiness, or a stopped hold still refuses a late plan
            del self._early[transfer_id]
            if not early.stopped:
                self.observer.on_early_readiness("dropped")

    def _mint(self, request: dpb.PlanTransferRequest, prefill: EngineGroup, decode: EngineGroup,
              ttl: float) -> TransferRecord:
        wall = self.clock.wall()
        record = TransferRecord(
            transfer_id=request.transfer_id or self.new_transfer_id(), sequence=next(self._transfer_sequence),
            request_id=request.request_id,
            prefill_engine_id=prefill.engine_id, decode_engine_id=decode.engine_id, tp_size=prefill.tp_size,
            layer_count=prefill.layout().layer_count, trace_context=request.trace_context, create_wall=wall,
            deadline=self.clock.monotonic() + ttl, deadline_wall=wall + ttl,
            plan_prompt_token_count=request.prompt_token_count, client_id=request.client_id,
        )
        self._transfers[record.transfer_id] = record
        self._live[record.transfer_id] = record
        prefill.active_transfers.add(record.transfer_id)
        decode.active_transfers.add(record.transfer_id)
        self._count_client(record, 1)
        self.observer.on_planned(record)
        return record

    def _count_client(self, record: TransferRecord, delta: int) -> None:
        """Move the live-transfer count of the record's client on both its engines (no client: nothing)."""
        if not record.client_id:
            return
        for engine_id in (record.prefill_engine_id, record.decode_engine_id):
            key = (record.client_id, engine_id)
            self._client_transfers[key] += delta
            if self._client_transfers[key] <= 0:
                del self._client_transfers[key]

    # ---------------------------------------------------------------- decode allocation

    def report_allocation(self, request: dpb.ReportAllocationRequest,
                          hold_dispatch: bool = False) -> tuple[TransferRecord, Effects]:
        """Record decode's blocks; dispatch if readiness is already known. Identical repeats are no-ops.

        hold_dispatch: no instruction goes out until `release_dispatch()` (a replica stores the blocks in
        etcd first, so a replica taking the shard over knows every block a write may land in).
        """
        record = self._transfer(request.transfer_id)
        if request.engine_id not in self.engines.groups:
            raise NotFound(f"engine {request.engine_id!r} is not registered")
        if request.engine_id != record.decode_engine_id:
            raise PermissionDenied(
                f"engine {request.engine_id!r} is not the decode engine of transfer {record.transfer_id}")
        allocation = Allocation(tuple(request.block_ids), request.prompt_token_count, request.prefix_hit_token_count,
                                tuple((tuple(group.block_ids), group.first_token) for group in request.block_groups))
        fx = Effects()
        if record.allocation is not None:
            if allocation == record.allocation:
                return record, fx
            raise FailedPrecondition(f"transfer {record.transfer_id} already has a different allocation")
        if record.terminal:
            raise FailedPrecondition(
                f"transfer {record.transfer_id} is {tpb.TransferState.Name(record.state)}")
        if record.ending is not None:
            raise FailedPrecondition(f"transfer {record.transfer_id} is being cancelled")
        layout = self.engines.groups[record.decode_engine_id].layout()
        needed = math.ceil(allocation.prompt_token_count / layout.block_size_tokens)
        # With a state group, block_ids (group 0's) may be its state blocks: each group is checked on its own below.
        if len(allocation.block_ids) < needed and not _has_state_group(layout):
            raise InvalidArgument(
                f"{len(allocation.block_ids)} block ids cannot hold {allocation.prompt_token_count} tokens "
                f"of {layout.block_size_tokens} per block (need {needed})")
        bad = next((b for b in allocation.block_ids if b >= layout.block_count), None)
        if bad is not None:
            raise InvalidArgument(f"block id {bad} is out of range [0, {layout.block_count})")
        # Blocks holding decode's own prefix hit may be shared (prefix cache); only written ones are owned.
        owned = allocation.block_ids[allocation.skip_token_count // layout.block_size_tokens:needed]
        if allocation.groups or len(layout.kv_cache_groups) > 1:
            owned = _owned_group_blocks(allocation, layout, needed)
        if len(set(owned)) != len(owned):
            raise InvalidArgument("block_ids repeat a block that would be written twice")
        index = self._owned_blocks.setdefault(record.decode_engine_id, {})
        clash = next((b for b in owned if b in index), None)
        if clash is not None:
            raise FailedPrecondition(refusals.block_still_owned(clash, index[clash]))
        if record.ready_prompt_token_count and allocation.prompt_token_count > record.ready_prompt_token_count:
            raise FailedPrecondition(
                f"decode needs {allocation.prompt_token_count} tokens; prefill computes "
                f"{record.ready_prompt_token_count}")
        for block in owned:
            index[block] = record.transfer_id
        record.owned_blocks = tuple(owned)
        record.allocation = allocation
        record.allocate_wall = self.clock.wall()
        record.state = tpb.TRANSFER_STATE_ALLOCATED
        record.dispatch_held = hold_dispatch
        self.observer.on_allocated(record)
        if record.first_ready_wall is not None and not hold_dispatch:
            self._dispatch(record, fx)
        return record, fx

    def release_dispatch(self, record: TransferRecord) -> Effects:
        """End a `hold_dispatch`: dispatch now if readiness is known and the transfer is still live."""
        fx = Effects()
        if not record.dispatch_held:
            return fx
        record.dispatch_held = False
        if (not record.terminal and record.ending is None and not record.dispatched
                and record.first_ready_wall is not None):
            self._dispatch(record, fx)
        return fx

    def _transfer(self, transfer_id: str) -> TransferRecord:
        record = self._transfers.get(transfer_id)
        if record is None:
            raise NotFound(f"transfer {transfer_id!r} is unknown")
        return record

    # ---------------------------------------------------------------- prefill stream

    def open_session(self, engine_id: str, tp_rank: int, lease_id: str) -> tuple[int, Effects]:
        """Bind a new StreamPrefill session to a prefill worker; it replaces any previous session."""
        worker = self.engines.worker(engine_id, tp_rank)
        if worker.lease_id != lease_id:
            raise NotFound(f"engine {engine_id!r} rank {tp_rank} holds no lease {lease_id!r}")
        if worker.role != PREFILL:
            raise FailedPrecondition(f"engine {engine_id!r} is not a prefill engine")
        worker.session_id = next(self._session_ids)
        fx = Effects()
        for group in self.engines.groups.values():
            if group.role != DECODE:
                continue
            # The same rank of an engine of this TP size; any rank it writes heads to of another size.
            candidates = ([group.workers[tp_rank]] if tp_rank in group.workers else []) \
                if group.tp_size == worker.tp_size else [group.workers[r] for r in sorted(group.workers)]
            for decode in candidates:
                if can_push_to(worker, decode, pair_block_sizes=self.limits.pair_block_sizes):
                    worker.outbox.append(_announcement(decode))
        if worker.outbox:
            fx.prefill_outboxes.add((engine_id, tp_rank))
        return worker.session_id, fx

    def _announce_decode(self, decode: Worker, fx: Effects) -> None:
        """Tell every open session of a prefill worker that may push to a newly registered decode worker about it
        (a worker without a session hears of it when its session opens)."""
        for group in self.engines.groups.values():
            if group.role != PREFILL:
                continue
            candidates = ([group.workers[decode.tp_rank]] if decode.tp_rank in group.workers else []) \
                if group.tp_size == decode.tp_size else [group.workers[r] for r in sorted(group.workers)]
            for prefill in candidates:
                if prefill.session_id and can_push_to(prefill, decode, pair_block_sizes=self.limits.pair_block_sizes):
                    prefill.outbox.append(_announcement(decode))
                    fx.prefill_outboxes.add((prefill.engine_id, prefill.tp_rank))

    def session_worker(self, engine_id: str, tp_rank: int, session_id: int) -> Worker | None:
        """The worker if `session_id` is still its current session, else None."""
        group = self.engines.groups.get(engine_id)
        worker = group.workers.get(tp_rank) if group is not None else None
        if worker is None or worker.session_id != session_id:
            return None
        return worker

    def close_session(self, engine_id: str, tp_rank: int, session_id: int, reason: str) -> Effects:
        """A session ended: if it is still current, every transfer this rank worked on fails."""
        fx = Effects()
        worker = self.session_worker(engine_id, tp_rank, session_id)
        if worker is None:
            return fx
        worker.session_id = 0
        worker.outbox.clear()
        self._drop_early(engine_id, tp_rank)  # the worker fails what it began when its session resets
        group = self.engines.groups[engine_id]
        for transfer_id in list(group.active_transfers):
            record = self._live.get(transfer_id)
            if record is not None and (record.dispatched or tp_rank in record.ready):
                # The worker is alive (its lease holds): it stops the transfer when its session resets and
                # confirms on the next session; until then (or its fence) decode keeps its blocks.
                self._decide_end(record, tpb.TRANSFER_STATE_FAILED, reason, fx)
        return fx

    def report_ready(self, engine_id: str, tp_rank: int,
                     events: Sequence[dpb.LayerReady]) -> tuple[Effects, list[tuple[dpb.LayerReady, DirectoryError]]]:
        """Record readiness events from one prefill rank; returns effects and the refused events with why."""
        fx = Effects()
        refused: list[tuple[dpb.LayerReady, DirectoryError]] = []
        for event in events:
            try:
                self._ready_one(engine_id, tp_rank, event, fx)
            except DirectoryError as exc:
                refused.append((event, exc))
        return fx, refused

    def _ready_one(self, engine_id: str, tp_rank: int, event: dpb.LayerReady, fx: Effects,
                   wall: float | None = None) -> None:
        record = self._transfers.get(event.transfer_id)
        if record is None:
            if not event.plan_in_flight:
                raise NotFound(f"transfer {event.transfer_id!r} is unknown")
            self._hold_early(engine_id, tp_rank, event)
            return
        if record.prefill_engine_id != engine_id:
            raise PermissionDenied(f"engine {engine_id!r} is not the prefill engine of this transfer")
        if record.terminal:
            raise FailedPrecondition(f"transfer is {tpb.TransferState.Name(record.state)}")
        if event.layer_end > record.layer_count:
            raise InvalidArgument(f"layer_end {event.layer_end} is out of range (0, {record.layer_count}]")
        if record.ready_prompt_token_count and event.prompt_token_count != record.ready_prompt_token_count:
            raise InvalidArgument(
                f"prompt_token_count {event.prompt_token_count} differs from {record.ready_prompt_token_count}")
        if record.allocation is not None and record.allocation.prompt_token_count > event.prompt_token_count:
            raise FailedPrecondition(
                f"decode needs {record.allocation.prompt_token_count} tokens; prefill computes "
                f"{event.prompt_token_count}")
        chunks = record.ready.get(tp_rank)
        if chunks is None:
            chunks = record.ready[tp_rank] = {}
        key = (event.token_start, event.token_end)
        mask = layer_mask(event.layer_start, event.layer_end)
        seen = chunks.get(key)
        if seen is not None and seen | mask == seen:
            return  # already-ready range: idempotent no-op
        if seen is None:
            if record.chunk_count >= self.limits.max_chunks_per_transfer:
                raise ResourceExhausted(f"over {self.limits.max_chunks_per_transfer} readiness chunks")
            record.chunk_count += 1
            seen = 0
        chunks[key] = seen | mask
        wall = self.clock.wall() if wall is None else wall
        for layer in range(event.layer_start, event.layer_end):
            record.layer_ready_walls.setdefault(layer, wall)
        record.ready_prompt_token_count = event.prompt_token_count
        if record.first_ready_wall is None:
            record.first_ready_wall = wall
            self.observer.on_first_ready(record)
            if record.allocation is not None and record.ending is None and not record.dispatch_held:
                self._dispatch(record, fx)

    def _dispatch(self, record: TransferRecord, fx: Effects) -> None:
        """Send ONE instruction per prefill rank; it covers every layer, present and future."""
        allocation = record.allocation
        assert allocation is not None  # dispatched only once decode's blocks are known
        prefill = self.engines.groups[record.prefill_engine_id]
        decode = self.engines.groups[record.decode_engine_id]
        if decode.tp_size != prefill.tp_size:
            self._dispatch_head_slices(record, prefill, decode, allocation, fx)
        for rank in range(record.tp_size if decode.tp_size == prefill.tp_size else 0):
            target = decode.workers[rank]
            instruction = dpb.PushInstruction(
                transfer_id=record.transfer_id, decode_engine_id=record.decode_engine_id, decode_tp_rank=rank,
                decode_agent_name=target.agent_name, decode_agent_metadata=target.agent_metadata,
                decode_layout=target.layout, decode_block_ids=allocation.block_ids,
                decode_block_groups=allocation.block_group_protos(),
                skip_token_count=allocation.skip_token_count,
                prompt_token_count=allocation.prompt_token_count,
                notification=record.transfer_id.encode(), trace_context=record.trace_context,
            )
            prefill.workers[rank].outbox.append(dpb.StreamPrefillResponse(instruction=instruction))
            fx.prefill_outboxes.add((record.prefill_engine_id, rank))
        record.dispatched = True
        record.dispatch_wall = self.clock.wall()
        record.state = tpb.TRANSFER_STATE_STREAMING
        self.observer.on_dispatched(record)

    def _dispatch_head_slices(self, record: TransferRecord, prefill: EngineGroup, decode: EngineGroup,
                              allocation: Allocation, fx: Effects) -> None:
        """TP sizes differ: each prefill rank's instruction names every decode rank it writes and which heads.

        A decode rank written by n prefill ranks gets n notifications "<transfer id>\n<i>/<n>" and completes once
        it holds all of them. A prefill rank whose heads other ranks write (fewer KV heads than prefill ranks) is
        told that decode holds every token (skip_token_count = prompt_token_count): it writes nothing and
        reports DONE, so the transfer still completes on every rank's result.
        """
        routes = head_routes(prefill.layout().model_kv_head_count, prefill.tp_size, decode.tp_size)
        writers = Counter(route.decode_rank for route in routes)
        seen: Counter[int] = Counter()
        by_rank: dict[int, list[tuple[HeadRoute, bytes]]] = {}
        for route in routes:
            count = writers[route.decode_rank]
            note = record.transfer_id if count == 1 else f"{record.transfer_id}\n{seen[route.decode_rank]}/{count}"
            seen[route.decode_rank] += 1
            by_rank.setdefault(route.prefill_rank, []).append((route, note.encode()))
        for rank in range(prefill.tp_size):
            mine = by_rank.get(rank, [])
            first_route = mine[0][0] if mine else None
            target = decode.workers[first_route.decode_rank if first_route is not None else 0]
            instruction = dpb.PushInstruction(
                transfer_id=record.transfer_id, decode_engine_id=record.decode_engine_id,
                decode_tp_rank=target.tp_rank, decode_agent_name=target.agent_name,
                decode_agent_metadata=target.agent_metadata, decode_layout=target.layout,
                decode_block_ids=allocation.block_ids, decode_block_groups=allocation.block_group_protos(),
                skip_token_count=allocation.skip_token_count if mine else allocation.prompt_token_count,
                prompt_token_count=allocation.prompt_token_count,
                notification=mine[0][1] if mine else b"", trace_context=record.trace_context,
            )
            if first_route is not None:
                instruction.head_slice.CopyFrom(_head_slice(first_route))
            for route, route_note in mine[1:]:
                other = decode.workers[route.decode_rank]
                instruction.more_destinations.append(dpb.PushDestination(
                    decode_tp_rank=other.tp_rank, decode_agent_name=other.agent_name,
                    decode_agent_metadata=other.agent_metadata, decode_layout=other.layout,
                    head_slice=_head_slice(route), notification=route_note))
            prefill.workers[rank].outbox.append(dpb.StreamPrefillResponse(instruction=instruction))
            fx.prefill_outboxes.add((record.prefill_engine_id, rank))

    def report_result(self, engine_id: str, tp_rank: int, result: dpb.WriteResult) -> Effects:
        """Record one rank's write result (see module docstring for what each status does)."""
        fx = Effects()
        record = self._transfers.get(result.transfer_id)
        if record is None:
            early = self._early.get(result.transfer_id)
            if early is None or early.engine_id != engine_id:
                raise NotFound(f"transfer {result.transfer_id!r} is unknown")
            if result.status not in (dpb.WRITE_RESULT_STATUS_CANCELLED, dpb.WRITE_RESULT_STATUS_FAILED):
                raise FailedPrecondition("this worker has no push instruction for the transfer")
            # The rank stopped before any plan (told to, or its request ended): nothing of it is held any more.
            # A plan that comes now still gets a transfer (the leg that failed tells its caller to cancel it).
            early.events.pop(tp_rank, None)
            if not early.events and not early.stopped:
                del self._early[result.transfer_id]
                self.observer.on_early_readiness("dropped")
            return fx
        if record.prefill_engine_id != engine_id:
            raise PermissionDenied(f"engine {engine_id!r} is not the prefill engine of this transfer")
        status = result.status
        if status == dpb.WRITE_RESULT_STATUS_UNSPECIFIED:
            raise InvalidArgument("status is WRITE_RESULT_STATUS_UNSPECIFIED")
        if record.terminal:
            if status in QUIESCENT_RESULTS:
                return fx  # the worker confirms it stopped: nothing left to do
            raise FailedPrecondition(f"transfer is {tpb.TransferState.Name(record.state)}")
        if not record.dispatched:
            raise FailedPrecondition("this worker has no push instruction for the transfer")
        if tp_rank in record.quiescent:
            if record.quiescent[tp_rank] == status:
                return fx  # duplicate
            raise FailedPrecondition(
                f"rank {tp_rank} already reported {dpb.WriteResultStatus.Name(record.quiescent[tp_rank])}")
        if result.HasField("first_token_id"):
            if status != dpb.WRITE_RESULT_STATUS_DONE:
                raise InvalidArgument("first_token_id is set only with WRITE_RESULT_STATUS_DONE")
            if record.first_token_id is not None and record.first_token_id != result.first_token_id:
                raise InvalidArgument(f"rank {tp_rank} reports first_token_id {result.first_token_id}; another "
                                      f"rank reported {record.first_token_id}")
        record.layers_written[tp_rank] = max(record.layers_written.get(tp_rank, 0), result.layers_written_count)
        record.bytes_written[tp_rank] = max(record.bytes_written.get(tp_rank, 0), result.bytes_written)
        if status == dpb.WRITE_RESULT_STATUS_PROGRESS:
            return fx
        record.quiescent[tp_rank] = status
        if result.HasField("first_token_id"):
            record.first_token_id = result.first_token_id
        if result.HasField("timing"):
            record.timing[tp_rank] = copy_message(result.timing)
        if status == dpb.WRITE_RESULT_STATUS_FAILED:
            self._decide_end(record, tpb.TRANSFER_STATE_FAILED,
                             f"rank {tp_rank} write failed: {result.error_message}".rstrip(": "), fx)
        elif status == dpb.WRITE_RESULT_STATUS_CANCELLED:
            self._decide_end(record, tpb.TRANSFER_STATE_CANCELLED, f"rank {tp_rank} cancelled", fx)
        elif record.ending is not None:
            self._end_when_no_write_can_land(record, fx)
        elif len(record.quiescent) == record.tp_size:
            record.layers_written = {r: max(v, record.layer_count) for r, v in record.layers_written.items()}
            for rank in range(record.tp_size):
                record.layers_written.setdefault(rank, record.layer_count)
            self._end(record, tpb.TRANSFER_STATE_COMPLETE, "", fx, tell_prefill=False)
        return fx

    # ---------------------------------------------------------------- cancellation, ending, reaping

    def cancel(self, transfer_id: str, reason: str) -> tuple[TransferRecord, Effects]:
        """Cancel: at once if nothing was dispatched, else once every dispatched rank is quiescent."""
        record = self._transfer(transfer_id)
        fx = Effects()
        if record.terminal:
            return record, fx
        self._decide_end(record, tpb.TRANSFER_STATE_CANCELLED, reason or "cancelled", fx)
        return record, fx

    def _decide_end(self, record: TransferRecord, state: tpb.TransferState, reason: str, fx: Effects) -> None:
        """Decide a live transfer's end (the first decision wins) and end it once no write can land.

        Prefill is told to stop at once; decode learns the end (and may reuse its blocks) only from
        `_end_when_no_write_can_land`.
        """
        if record.ending is None:
            record.ending = Ending(state, reason,
                                   self.clock.monotonic() + self.limits.lease_ttl_s + self.limits.max_write_s)
            self._tell_prefill(record, state, reason, fx)
        self._end_when_no_write_can_land(record, fx)

    def writing_ranks(self, record: TransferRecord, now: float | None = None) -> list[int]:
        """Prefill ranks whose writes may still land in decode's blocks: dispatched, not quiescent, not fenced."""
        if not record.dispatched:
            return []
        now = self.clock.monotonic() if now is None else now
        return [rank for rank in range(record.tp_size)
                if rank not in record.quiescent and record.rank_fences.get(rank, math.inf) > now]

    def _end_when_no_write_can_land(self, record: TransferRecord, fx: Effects) -> None:
        if record.ending is not None and not record.terminal and not self.writing_ranks(record):
            self._end(record, record.ending.state, record.ending.reason, fx, tell_prefill=False)

    def _tell_prefill(self, record: TransferRecord, state: tpb.TransferState, reason: str, fx: Effects) -> None:
        """Queue a Cancellation for every prefill rank that may still work on the transfer."""
        group = self.engines.groups.get(record.prefill_engine_id)
        if group is None:
            return
        for rank, worker in group.workers.items():
            if rank in record.quiescent or not (record.dispatched or rank in record.ready):
                continue
            worker.outbox.append(dpb.StreamPrefillResponse(
                cancellation=dpb.Cancellation(transfer_id=record.transfer_id, reason=reason)))
            fx.prefill_outboxes.add((record.prefill_engine_id, rank))

    def _end(self, record: TransferRecord, state: tpb.TransferState, reason: str, fx: Effects,
             tell_prefill: bool = True) -> None:
        """Make a live transfer terminal: release blocks, tell decode (watch log) and, if asked, prefill."""
        if tell_prefill:
            self._tell_prefill(record, state, reason, fx)
        record.state = state
        record.failure_reason = reason
        record.end_wall = self.clock.wall()
        record.ending = None
        del self._live[record.transfer_id]
        self._count_client(record, -1)
        for engine_id in (record.prefill_engine_id, record.decode_engine_id):
            group = self.engines.groups.get(engine_id)
            if group is not None:
                group.active_transfers.discard(record.transfer_id)
        index = self._owned_blocks.get(record.decode_engine_id)
        if index is not None:
            for block in record.owned_blocks:
                if index.get(block) == record.transfer_id:
                    del index[block]
            if not index:
                del self._owned_blocks[record.decode_engine_id]
        self._event_sequence += 1
        log = self._watch_logs.setdefault(record.decode_engine_id,
                                          WatchLog(self.limits.retained_watch_events_per_engine))
        event = dpb.TransferEvent(
            sequence_number=self._event_sequence, transfer_id=record.transfer_id, state=state, reason=reason,
            bytes_written=record.total_bytes_written())
        if state == tpb.TRANSFER_STATE_COMPLETE and record.first_token_id is not None:
            event.first_token_id = record.first_token_id  # decode's first sampled token must be it
        log.append(event)
        fx.watch_engines.add(record.decode_engine_id)
        self._terminal_order.append(record.transfer_id)
        while len(self._terminal_order) > self.limits.retained_terminal_transfers:
            self._transfers.pop(self._terminal_order.popleft(), None)
        self.observer.on_ended(record)

    def reap(self, now: float | None = None) -> Effects:
        """End lapsed leases (engine lost) and transfers past their deadline (EXPIRED); scans everything.

        A gap since the previous reap over `reap_stall_threshold_s` is the directory's own stall: every
        lease is extended by it first (see `Limits.reap_stall_threshold_s`), and `Effects.stall_s` says so.
        """
        now = self.clock.monotonic() if now is None else now
        fx = Effects()
        if self._last_reap is not None and now - self._last_reap > self.limits.reap_stall_threshold_s:
            fx.stall_s = now - self._last_reap
            self.engines.extend_all(fx.stall_s)
        self._last_reap = now
        for worker in self.engines.lapsed(now):
            if worker.lease_id in self.engines.leases:
                self._remove_worker(
                    worker, f"engine {worker.engine_id} rank {worker.tp_rank} lease expired", fx)
                fx.expired_lease_roles.append(worker.role)
        for record in [r for r in self._live.values() if r.deadline < now and r.ending is None]:
            self._decide_end(record, tpb.TRANSFER_STATE_EXPIRED, "transfer deadline passed", fx)
        self._reap_early(now, fx)
        for record, ending in [(r, r.ending) for r in self._live.values() if r.ending is not None]:
            if ending.confirm_by < now:
                self._revoke_silent_ranks(record, now, fx)
            self._end_when_no_write_can_land(record, fx)
        retention = self.limits.gone_engine_log_retention_s
        for engine_id in [e for e, log in self._watch_logs.items() if e not in self.engines.groups
                          and (log.gone_since is None or now - log.gone_since > retention)]:
            del self._watch_logs[engine_id]
        return fx

    def _reap_early(self, now: float, fx: Effects) -> None:
        """Stop early readiness whose plan did not come within the hold; forget it a lease TTL later (by then
        its ranks confirmed or lost their lease, and the caller of a late plan has long given up)."""
        hold = self.limits.early_readiness_hold_s
        for transfer_id, early in list(self._early.items()):
            if not early.stopped and now - early.since > hold:
                early.stopped = True
                self._stop_early(transfer_id, early, f"no PlanTransfer named this transfer within {hold}s", fx)
                self.observer.on_early_readiness("expired")
            if early.stopped and now - early.since > hold + self.limits.lease_ttl_s:
                del self._early[transfer_id]

    def early_transfer_count(self) -> int:
        """Unplanned transfers whose early readiness is held (or was stopped and is still remembered)."""
        return len(self._early)

    def _revoke_silent_ranks(self, record: TransferRecord, now: float, fx: Effects) -> None:
        """Prefill ranks that did not confirm a decided end in time lose their lease (then their fence applies)."""
        group = self.engines.groups.get(record.prefill_engine_id)
        for rank in self.writing_ranks(record, now):
            worker = group.workers.get(rank) if group is not None else None
            if worker is not None and rank not in record.rank_fences:
                self._remove_worker(
                    worker, f"engine {worker.engine_id} rank {rank} did not confirm the end of transfer "
                    f"{record.transfer_id} within {self.limits.lease_ttl_s + self.limits.max_write_s}s; lease revoked",
                    fx)
                fx.expired_lease_roles.append(worker.role)
                if self.on_lease_revoked is not None:  # replicas: revoke it in etcd too (every replica drops it)
                    self.on_lease_revoked(worker)

    # ---------------------------------------------------------------- replica hooks (src/kvpush/directory/replica.py)

    def mirror_register(self, request: dpb.RegisterEngineRequest, lease_key: str) -> Effects:
        """Take in a registration stored in etcd (any replica's); etcd's lease, not the reaper, ends it.

        Idempotent for the same lease key; another agent on the rank replaces the old worker (its transfers fail).
        """
        fx = Effects()
        group = self.engines.groups.get(request.engine_id)
        existing = group.workers.get(request.tp_rank) if group is not None else None
        if existing is not None and existing.lease_id == lease_key:
            return fx
        now = self.clock.monotonic()
        if existing is not None and existing.agent_name == request.agent_name:
            self.engines.refresh(existing, request, now)
            worker = existing
        else:
            if existing is not None:
                self._remove_worker(existing, f"engine {request.engine_id} rank {request.tp_rank} re-registered", fx)
            holder = self.engines.agents.get(request.agent_name)
            if holder is not None:
                self._remove_worker(holder, f"agent {request.agent_name} re-registered elsewhere", fx)
            worker = self.engines.add(request, now)
            self._relink_live(worker.engine_id)
            if request.role == DECODE:
                self._announce_decode(worker, fx)
        self.engines.leases.pop(worker.lease_id, None)
        worker.lease_id = lease_key
        self.engines.leases[lease_key] = worker
        worker.lease_deadline = math.inf  # etcd's lease ends it (`mirror_remove`), not the reaper
        worker.renewed_at = math.inf  # any replica may take its renewals: never late here
        worker.lease_deadline_wall = self.clock.wall() + self.limits.lease_ttl_s  # for display: etcd knows
        if request.role == DECODE:
            self._watch_logs.setdefault(
                request.engine_id, WatchLog(self.limits.retained_watch_events_per_engine)).gone_since = None
        return fx

    def mirror_remove(self, engine_id: str, tp_rank: int, reason: str) -> Effects:
        """A registration left etcd (its lease lapsed or was revoked): as a lapsed lease here."""
        fx = Effects()
        group = self.engines.groups.get(engine_id)
        worker = group.workers.get(tp_rank) if group is not None else None
        if worker is not None:
            worker.lease_deadline = self.clock.monotonic()  # etcd ended it now: a write fence counts from here
            self._remove_worker(worker, reason, fx)
        return fx

    def adopt(self, stored: StoredTransfer, in_flight_bound_s: float, reason: str) -> Effects:
        """Take over a transfer from etcd after its shard moved here from a replica that is gone.

        Without decode's blocks nothing can have been written: it goes on as if planned here. With them an
        instruction may have gone out and prefill may be writing: prefill is told to stop and the transfer
        FAILS once every rank is quiet, its prefill engine is gone, or `in_flight_bound_s` passed (EXPIRED);
        only then are the blocks released.
        """
        fx = Effects()
        if stored.transfer_id in self._transfers:
            return fx
        now, wall = self.clock.monotonic(), self.clock.wall()
        record = TransferRecord(
            transfer_id=stored.transfer_id, sequence=next(self._transfer_sequence), request_id=stored.request_id,
            prefill_engine_id=stored.prefill_engine_id, decode_engine_id=stored.decode_engine_id,
            tp_size=stored.tp_size, layer_count=stored.layer_count, trace_context=stored.trace_context,
            create_wall=stored.create_wall, deadline=now + (stored.deadline_wall - wall),
            deadline_wall=stored.deadline_wall, plan_prompt_token_count=stored.plan_prompt_token_count)
        self._transfers[record.transfer_id] = record
        self._live[record.transfer_id] = record
        for engine_id in (record.prefill_engine_id, record.decode_engine_id):
            group = self.engines.groups.get(engine_id)
            if group is not None:
                group.active_transfers.add(record.transfer_id)
        if stored.allocation is not None:
            record.allocation = stored.allocation
            record.owned_blocks = stored.owned_blocks
            index = self._owned_blocks.setdefault(record.decode_engine_id, {})
            for block in record.owned_blocks:
                index.setdefault(block, record.transfer_id)
            record.allocate_wall = wall
            record.state = tpb.TRANSFER_STATE_STREAMING
            record.dispatched = True  # perhaps: the previous owner may have sent the instruction
            record.deadline = min(record.deadline, now + in_flight_bound_s)
            if record.prefill_engine_id not in self.engines.groups:
                # Its lease is gone already (etcd ended it): its writes cannot land after max_write_s from now.
                for rank in range(record.tp_size):
                    record.rank_fences[rank] = now + self.limits.max_write_s
            self._decide_end(record, tpb.TRANSFER_STATE_FAILED, reason, fx)
        elif record.prefill_engine_id not in self.engines.groups or record.decode_engine_id not in self.engines.groups:
            self._decide_end(record, tpb.TRANSFER_STATE_FAILED, f"{reason}; an engine of the transfer is gone", fx)
        return fx

    def forget(self, transfer_ids: Iterable[str]) -> int:
        """Drop live transfers without telling anyone: their shard is no longer this replica's (a successor
        adopts them from etcd and ends them towards both sides). Returns how many were dropped."""
        dropped = 0
        for transfer_id in list(transfer_ids):
            record = self._live.pop(transfer_id, None)
            if record is None:
                continue
            self._transfers.pop(transfer_id, None)
            self._count_client(record, -1)
            for engine_id in (record.prefill_engine_id, record.decode_engine_id):
                group = self.engines.groups.get(engine_id)
                if group is not None:
                    group.active_transfers.discard(transfer_id)
                    for worker in group.workers.values():
                        worker.outbox = deque(m for m in worker.outbox if _transfer_of(m) != transfer_id)
            index = self._owned_blocks.get(record.decode_engine_id)
            if index is not None:
                for block in record.owned_blocks:
                    if index.get(block) == transfer_id:
                        del index[block]
                if not index:
                    del self._owned_blocks[record.decode_engine_id]
            dropped += 1
        return dropped

    # ---------------------------------------------------------------- reading

    def get_transfer(self, transfer_id: str) -> TransferRecord:
        """One retained transfer; NotFound otherwise."""
        return self._transfer(transfer_id)

    def list_transfers(self, page_size: int, page_token: str, state: int,
                       engine_id: str) -> tuple[list[TransferRecord], str]:
        """One page of retained transfers, newest first; returns the next page token ("" at the end)."""
        before = None
        if page_token:
            if not _SEQUENCE_TOKEN.fullmatch(page_token):
                raise InvalidArgument("page_token is not a token this server issued")
            before = int(page_token)
        page: list[TransferRecord] = []
        more = False
        for record in reversed(self._transfers.values()):
            if before is not None and record.sequence >= before:
                continue
            if state != tpb.TRANSFER_STATE_UNSPECIFIED and record.state != state:
                continue
            if engine_id and engine_id not in (record.prefill_engine_id, record.decode_engine_id):
                continue
            if len(page) == page_size:
                more = True
                break
            page.append(record)
        return page, (str(page[-1].sequence) if more else "")

    def watch_events(self, engine_id: str, after_sequence_number: int) -> list[dpb.TransferEvent]:
        """Retained events of a decode engine after a sequence number.

        OutOfRange when events after it were dropped, or when it is ahead of this process
        (a watch carried over from a previous directory process).
        """
        log = self._watch_logs.get(engine_id)
        if log is None:
            raise NotFound(f"engine {engine_id!r} is not a registered decode engine")
        if after_sequence_number > self._event_sequence:
            raise OutOfRange(
                f"after_sequence_number {after_sequence_number} is ahead of this directory "
                f"({self._event_sequence}); it restarted: re-read transfers")
        if after_sequence_number and after_sequence_number < log.dropped_through:
            raise OutOfRange(
                f"events after {after_sequence_number} are no longer retained (oldest dropped: "
                f"{log.dropped_through}); re-read transfers")
        return log.after(after_sequence_number)

    @property
    def last_event_sequence(self) -> int:
        """The sequence number of the newest watch event (0 before any)."""
        return self._event_sequence

    def is_decode_engine(self, engine_id: str) -> bool:
        """True when a decode engine of this id is registered."""
        group = self.engines.groups.get(engine_id)
        return group is not None and group.role == DECODE

    def drain_outbox(self, engine_id: str, tp_rank: int, session_id: int) -> list[dpb.StreamPrefillResponse]:
        """Take every queued message for a prefill worker's current session."""
        worker = self.session_worker(engine_id, tp_rank, session_id)
        if worker is None or not worker.outbox:
            return []
        messages = list(worker.outbox)
        worker.outbox.clear()
        return messages

    def live_transfers(self) -> Iterable[TransferRecord]:
        """Every non-terminal transfer."""
        return self._live.values()

    def check_invariants(self) -> list[str]:
        """Violations of the state machine's invariants (empty when sound); used by tests."""
        problems: list[str] = []
        owners: dict[tuple[str, int], str] = {}
        for record in self._transfers.values():
            if record.terminal == (record.transfer_id in self._live):
                problems.append(f"{record.transfer_id}: live index disagrees with state")
            if record.state == tpb.TRANSFER_STATE_COMPLETE and record.failure_reason:
                problems.append(f"{record.transfer_id}: complete with a failure reason")
            if record.terminal and record.end_wall is None:
                problems.append(f"{record.transfer_id}: terminal without end time")
            if any(v < 0 for v in (*record.bytes_written.values(), *record.layers_written.values())):
                problems.append(f"{record.transfer_id}: negative counter")
            if not record.terminal:
                for block in record.owned_blocks:
                    key = (record.decode_engine_id, block)
                    if key in owners:
                        problems.append(f"block {key} owned by {owners[key]} and {record.transfer_id}")
                    owners[key] = record.transfer_id
        indexed = {(e, b): t for e, idx in self._owned_blocks.items() for b, t in idx.items()}
        if indexed != owners:
            problems.append("block index disagrees with live allocations")
        for group in self.engines.groups.values():
            for transfer_id in group.active_transfers:
                if transfer_id not in self._live:
                    problems.append(f"engine {group.engine_id} lists ended transfer {transfer_id}")
        for record in self._live.values():
            for engine_id in (record.prefill_engine_id, record.decode_engine_id):
                listed = self.engines.groups.get(engine_id)
                if listed is not None and record.transfer_id not in listed.active_transfers:
                    problems.append(f"engine {engine_id} does not list its live transfer {record.transfer_id}")
        clients: Counter[tuple[str, str]] = Counter()
        for record in self._live.values():
            if record.client_id:
                clients.update(((record.client_id, record.prefill_engine_id),
                                (record.client_id, record.decode_engine_id)))
        if clients != self._client_transfers:
            problems.append("per-client transfer counts disagree with live transfers")
        for transfer_id, early in self._early.items():
            if transfer_id in self._transfers:
                problems.append(f"{transfer_id}: planned and still holding early readiness")
            if early.engine_id not in self.engines.groups:
                problems.append(f"{transfer_id}: early readiness of an unregistered engine {early.engine_id}")
        return problems


def _has_state_group(layout: tpb.KVLayout) -> bool:
    return any(group.kind == tpb.KV_CACHE_GROUP_KIND_STATE for group in layout.kv_cache_groups)


def _owned_group_blocks(allocation: Allocation, layout: tpb.KVLayout, needed: int) -> tuple[int, ...]:
    """The blocks a several-group allocation lets prefill write: each group's from its first written token
    (decode's prefix hit, or the group's first token if later) to the prompt's end; a state group's one block
    holding the state after the prompt (none when decode's hit is the whole prompt). Raise InvalidArgument when the
    groups do not match decode's layout or a block would be written twice (groups share one block pool)."""
    declared = len(layout.kv_cache_groups)
    if len(allocation.groups) != declared:
        raise InvalidArgument(f"block_groups has {len(allocation.groups)} groups; the decode engine's layout "
                              f"declares {declared} KV-cache groups")
    if allocation.block_ids != allocation.groups[0][0]:
        raise InvalidArgument("block_ids must repeat block_groups[0]'s list")
    block_size = layout.block_size_tokens
    owned: list[int] = []
    for index, (ids, first_token) in enumerate(allocation.groups):
        group = layout.kv_cache_groups[index]
        if group.kind == tpb.KV_CACHE_GROUP_KIND_STATE:
            owned.extend(_owned_state_block(allocation, layout, index, ids, first_token))
            continue
        if not 0 <= first_token <= allocation.prompt_token_count or first_token % block_size:
            raise InvalidArgument(f"block_groups[{index}].first_token {first_token} is not a multiple of "
                                  f"{block_size} in [0, {allocation.prompt_token_count}]")
        if len(ids) < needed:
            raise InvalidArgument(f"block_groups[{index}] has {len(ids)} block ids; "
                                  f"{allocation.prompt_token_count} tokens need {needed}")
        bad = next((b for b in ids if not 0 <= b < layout.block_count), None)
        if bad is not None:
            raise InvalidArgument(f"block_groups[{index}] block id {bad} is out of range [0, {layout.block_count})")
        owned.extend(ids[max(allocation.skip_token_count, first_token) // block_size:needed])
    if len(set(owned)) != len(owned):
        raise InvalidArgument("block_groups repeat a block that would be written twice")
    return tuple(owned)


def _owned_state_block(allocation: Allocation, layout: tpb.KVLayout, index: int, ids: tuple[int, ...],
                       first_token: int) -> tuple[int, ...]:
    """A state group's block that prefill writes: the one holding the state after the prompt's last token."""
    group_block_size = layout.kv_cache_groups[index].block_size_tokens or layout.block_size_tokens
    state_index = (allocation.prompt_token_count - 1) // group_block_size
    if first_token:
        raise InvalidArgument(f"block_groups[{index}].first_token is {first_token}; a state group starts at 0")
    if len(ids) <= state_index:
        raise InvalidArgument(f"block_groups[{index}] has {len(ids)} state block ids; the state after "
                              f"{allocation.prompt_token_count} tokens is in block {state_index} "
                              f"({group_block_size} tokens per block)")
    block = ids[state_index]
    if not 0 <= block < layout.block_count:
        raise InvalidArgument(f"block_groups[{index}] block id {block} is out of range [0, {layout.block_count})")
    return () if allocation.skip_token_count >= allocation.prompt_token_count else (block,)
