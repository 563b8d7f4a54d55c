"""Records and value types of the KV-directory's state: time sources, limits, effects, workers,
engines, transfers and watch logs. Plain data with small helpers; `state.DirectoryState` owns them.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

from google.protobuf import message as protobuf_message
from google.protobuf import timestamp_pb2

from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb

_Message = TypeVar("_Message", bound=protobuf_message.Message)

INT64_MAX = 2**63 - 1
PREFILL = tpb.ENGINE_ROLE_PREFILL
DECODE = tpb.ENGINE_ROLE_DECODE
TERMINAL_STATES = frozenset(
    {
        tpb.TRANSFER_STATE_COMPLETE,
        tpb.TRANSFER_STATE_FAILED,
        tpb.TRANSFER_STATE_CANCELLED,
        tpb.TRANSFER_STATE_EXPIRED,
    }
)
# Write results after which a prefill rank has no write in flight for a transfer.
QUIESCENT_RESULTS = frozenset(
    {dpb.WRITE_RESULT_STATUS_DONE, dpb.WRITE_RESULT_STATUS_FAILED, dpb.WRITE_RESULT_STATUS_CANCELLED}
)


@dataclass(frozen=True)
class Clock:
    """Time sources, injected so tests drive leases and deadlines without sleeping.

    monotonic: seconds for leases and deadlines; wall: seconds since the epoch for timestamps.
    """

    monotonic: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time


@dataclass(frozen=True)
class Limits:
    """Configurable caps and durations; every one bounds memory or time."""

    lease_ttl_s: float = 10.0
    # The longest one posted WRITE may take on any prefill worker (its data plane aborts it past this,
    # connector key `max_write_s`): a rank that lost its lease writes nothing after lease end + max_write_s.
    max_write_s: float = 10.0
    transfer_ttl_s: float = 60.0
    max_transfer_ttl_s: float = 3600.0
    max_active_transfers_per_engine: int = 4096
    max_live_transfers: int = 100_000
    max_workers: int = 4096
    max_block_ids: int = 65_536
    max_events_per_batch: int = 4096
    max_page_size: int = 1000
    max_chunks_per_transfer: int = 4096
    retained_terminal_transfers: int = 10_000
    retained_watch_events_per_engine: int = 10_000
    # How long the watch log of a decode engine with no registered worker is kept (for a re-registration).
    gone_engine_log_retention_s: float = 300.0
    # A gap between two reaps longer than this means the directory itself stalled (GC, a starved
    # or frozen process): renewals could not be taken meanwhile, so leases are extended by the gap
    # instead of all lapsing at once. Transfer deadlines are not extended.
    reap_stall_threshold_s: float = 2.0
    max_id_length: int = 128
    # Rejections queued for one StreamPrefill session, and for all sessions together: past either, the
    # session ends RESOURCE_EXHAUSTED (a client flooding bad events cannot grow the directory's memory).
    max_pending_rejections_per_session: int = 1024
    max_pending_rejections: int = 16_384
    # A RenewLease stream with no renewal for this long is ended (DEADLINE_EXCEEDED); clients renew every ttl/3.
    renew_stream_idle_s: float = 30.0
    # Open RenewLease, WatchTransfers and StreamPrefill calls together; past it a new one is RESOURCE_EXHAUSTED.
    max_open_streams: int = 20_000
    # Early readiness (LayerReady.plan_in_flight for a transfer not planned yet): how long it is held for its
    # PlanTransfer, and how many unplanned transfers one prefill engine may hold readiness for. The gateway sends
    # the plan with the prefill leg, so the plan normally comes first or within milliseconds.
    early_readiness_hold_s: float = 2.0
    max_early_transfers_per_engine: int = 256
    # The most one client (PlanTransferRequest.client_id) may hold of any engine's transfer cap, as a fraction of
    # max_active_transfers_per_engine (at least one transfer); 1.0: no per-client bound.
    max_client_share: float = 1.0
    # Planning skips an engine with a worker whose last lease renewal is older than lease_ttl_s times this
    # (clients renew every TTL/3: 0.5 is one and a half renewal intervals, well before the lease lapses).
    late_renewal_fraction: float = 0.5
    # Open streams one caller (an engine, the operator; without identities a peer host) may hold, counted apart
    # for renewals and for other streams (src/kvpush/directory/admission.py).
    max_streams_per_identity: int = 256
    # The share of max_open_streams only RenewLease may use: a renewal is never refused because watches or
    # sessions filled the slots.
    renewal_reserved_share: float = 0.25
    # Unary calls of one caller read or handled at once; more wait unread (at most max_queued_calls_per_caller,
    # then RESOURCE_EXHAUSTED). With requests of at most max_message_bytes, this bounds what a caller has buffered.
    max_calls_in_flight_per_caller: int = 8
    max_queued_calls_per_caller: int = 1024
    # Request bytes of one caller's calls being handled at once; a request past it is RESOURCE_EXHAUSTED.
    max_bytes_in_flight_per_caller: int = 64 * 1024 * 1024
    # Pair prefill and decode engines of different block sizes (when both layouts are token-addressable:
    # `planning._block_size_mapping`). On by default: every GPU e2e check passes so paired, 32 concurrent requests
    # included; off refuses such pairs (a mapped push writes granules of gcd(sizes) tokens, so it costs more).
    pair_block_sizes: bool = True

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, bool):  # a switch, not a bound
                continue
            if value <= 0:
                raise ValueError(f"limit {name} must be positive, got {value}")
        if self.transfer_ttl_s > self.max_transfer_ttl_s:
            raise ValueError("transfer_ttl_s must not exceed max_transfer_ttl_s")
        if self.max_client_share > 1:
            raise ValueError(f"max_client_share is a fraction in (0, 1], got {self.max_client_share}")
        if self.renewal_reserved_share >= 1:
            raise ValueError(f"renewal_reserved_share is a fraction in (0, 1), got {self.renewal_reserved_share}")

    def client_transfer_cap(self) -> int:
        """Live transfers one client may hold on one engine (max_client_share of the engine cap, at least 1)."""
        return max(1, math.floor(self.max_client_share * self.max_active_transfers_per_engine))


@dataclass
class Effects:
    """What a state call produced for the servicer to deliver.

    prefill_outboxes: (engine_id, tp_rank) whose outbox received messages.
    watch_engines: decode engine ids whose watch log received events.
    stall_s: from `reap()` only, how long the directory stalled (0: it did not); leases were extended by it.
    expired_lease_roles: from `reap()` only, the role of each worker whose lease lapsed (for metrics).
    """

    prefill_outboxes: set[tuple[str, int]] = field(default_factory=set)
    watch_engines: set[str] = field(default_factory=set)
    stall_s: float = 0.0
    expired_lease_roles: list[tpb.EngineRole] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.prefill_outboxes or self.watch_engines)


@dataclass
class EarlyReadiness:
    """Readiness a prefill engine reported for a transfer before its plan (LayerReady.plan_in_flight).

    Held by `DirectoryState` until PlanTransfer names the id (then applied as if it came after the plan) or
    until `Limits.early_readiness_hold_s` passes (then the engine is told to stop: `stopped`, kept as long again
    so that its confirmation and a late plan get a precise answer).
    """

    engine_id: str
    since: float  # monotonic, first event
    layer_count: int
    prompt_token_count: int
    # tp_rank -> (event, wall time it arrived), in arrival order.
    events: dict[int, list[tuple[dpb.LayerReady, float]]] = field(default_factory=dict)
    stopped: bool = False

    def event_count(self) -> int:
        """Events held over every rank."""
        return sum(len(held) for held in self.events.values())


class TransferObserver:
    """Hooks called on a transfer's milestones (telemetry implements them); default no-ops."""

    def on_early_readiness(self, outcome: str) -> None:
        """Called once per unplanned transfer whose early readiness was held, when it is let go: "planned" (its
        plan came), "expired" (no plan within the hold), "dropped" (its session or engine ended first, or the
        plan named another engine)."""

    def on_engine_skipped(self, reason: str) -> None:
        """Called for each candidate engine a plan left out: "late_renewal" (its lease renewal is late: frozen or
        starved) or "client_share" (the plan's client holds its share of the engine's cap)."""

    def on_planned(self, transfer: TransferRecord) -> None:
        """Called once when the transfer is minted."""

    def on_allocated(self, transfer: TransferRecord) -> None:
        """Called once when decode's allocation is accepted."""

    def on_first_ready(self, transfer: TransferRecord) -> None:
        """Called once on the first accepted readiness event."""

    def on_dispatched(self, transfer: TransferRecord) -> None:
        """Called once when the push instructions go out."""

    def on_ended(self, transfer: TransferRecord) -> None:
        """Called once when the transfer reaches a terminal state."""


@dataclass
class Worker:
    """One registered worker (TP rank) of an engine, with its lease."""

    engine_id: str
    tp_rank: int
    role: tpb.EngineRole
    tp_size: int
    agent_name: str
    agent_metadata: bytes
    layout: tpb.KVLayout
    endpoint: str
    lease_id: str
    lease_deadline: float
    register_wall: float
    lease_deadline_wall: float
    load: tpb.EngineLoad | None = None
    model: str = ""
    # As registered: a decode worker whose first sampled token follows kv_transfer_params.first_token_id.
    forces_first_token: bool = False
    # Messages for this prefill worker's StreamPrefill session, delivered in order.
    outbox: deque[dpb.StreamPrefillResponse] = field(default_factory=deque)
    # The current StreamPrefill session (0: none); a stale session's end changes nothing.
    session_id: int = 0
    # Monotonic time of the last registration or renewal (planning skips an engine whose renewal is late);
    # inf for a registration mirrored from etcd, whose renewals any replica may take (never late here).
    renewed_at: float = 0.0


@dataclass
class EngineGroup:
    """All registered ranks of one engine id, and the transfers it takes part in."""

    engine_id: str
    role: tpb.EngineRole
    tp_size: int
    workers: dict[int, Worker] = field(default_factory=dict)
    active_transfers: set[str] = field(default_factory=set)
    # A gateway's report that the engine's endpoint could not be reached; planning leaves the engine out
    # while it stands, and the engine's next lease renewal clears it (None: no report stands).
    unreachable: UnreachableReport | None = None

    @property
    def complete(self) -> bool:
        """True when every rank in [0, tp_size) is registered."""
        return len(self.workers) == self.tp_size

    def layout(self) -> tpb.KVLayout:
        """The layout of the lowest registered rank (ranks of one engine share the shape)."""
        return self.workers[min(self.workers)].layout

    @property
    def model(self) -> str:
        """The model the engine serves, as its lowest rank registered it."""
        return self.workers[min(self.workers)].model

    def last_renewal(self) -> float:
        """Monotonic time of the stalest worker's last registration or renewal."""
        return min(w.renewed_at for w in self.workers.values())

    def queued_requests(self) -> int:
        """Running plus waiting requests from the last reported load (the busiest rank; 0 before one)."""
        return max((w.load.running_request_count + w.load.waiting_request_count for w in self.workers.values()
                    if w.load is not None), default=0)

    def free_blocks(self) -> int:
        """Free blocks from the last reported load, else the layout's block count."""
        worker = self.workers[min(self.workers)]
        if worker.load is not None:
            return min(w.load.free_block_count if w.load is not None else w.layout.block_count
                       for w in self.workers.values())
        return worker.layout.block_count


@dataclass(frozen=True)
class Allocation:
    """Decode's reported blocks for a transfer."""

    block_ids: tuple[int, ...]
    prompt_token_count: int
    skip_token_count: int  # leading tokens decode already holds (ReportAllocationRequest.prefix_hit_token_count)
    # Several KV-cache groups: each group's (block ids, first token), by group index; () for one group.
    groups: tuple[tuple[tuple[int, ...], int], ...] = ()

    def block_group_protos(self) -> list[tpb.BlockGroup]:
        """The groups as BlockGroup messages (empty for one group)."""
        return [tpb.BlockGroup(group_index=index, block_ids=ids, first_token=first)
                for index, (ids, first) in enumerate(self.groups)]




class UnreachableReport(NamedTuple):
    """A standing report that an engine could not be reached (ReportEngineUnreachable)."""

    wall: float  # when it was reported, seconds since the epoch
    reason: str


class Ending(NamedTuple):
    """A transfer's decided end, held until no write of it can still be in flight.

    confirm_by: monotonic time by which every dispatched prefill rank must confirm it stopped; a live
    rank that has not is presumed stuck and its lease is revoked (then its fence applies).
    """

    state: tpb.TransferState  # FAILED, CANCELLED or EXPIRED
    reason: str
    confirm_by: float = math.inf

@dataclass
class TransferRecord:
    """The directory's live record of one transfer; `to_proto()` gives its wire form."""

    transfer_id: str
    sequence: int
    request_id: str
    prefill_engine_id: str
    decode_engine_id: str
    tp_size: int
    layer_count: int
    trace_context: str
    create_wall: float
    deadline: float
    deadline_wall: float
    state: tpb.TransferState = tpb.TRANSFER_STATE_PLANNED
    plan_prompt_token_count: int = 0
    # Prompt length as prefill reports it (every readiness event must agree).
    ready_prompt_token_count: int = 0
    allocation: Allocation | None = None
    owned_blocks: tuple[int, ...] = ()
    allocate_wall: float | None = None
    first_ready_wall: float | None = None
    dispatch_wall: float | None = None
    end_wall: float | None = None
    failure_reason: str = ""
    # rank -> {(token_start, token_end): bitmask of ready layers}
    ready: dict[int, dict[tuple[int, int], int]] = field(default_factory=dict)
    chunk_count: int = 0
    dispatched: bool = False
    # rank -> last quiescent WriteResultStatus (DONE/FAILED/CANCELLED)
    quiescent: dict[int, int] = field(default_factory=dict)
    layers_written: dict[int, int] = field(default_factory=dict)
    bytes_written: dict[int, int] = field(default_factory=dict)
    timing: dict[int, tpb.TransferTiming] = field(default_factory=dict)
    # The terminal state this transfer takes once every dispatched rank is quiescent or fenced.
    ending: Ending | None = None
    # rank -> monotonic time after which that rank (lease gone) can no longer write into decode's blocks.
    rank_fences: dict[int, float] = field(default_factory=dict)
    # layer -> when prefill first reported it ready (any rank).
    layer_ready_walls: dict[int, float] = field(default_factory=dict)
    # The token prefill sampled after the prompt, from its DONE results (first token from prefill); None if unsent.
    first_token_id: int | None = None
    # True while decode's blocks are known but not yet stored where a successor replica finds them.
    dispatch_held: bool = False
    # The client the transfer serves (PlanTransferRequest.client_id; "": none), for the per-client share.
    client_id: str = ""

    @property
    def terminal(self) -> bool:
        """True once the state is COMPLETE, FAILED, CANCELLED or EXPIRED."""
        return self.state in TERMINAL_STATES

    def total_bytes_written(self) -> int:
        """Bytes written summed over prefill ranks, saturating at the wire's int64 maximum."""
        return min(sum(self.bytes_written.values()), INT64_MAX)

    def to_proto(self) -> tpb.Transfer:
        """The wire form of this record."""
        msg = tpb.Transfer(
            transfer_id=self.transfer_id,
            request_id=self.request_id,
            state=self.state,
            prefill_engine_id=self.prefill_engine_id,
            decode_engine_id=self.decode_engine_id,
            layers_written_count=min(self.layers_written.values()) if len(self.layers_written) == self.tp_size else 0,
            bytes_written=self.total_bytes_written(),
            failure_reason=self.failure_reason,
            trace_context=self.trace_context,
        )
        if self.first_token_id is not None:
            msg.first_token_id = self.first_token_id
        if self.allocation is not None:
            msg.prompt_token_count = self.allocation.prompt_token_count
            msg.prefix_hit_token_count = self.allocation.skip_token_count
            msg.decode_block_ids.extend(self.allocation.block_ids)
            msg.decode_block_groups.extend(self.allocation.block_group_protos())
        else:
            msg.prompt_token_count = self.ready_prompt_token_count or self.plan_prompt_token_count
        set_timestamp(msg.create_time, self.create_wall)
        set_timestamp(msg.allocate_time, self.allocate_wall)
        set_timestamp(msg.first_ready_time, self.first_ready_wall)
        set_timestamp(msg.dispatch_time, self.dispatch_wall)
        set_timestamp(msg.end_time, self.end_wall)
        set_timestamp(msg.deadline, self.deadline_wall)
        for tp_rank in sorted(self.timing):
            msg.rank_timings.add(tp_rank=tp_rank).timing.CopyFrom(self.timing[tp_rank])
        written: dict[int, int] = {}  # layer -> latest write end over ranks (ns)
        for timing in self.timing.values():
            for write in timing.layer_writes:
                written[write.layer] = max(written.get(write.layer, 0), write.end_time.ToNanoseconds())
        for layer in sorted(set(self.layer_ready_walls) | set(written)):
            entry = msg.layer_timings.add(layer=layer)
            set_timestamp(entry.ready_time, self.layer_ready_walls.get(layer))
            if layer in written:
                entry.written_time.FromNanoseconds(written[layer])
        return msg


def set_timestamp(target: timestamp_pb2.Timestamp, seconds: float | None) -> None:
    """Set a protobuf Timestamp from epoch seconds (left unset for None)."""
    if seconds is not None:
        target.FromNanoseconds(int(seconds * 1e9))


class WatchLog:
    """A decode engine's retained terminal events, oldest first, bounded."""

    def __init__(self, capacity: int) -> None:
        self.events: deque[dpb.TransferEvent] = deque()
        self.capacity = capacity
        # Highest sequence number dropped from this log; a resume at or below it has a gap.
        self.dropped_through = 0
        # Monotonic time since when no worker of the engine is registered (None while one is).
        self.gone_since: float | None = None

    def append(self, event: dpb.TransferEvent) -> None:
        """Append one event, dropping the oldest past capacity."""
        self.events.append(event)
        if len(self.events) > self.capacity:
            self.dropped_through = self.events.popleft().sequence_number

    def after(self, sequence_number: int) -> list[dpb.TransferEvent]:
        """Events with a greater sequence number, in order."""
        if not self.events or self.events[-1].sequence_number <= sequence_number:
            return []
        if sequence_number < self.events[0].sequence_number:
            return list(self.events)
        newer = []  # walk back from the newest: a live watcher usually needs only the last few
        for event in reversed(self.events):
            if event.sequence_number <= sequence_number:
                break
            newer.append(event)
        newer.reverse()
        return newer


def layer_mask(start: int, end: int) -> int:
    """Bit mask of layers [start, end)."""
    return ((1 << (end - start)) - 1) << start


def copy_message(message: _Message) -> _Message:
    """A deep copy of a protobuf message (the state never keeps the caller's objects)."""
    clone: _Message = type(message)()
    clone.CopyFrom(message)
    return clone


@dataclass(frozen=True)
class StoredTransfer:
    """What etcd keeps of a live transfer so a replica taking its shard over can end it safely:
    its parties, its deadline and decode's blocks. Per-layer progress is never stored (it stays in the
    owner's memory). JSON on the wire, readable with `etcdctl get --prefix /kvpush/transfers/`."""

    transfer_id: str
    request_id: str
    prefill_engine_id: str
    decode_engine_id: str
    tp_size: int
    layer_count: int
    trace_context: str
    create_wall: float
    deadline_wall: float
    plan_prompt_token_count: int
    allocation: Allocation | None = None
    owned_blocks: tuple[int, ...] = ()

    @classmethod
    def of(cls, record: TransferRecord) -> StoredTransfer:
        """The stored form of a live record (its allocation only once dispatch may depend on it)."""
        return cls(record.transfer_id, record.request_id, record.prefill_engine_id, record.decode_engine_id,
                   record.tp_size, record.layer_count, record.trace_context, record.create_wall,
                   record.deadline_wall, record.plan_prompt_token_count, record.allocation, record.owned_blocks)

    def to_json(self) -> bytes:
        """The etcd value."""
        body = {k: getattr(self, k) for k in ("transfer_id", "request_id", "prefill_engine_id", "decode_engine_id",
                                              "tp_size", "layer_count", "trace_context", "create_wall",
                                              "deadline_wall", "plan_prompt_token_count")}
        if self.allocation is not None:
            body["allocation"] = {"block_ids": list(self.allocation.block_ids),
                                  "prompt_token_count": self.allocation.prompt_token_count,
                                  "prefix_hit_token_count": self.allocation.skip_token_count,
                                  "owned_blocks": list(self.owned_blocks),
                                  "groups": [[list(ids), first] for ids, first in self.allocation.groups]}
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, value: bytes) -> StoredTransfer:
        """Parse an etcd value (ValueError when it is not one)."""
        body = json.loads(value)
        allocation = body.pop("allocation", None)
        if allocation is None:
            return cls(**body)
        groups = tuple((tuple(ids), int(first)) for ids, first in allocation.get("groups", ()))
        return cls(**body, allocation=Allocation(tuple(allocation["block_ids"]), allocation["prompt_token_count"],
                                                 allocation["prefix_hit_token_count"], groups),
                   owned_blocks=tuple(allocation["owned_blocks"]))
