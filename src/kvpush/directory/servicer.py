"""grpc.aio servicer of KVDirectoryService: validate, call `state`, map errors, deliver effects.

Every handler follows the same path: `validation` (structure, caps) -> one `DirectoryState`
call -> `STATUS_BY_ERROR` maps a domain error to a status code (the request changed nothing)
-> `deliver(effects)` wakes the prefill sessions and watchers that have something new.

Streams:
- StreamPrefill: a hello binds the stream to a prefill worker (a new hello for the same worker
  replaces the old session). A reader task applies readiness batches and write results; the
  handler's own coroutine is the only writer: it drains the worker's outbox (instructions,
  cancellations) and this session's rejections. Decode agent metadata and layout are sent only
  the first time the session sees an agent. When the stream ends, the worker's transfers fail.
- WatchTransfers: replays retained events after a sequence number, then follows the log.
- RenewLease: one response per renewal; an unknown lease ends the stream with NOT_FOUND, no renewal
  for `renew_stream_idle_s` with DEADLINE_EXCEEDED.

Authorisation: each handler resolves the caller's principal (`auth.Authenticator`) and checks it
acts for the engine it names, or is a party of the transfer, or is the operator (auth.py). Every
response carries a `ResponseHeader` (incarnation, replica) and the deprecated `directory_incarnation_id`.
Bounds: a session's queued rejections are capped per session and globally (RESOURCE_EXHAUSTED ends the
session); refusals are logged rate-limited and counted.

Shutdown: `begin_shutdown()` wakes every stream; each flushes what is queued and ends with
UNAVAILABLE ("directory shutting down") without failing transfers, so clients reconnect elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
from google.protobuf import duration_pb2
from google.rpc import status_pb2
from structlog.contextvars import bound_contextvars

from kvpush.api.shards import SHARD_NOT_OWNED, status_trailer
from kvpush.directory import validation as check
from kvpush.directory.admission import StreamSlots, caller_of
from kvpush.directory.auth import Authenticator, Principal, Unauthenticated
from kvpush.directory.errors import (
    AlreadyExists,
    DirectoryError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    ShardMoved,
    Unavailable,
)
from kvpush.directory.records import TransferRecord, UnreachableReport
from kvpush.directory.replica import Replica, lease_key
from kvpush.directory.state import DirectoryState, Effects, Worker
from kvpush.observability import get_logger
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import directory_pb2_grpc as dgrpc
from kvpush.v1 import types_pb2 as tpb

log = get_logger("directory.servicer")

# The one table from domain errors to gRPC status codes.
STATUS_BY_ERROR: dict[type[DirectoryError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    OutOfRange: grpc.StatusCode.OUT_OF_RANGE,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
}
HELLO_TIMEOUT_S = 10.0
WATCH_EVENTS_PER_MESSAGE = 1000
_SHUTDOWN_DETAILS = "directory shutting down"
# A listing page stops before its answer passes this many bytes (clients receive up to 64 MiB; gRPC's
# default elsewhere is 4 MiB), whatever page_size asked for.
MAX_PAGE_BYTES = 2 * 1024 * 1024
# A repeated entry's tag and length prefix, at most (plus the page token and incarnation: far under the slack).
_ENTRY_OVERHEAD_BYTES = 6
# Room for the page's other fields (next_page_token, incarnation id).
_PAGE_SLACK_BYTES = 4096


class ThrottledLog:
    """Logs at most `per_window` lines of one kind per window; the rest are counted and summarised.

    A client flooding bad input must not turn into a flood of log lines (each costs CPU and disk).
    `counts` keeps every refusal by kind, whether logged or not.
    """

    def __init__(self, per_window: int = 20, window_s: float = 1.0) -> None:
        self.per_window = per_window
        self.window_s = window_s
        self.counts: Counter[str] = Counter()
        self._window: dict[str, tuple[float, int, int]] = {}

    def info(self, kind: str, message: str, **fields: object) -> None:
        """Count one `kind` and log it unless this window already had `per_window` of them."""
        self.counts[kind] += 1
        now = time.monotonic()
        start, logged, suppressed = self._window.get(kind, (now, 0, 0))
        if now - start >= self.window_s:
            if suppressed:
                log.info("log lines suppressed", kind=kind, suppressed_count=suppressed, window_s=self.window_s)
            start, logged, suppressed = now, 0, 0
        if logged < self.per_window:
            log.info(message, **fields)
            logged += 1
        else:
            suppressed += 1
        self._window[kind] = (start, logged, suppressed)


def status_of(error: DirectoryError) -> grpc.StatusCode:
    """The status code for a domain error (INTERNAL for an unmapped one: a broken invariant)."""
    if isinstance(error, ShardMoved):  # another replica owns it (follow), or nobody right now (retry)
        return (grpc.StatusCode.FAILED_PRECONDITION if error.redirect.reason == SHARD_NOT_OWNED
                else grpc.StatusCode.UNAVAILABLE)
    return STATUS_BY_ERROR.get(type(error), grpc.StatusCode.INTERNAL)


def _rejection_status(code: grpc.StatusCode, error: DirectoryError) -> status_pb2.Status:
    """An EventRejection's status; a shard redirect rides in its details (google.rpc.ErrorInfo)."""
    if isinstance(error, ShardMoved):
        status = status_pb2.Status()
        status.ParseFromString(status_trailer(code, str(error), error.redirect)[0][1])
        return status
    return status_pb2.Status(code=code.value[0], message=str(error))


def _duration(seconds: float) -> duration_pb2.Duration:
    ttl = duration_pb2.Duration()
    ttl.FromNanoseconds(int(seconds * 1e9))
    return ttl


def worker_to_proto(worker: Worker, active_transfer_count: int,
                    unreachable: UnreachableReport | None = None) -> tpb.EngineWorker:
    """The wire form of one registered worker (with its engine's standing unreachable report, if any)."""
    # Never the lease id (a secret of the registrant) nor the NIXL metadata (only push instructions carry it).
    engine = tpb.EngineWorker(
        engine_id=worker.engine_id, role=worker.role, tp_rank=worker.tp_rank, tp_size=worker.tp_size,
        agent_name=worker.agent_name, layout=worker.layout,
        endpoint=worker.endpoint, active_transfer_count=active_transfer_count,
        model=worker.model, forces_first_token=worker.forces_first_token,
    )
    engine.lease_expire_time.FromNanoseconds(int(worker.lease_deadline_wall * 1e9))
    engine.register_time.FromNanoseconds(int(worker.register_wall * 1e9))
    if worker.load is not None:
        engine.load.CopyFrom(worker.load)
    if unreachable is not None:
        engine.unreachable_time.FromNanoseconds(int(unreachable.wall * 1e9))
        engine.unreachable_reason = unreachable.reason
    return engine


class DeliveredAgents:
    """The decode agents whose NIXL metadata one prefill stream delivered and its worker still holds.

    An instruction to such an agent goes without metadata and layout. Keyed by the metadata too: a decode worker
    re-registered under the same agent name (a restarted process) has new memory registrations that prefill must
    load. An agent the worker reports dropped (WriteResult.dropped_decode_agent_name) is forgotten, so the next
    instruction to it carries the metadata again.
    """

    def __init__(self) -> None:
        self._agents: set[tuple[str, int]] = set()  # (agent name, hash of its metadata)

    def strip_delivered(self, instruction: dpb.PushInstruction) -> None:
        """Clear the metadata and layout of an instruction whose agent holds them already; else record them sent."""
        # Only the first destination: a worker reports only that agent dropped (WriteResult), so further
        # destinations (different TP sizes) always carry their metadata; a worker that holds the agent skips it.
        agent = (instruction.decode_agent_name, hash(instruction.decode_agent_metadata))
        if agent in self._agents:
            instruction.ClearField("decode_agent_metadata")
            instruction.ClearField("decode_layout")
        else:
            self._agents.add(agent)

    def forget(self, agent_name: str) -> None:
        """The worker no longer holds `agent_name` (any metadata of it)."""
        self._agents = {agent for agent in self._agents if agent[0] != agent_name}


class _PrefillSession:
    """Per-stream bookkeeping of one StreamPrefill call."""

    def __init__(self, engine_id: str, tp_rank: int, session_id: int) -> None:
        self.engine_id = engine_id
        self.tp_rank = tp_rank
        self.session_id = session_id
        self.wake = asyncio.Event()
        self.rejections: deque[dpb.StreamPrefillResponse] = deque()
        self.sent_agents = DeliveredAgents()
        self.reader_done = False
        self.end_status: tuple[grpc.StatusCode, str] | None = None
        self.end_reason = "prefill stream closed"
        self.rejected_count = 0


class DirectoryServicer(dgrpc.KVDirectoryServiceServicer):
    """KVDirectoryService over one `DirectoryState`; see the module docstring."""

    def __init__(self, state: DirectoryState, max_message_bytes: int = 16 * 1024 * 1024,
                 authenticator: Authenticator | None = None, incarnation_id: str = "") -> None:
        self.state = state
        self.max_message_bytes = max_message_bytes
        self.auth = authenticator or Authenticator()
        self.incarnation_id = incarnation_id or "unnamed"
        self.limits = state.limits
        self.refusals = ThrottledLog()
        # Calls refused because a configured limit was reached, by limit (DirectoryError.limit; metrics).
        self.limit_refusals: Counter[str] = Counter()
        # Rejections queued over every open session (bounded by limits.max_pending_rejections).
        self.pending_rejection_count = 0
        # Open RenewLease, WatchTransfers and StreamPrefill calls, per caller and in all (admission.py).
        self.stream_slots = StreamSlots(self.limits)
        self._sessions: dict[tuple[str, int], _PrefillSession] = {}
        self._watchers: dict[str, set[asyncio.Event]] = {}
        self._shutting_down = False
        self._renew_streams: set[asyncio.Event] = set()
        # Set when this process is one of several replicas on etcd (src/kvpush/directory/replica.py).
        self.replica: Replica | None = None

    # ---------------------------------------------------------------- plumbing

    def header(self) -> dpb.ResponseHeader:
        """Every response's header: this process's incarnation and, with replicas, its replica id. The deprecated
        `directory_incarnation_id` of each response is filled beside it for clients that predate the header."""
        return dpb.ResponseHeader(directory_incarnation_id=self.incarnation_id,
                                  replica_id=self.replica.replica_id if self.replica is not None else "")

    def deliver(self, effects: Effects) -> None:
        """Wake the prefill sessions and watchers named by `effects`."""
        for key in effects.prefill_outboxes:
            session = self._sessions.get(key)
            if session is not None:
                session.wake.set()
        for engine_id in effects.watch_engines:
            for wake in self._watchers.get(engine_id, ()):
                wake.set()

    def begin_shutdown(self) -> None:
        """Ask every open stream to flush and end (graceful stop)."""
        self._shutting_down = True
        for session in self._sessions.values():
            session.wake.set()
        for wakes in self._watchers.values():
            for wake in wakes:
                wake.set()
        for wake in self._renew_streams:
            wake.set()

    def open_prefill_session_count(self) -> int:
        """Open StreamPrefill sessions (for metrics)."""
        return len(self._sessions)

    def open_watch_count(self) -> int:
        """Open WatchTransfers streams (for metrics)."""
        return sum(len(wakes) for wakes in self._watchers.values())

    @staticmethod
    async def _abort(context: grpc.aio.ServicerContext, error: DirectoryError) -> None:
        if isinstance(error, ShardMoved):
            code = status_of(error)
            await context.abort(code, str(error), trailing_metadata=status_trailer(code, str(error), error.redirect))
        await context.abort(status_of(error), str(error))

    def _lease(self, lease_id: str) -> str:
        """How the state knows a lease id: the id itself, or (replicas) its hash, as etcd stores it."""
        return lease_key(lease_id) if self.replica is not None else lease_id

    def _check_shard(self, transfer_id: str) -> None:
        """ShardMoved unless this process serves the transfer's shard (always, without replicas)."""
        if self.replica is None:
            return
        redirect = self.replica.redirect(transfer_id)
        if redirect is not None:
            owner = redirect.owner_address or "no replica right now"
            raise ShardMoved(f"transfer {transfer_id} is in shard {redirect.shard}, served by {owner}", redirect)

    def _principal(self, context: grpc.aio.ServicerContext) -> Principal:
        """The caller's principal; raises Unauthenticated (identities on, none proved)."""
        if not self.auth.identities:
            return self.auth.principal(None, None)
        return self.auth.principal(context.invocation_metadata(), context.auth_context())

    # ---------------------------------------------------------------- engines and leases

    async def RegisterEngine(self, request: dpb.RegisterEngineRequest,
                             context: grpc.aio.ServicerContext) -> dpb.RegisterEngineResponse:
        """Register one worker and grant a lease."""
        with bound_contextvars(engine_id=request.engine_id, tp_rank=request.tp_rank):
            try:
                check.check_register(request, self.limits)
                self._principal(context).require_engine(request.engine_id)
                if self.replica is not None:
                    lease_id, effects = await self.replica.register_engine(request)
                    worker = self.state.lease_holder(lease_key(lease_id))
                else:
                    worker, effects = self.state.register(request)
                    lease_id = worker.lease_id
            except DirectoryError as error:
                self.refusals.info("registration", "registration refused", code=status_of(error).name,
                                   error=str(error))
                await self._abort(context, error)
            self.deliver(effects)
            log.info("engine registered", role=tpb.EngineRole.Name(worker.role), agent_name=worker.agent_name)
            return dpb.RegisterEngineResponse(lease_id=lease_id, ttl=_duration(self.limits.lease_ttl_s),
                                              header=self.header(), directory_incarnation_id=self.incarnation_id)

    async def DeregisterEngine(self, request: dpb.DeregisterEngineRequest,
                               context: grpc.aio.ServicerContext) -> dpb.DeregisterEngineResponse:
        """Remove one worker; its engine's transfers fail towards the peers."""
        with bound_contextvars(engine_id=request.engine_id, tp_rank=request.tp_rank):
            try:
                check.require_id(request.engine_id, "engine_id", self.limits)
                check.require_id(request.lease_id, "lease_id", self.limits)
                check.check_rank(request.tp_rank, "tp_rank")
                self._principal(context).require_engine(request.engine_id)
                if self.replica is not None:
                    effects = await self.replica.deregister_engine(request.engine_id, request.tp_rank, request.lease_id)
                else:
                    effects = self.state.deregister(request.engine_id, request.tp_rank, request.lease_id)
            except DirectoryError as error:
                await self._abort(context, error)
            self.deliver(effects)
            log.info("engine deregistered")
            return dpb.DeregisterEngineResponse(header=self.header(), directory_incarnation_id=self.incarnation_id)

    @contextlib.asynccontextmanager
    async def _stream_slot(self, context: grpc.aio.ServicerContext, kind: str) -> AsyncIterator[None]:
        """One stream slot of the caller (`admission.StreamSlots`: per caller, globally, renewals kept apart)."""
        try:
            principal = str(self._principal(context))
        except DirectoryError:  # no identity: the handler refuses it; its slot is its address's
            principal = ""
        caller = caller_of(principal, context.peer() or "")
        renewal = kind == "RenewLease"
        try:
            self.stream_slots.take(caller, renewal)
        except ResourceExhausted as error:
            self.limit_refusals[error.limit] += 1
            self.refusals.info("stream", "stream refused", method=kind, caller=caller,
                               open_stream_count=self.stream_slots.open_count, error=str(error))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        try:
            yield
        finally:
            self.stream_slots.give_back(caller, renewal)

    @property
    def open_stream_count(self) -> int:
        """Open RenewLease, WatchTransfers and StreamPrefill calls."""
        return self.stream_slots.open_count

    async def RenewLease(self, request_iterator: AsyncIterator[dpb.RenewLeaseRequest],
                         context: grpc.aio.ServicerContext) -> None:
        """Renew leases as requests arrive; NOT_FOUND ends the stream for an unknown or lapsed lease.

        Only the worker's own engine may renew its lease (PERMISSION_DENIED); a stream silent for
        `renew_stream_idle_s` ends DEADLINE_EXCEEDED. Every task this handler starts ends with it.
        """
        async with self._stream_slot(context, "RenewLease"):
            await self._renew_lease(context)

    async def _renew_lease(self, context: grpc.aio.ServicerContext) -> None:
        try:
            principal = self._principal(context)
        except DirectoryError as error:
            await self._abort(context, error)
        ttl = _duration(self.limits.lease_ttl_s)
        stopping = asyncio.Event()
        self._renew_streams.add(stopping)
        stop_wait = asyncio.ensure_future(stopping.wait())
        # Any: grpc's context.read() is untyped (a request, grpc.aio.EOF or check.Undecodable).
        reading: asyncio.Future[Any] | None = None
        try:
            while not self._shutting_down:
                reading = asyncio.ensure_future(context.read())
                await asyncio.wait({reading, stop_wait}, timeout=self.limits.renew_stream_idle_s,
                                   return_when=asyncio.FIRST_COMPLETED)
                if not reading.done():
                    reading.cancel()
                    if stopping.is_set() or self._shutting_down:  # the client renews on the next directory
                        break
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                        f"no renewal for {self.limits.renew_stream_idle_s}s")
                request = reading.result()
                if request is grpc.aio.EOF:
                    return
                try:
                    if isinstance(request, check.Undecodable):
                        raise InvalidArgument(f"request does not decode: {request}")
                    check.require_id(request.lease_id, "lease_id", self.limits)
                    load = request.load if request.HasField("load") else None
                    if load is not None:
                        check.check_load(load)
                    principal.require_engine(self.state.lease_holder(self._lease(request.lease_id)).engine_id)
                    if self.replica is not None:
                        await self.replica.renew_engine(request.lease_id, load)
                    else:
                        self.state.renew(request.lease_id, load)
                except DirectoryError as error:
                    self.refusals.info("renewal", "renewal refused", code=status_of(error).name, error=str(error))
                    await self._abort(context, error)
                await context.write(dpb.RenewLeaseResponse(lease_id=request.lease_id, ttl=ttl, header=self.header(),
                                                           directory_incarnation_id=self.incarnation_id))
            context.set_code(grpc.StatusCode.UNAVAILABLE)
            context.set_details(_SHUTDOWN_DETAILS)
        finally:
            stop_wait.cancel()
            if reading is not None and not reading.done():
                reading.cancel()
            self._renew_streams.discard(stopping)

    async def GetEngine(self, request: dpb.GetEngineRequest,
                        context: grpc.aio.ServicerContext) -> dpb.GetEngineResponse:
        """One engine's workers in rank order."""
        try:
            check.require_id(request.engine_id, "engine_id", self.limits)
            self._principal(context).require_engine(request.engine_id, or_operator=True)
            workers = self.state.get_engine(request.engine_id)
        except DirectoryError as error:
            await self._abort(context, error)
        active = self.state.active_transfer_count(request.engine_id)
        unreachable = self.state.unreachable_report(request.engine_id)
        return dpb.GetEngineResponse(workers=[worker_to_proto(w, active, unreachable) for w in workers],
                                     header=self.header(), directory_incarnation_id=self.incarnation_id)

    async def ListEngines(self, request: dpb.ListEnginesRequest,
                          context: grpc.aio.ServicerContext) -> dpb.ListEnginesResponse:
        """One page of workers by (engine id, rank)."""
        try:
            self._principal(context).require_operator("ListEngines")
            page_size = check.check_page(request.page_size, self.limits)
            check.require_text(request.page_token, "page_token", check.MAX_PAGE_TOKEN_LENGTH)
            if request.role not in tpb.EngineRole.values():
                raise InvalidArgument(f"role {request.role} is not an EngineRole")
            workers, token = self.state.list_workers(page_size, request.page_token, request.role)
        except DirectoryError as error:
            await self._abort(context, error)
        response = dpb.ListEnginesResponse(header=self.header(), directory_incarnation_id=self.incarnation_id)
        size = 0  # a running total: re-measuring the growing response would make a page quadratic
        for index, worker in enumerate(workers):
            entry = worker_to_proto(worker, self.state.active_transfer_count(worker.engine_id),
                                    self.state.unreachable_report(worker.engine_id))
            size += entry.ByteSize() + _ENTRY_OVERHEAD_BYTES
            if index and size > MAX_PAGE_BYTES - _PAGE_SLACK_BYTES:
                token = self.state.engines.page_token_after(workers[index - 1])
                break
            response.workers.append(entry)
        response.next_page_token = token
        return response

    async def ReportEngineUnreachable(self, request: dpb.ReportEngineUnreachableRequest,
                                      context: grpc.aio.ServicerContext) -> dpb.ReportEngineUnreachableResponse:
        """A gateway could not reach an engine: planning leaves it out until its next renewal."""
        with bound_contextvars(engine_id=request.engine_id, transfer_id=request.transfer_id):
            try:
                check.require_id(request.engine_id, "engine_id", self.limits)
                check.require_id(request.transfer_id, "transfer_id", self.limits, required=False)
                check.require_text(request.reason, "reason")
                self._principal(context).require_operator("ReportEngineUnreachable")
                if request.transfer_id:  # replicas: the transfer's owner checks it names the engine
                    self._check_shard(request.transfer_id)
                marked = self.state.report_unreachable(request.engine_id, request.transfer_id, request.reason)
            except DirectoryError as error:
                self.refusals.info("unreachable", "unreachable report refused", code=status_of(error).name,
                                   error=str(error))
                await self._abort(context, error)
            log.warning("engine reported unreachable" if marked else "unreachable report about an earlier "
                        "registration ignored", reason=request.reason)
            return dpb.ReportEngineUnreachableResponse(marked=marked, header=self.header(),
                                                       directory_incarnation_id=self.incarnation_id)
    async def GetReplicas(self, request: dpb.GetReplicasRequest,
                          context: grpc.aio.ServicerContext) -> dpb.GetReplicasResponse:
        """The replica set and shard map (this process alone, one shard, without replicas)."""
        try:
            self._principal(context)
        except DirectoryError as error:
            await self._abort(context, error)
        response = dpb.GetReplicasResponse(header=self.header(), directory_incarnation_id=self.incarnation_id)
        replica = self.replica
        if replica is None:
            response.shard_count = 1
            response.shard_owner_replica_ids.append("")
            return response
        response.replica_id = replica.replica_id
        response.shard_count = replica.config.shard_count
        for replica_id, address in sorted(replica.replica_addresses().items()):
            response.replicas.append(dpb.DirectoryReplica(replica_id=replica_id, address=address))
        for shard in range(replica.config.shard_count):
            if replica.serves(shard):
                response.shard_owner_replica_ids.append(replica.replica_id)
            else:
                owner = replica.owners.get(shard, "")
                response.shard_owner_replica_ids.append("" if owner == replica.replica_id else owner)
        return response

    # ---------------------------------------------------------------- transfers

    async def PlanTransfer(self, request: dpb.PlanTransferRequest,
                           context: grpc.aio.ServicerContext) -> dpb.PlanTransferResponse:
        """Pick engines and mint a transfer."""
        try:
            ttl = check.check_plan(request, self.limits)
            self._principal(context).require_operator("PlanTransfer")
            if request.transfer_id:
                self._check_shard(request.transfer_id)
                if self.replica is not None:
                    self.replica.check_mintable(request.transfer_id)
            record, effects = self.state.plan(request, ttl)
            self.deliver(effects)
            if self.replica is not None:
                await self._store(record)
        except DirectoryError as error:
            if error.limit:
                self.limit_refusals[error.limit] += 1
            self.refusals.info("plan", "plan refused", code=status_of(error).name, error=str(error),
                               request_id=request.request_id)
            await self._abort(context, error)
        prefill = self.state.get_engine(record.prefill_engine_id)[0]
        decode_ranks = self.state.get_engine(record.decode_engine_id)
        decode = decode_ranks[0]
        return dpb.PlanTransferResponse(transfer=record.to_proto(), prefill_endpoint=prefill.endpoint,
                                        decode_endpoint=decode.endpoint,
                                        decode_forces_first_token=all(w.forces_first_token for w in decode_ranks),
                                        header=self.header(), directory_incarnation_id=self.incarnation_id)

    async def ReportAllocation(self, request: dpb.ReportAllocationRequest,
                               context: grpc.aio.ServicerContext) -> dpb.ReportAllocationResponse:
        """Record decode's blocks; may dispatch the push instructions."""
        with bound_contextvars(transfer_id=request.transfer_id, engine_id=request.engine_id):
            try:
                check.check_allocation(request, self.limits)
                self._principal(context).require_engine(request.engine_id)
                self._check_shard(request.transfer_id)
                record, effects = self.state.report_allocation(request, hold_dispatch=self.replica is not None)
                if record.dispatch_held:  # decode's blocks reach etcd before any instruction can go out
                    await self._store(record)
                    effects.prefill_outboxes |= self.state.release_dispatch(record).prefill_outboxes
            except DirectoryError as error:
                self.refusals.info("allocation", "allocation refused", code=status_of(error).name, error=str(error))
                await self._abort(context, error)
            self.deliver(effects)
            return dpb.ReportAllocationResponse(transfer=record.to_proto(),
                                                header=self.header(), directory_incarnation_id=self.incarnation_id)

    async def CancelTransfer(self, request: dpb.CancelTransferRequest,
                             context: grpc.aio.ServicerContext) -> dpb.CancelTransferResponse:
        """Cancel a transfer (no-op on a terminal one)."""
        with bound_contextvars(transfer_id=request.transfer_id):
            try:
                check.require_id(request.transfer_id, "transfer_id", self.limits)
                # Whatever the reason holds (an engine's multi-line error), the cancel applies: refusing it would
                # leave the transfer holding its engines' slots until its deadline.
                reason = check.sanitize_text(request.reason)
                self._require_party(context, request.transfer_id)
                record, effects = self.state.cancel(request.transfer_id, reason)
            except DirectoryError as error:
                await self._abort(context, error)
            self.deliver(effects)
            log.info("transfer cancel requested", state=tpb.TransferState.Name(record.state), reason=reason)
            return dpb.CancelTransferResponse(transfer=record.to_proto(), header=self.header(),
                                              directory_incarnation_id=self.incarnation_id)

    async def GetTransfer(self, request: dpb.GetTransferRequest,
                          context: grpc.aio.ServicerContext) -> dpb.GetTransferResponse:
        """One retained transfer."""
        try:
            check.require_id(request.transfer_id, "transfer_id", self.limits)
            record = self._require_party(context, request.transfer_id)
        except DirectoryError as error:
            await self._abort(context, error)
        return dpb.GetTransferResponse(transfer=record.to_proto(), header=self.header(),
                                       directory_incarnation_id=self.incarnation_id)

    async def _store(self, record: TransferRecord) -> None:
        """Store a live transfer in etcd (replicas); when that fails it ends CANCELLED here: Unavailable."""
        if self.replica is None:  # one directory: nothing is stored
            return
        try:
            await self.replica.store(record)
        except ConnectionError as error:
            if not record.terminal:
                _, effects = self.state.cancel(record.transfer_id, f"could not be stored in etcd: {error}")
                self.deliver(effects)
            raise Unavailable(f"transfer {record.transfer_id} could not be stored in etcd: {error}") from None

    def _require_party(self, context: grpc.aio.ServicerContext, transfer_id: str) -> TransferRecord:
        """The transfer, if the caller is the operator or one of its engines (NotFound, PermissionDenied)."""
        self._check_shard(transfer_id)
        principal = self._principal(context)
        record = self.state.get_transfer(transfer_id)
        principal.require_party((record.prefill_engine_id, record.decode_engine_id), f"transfer {transfer_id}")
        return record

    async def ListTransfers(self, request: dpb.ListTransfersRequest,
                            context: grpc.aio.ServicerContext) -> dpb.ListTransfersResponse:
        """One page of transfers, newest first."""
        try:
            page_size = check.check_page(request.page_size, self.limits)
            check.require_id(request.engine_id, "engine_id", self.limits, required=False)
            check.require_text(request.page_token, "page_token", check.MAX_PAGE_TOKEN_LENGTH)
            principal = self._principal(context)
            if request.engine_id:
                principal.require_engine(request.engine_id, or_operator=True)
            else:
                principal.require_operator("ListTransfers without an engine_id")
            if request.state not in tpb.TransferState.values():
                raise InvalidArgument(f"state {request.state} is not a TransferState")
            records, token = self.state.list_transfers(page_size, request.page_token, request.state,
                                                       request.engine_id)
        except DirectoryError as error:
            await self._abort(context, error)
        response = dpb.ListTransfersResponse(header=self.header(), directory_incarnation_id=self.incarnation_id)
        size = 0
        for index, record in enumerate(records):
            entry = record.to_proto()
            size += entry.ByteSize() + _ENTRY_OVERHEAD_BYTES
            if index and size > MAX_PAGE_BYTES - _PAGE_SLACK_BYTES:
                token = str(records[index - 1].sequence)
                break
            response.transfers.append(entry)
        response.next_page_token = token
        return response

    # ---------------------------------------------------------------- watch

    async def WatchTransfers(self, request: dpb.WatchTransfersRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[dpb.WatchTransfersResponse]:
        """Replay retained events after the given sequence number, then follow the decode engine's log."""
        async with self._stream_slot(context, "WatchTransfers"):
            async for response in self._watch_transfers(request, context):
                yield response

    async def _watch_transfers(self, request: dpb.WatchTransfersRequest,
                               context: grpc.aio.ServicerContext) -> AsyncIterator[dpb.WatchTransfersResponse]:
        try:
            check.require_id(request.engine_id, "engine_id", self.limits)
            check.require_id(request.directory_incarnation_id, "directory_incarnation_id", self.limits,
                             required=False)
            self._principal(context).require_engine(request.engine_id, or_operator=True)
            if request.after_sequence_number < 0:
                raise InvalidArgument("after_sequence_number must not be negative")
            if request.replay_retained and request.after_sequence_number:
                raise InvalidArgument("replay_retained needs after_sequence_number 0")
            if not self.state.is_decode_engine(request.engine_id):
                raise NotFound(f"engine {request.engine_id!r} is not a registered decode engine")
            if request.directory_incarnation_id and request.directory_incarnation_id != self.incarnation_id:
                raise OutOfRange(
                    f"after_sequence_number counts events of directory incarnation "
                    f"{request.directory_incarnation_id}; this is {self.incarnation_id}: it restarted, "
                    "re-read transfers")
            if request.replay_retained:
                last = 0
            else:
                last = request.after_sequence_number or self.state.last_event_sequence
            self.state.watch_events(request.engine_id, last)  # a resume point out of range fails before the greeting
        except DirectoryError as error:
            await self._abort(context, error)
        wake = asyncio.Event()
        watchers = self._watchers.setdefault(request.engine_id, set())
        watchers.add(wake)
        try:
            # Sent at once: the client learns which process it follows before any event.
            yield dpb.WatchTransfersResponse(header=self.header(), directory_incarnation_id=self.incarnation_id)
            while True:
                try:
                    events = self.state.watch_events(request.engine_id, last)
                except DirectoryError as error:
                    await self._abort(context, error)
                if events:
                    for start in range(0, len(events), WATCH_EVENTS_PER_MESSAGE):
                        yield dpb.WatchTransfersResponse(events=events[start:start + WATCH_EVENTS_PER_MESSAGE],
                                                         header=self.header(),
                                                         directory_incarnation_id=self.incarnation_id)
                    last = events[-1].sequence_number
                    continue
                if self._shutting_down:
                    context.set_code(grpc.StatusCode.UNAVAILABLE)
                    context.set_details(_SHUTDOWN_DETAILS)
                    return
                await wake.wait()
                wake.clear()
        finally:
            watchers.discard(wake)
            if not watchers and self._watchers.get(request.engine_id) is watchers:
                del self._watchers[request.engine_id]

    # ---------------------------------------------------------------- prefill session

    async def StreamPrefill(self, request_iterator: AsyncIterator[dpb.StreamPrefillRequest],
                            context: grpc.aio.ServicerContext) -> None:
        """A prefill worker's session: hello, then readiness and results in; instructions out."""
        async with self._stream_slot(context, "StreamPrefill"):
            await self._stream_prefill(context)

    async def _stream_prefill(self, context: grpc.aio.ServicerContext) -> None:
        try:
            first = await asyncio.wait_for(context.read(), HELLO_TIMEOUT_S)
        except TimeoutError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"no hello within {HELLO_TIMEOUT_S}s")
        if first is grpc.aio.EOF:
            return
        try:
            principal = self._principal(context)
            if isinstance(first, check.Undecodable):
                raise InvalidArgument(f"the first message does not decode: {first}")
            if first.WhichOneof("message") != "hello":
                raise InvalidArgument("the first message of a StreamPrefill must be a hello")
            hello = first.hello
            check.check_hello(hello, self.limits)
            principal.require_engine(hello.engine_id)
            session_id, effects = self.state.open_session(hello.engine_id, hello.tp_rank, self._lease(hello.lease_id))
        except DirectoryError as error:
            await self._abort(context, error)
        key = (hello.engine_id, hello.tp_rank)
        session = _PrefillSession(hello.engine_id, hello.tp_rank, session_id)
        replaced = self._sessions.get(key)
        self._sessions[key] = session
        if replaced is not None:
            replaced.wake.set()  # its session id is stale now: it ends without failing anything
        session.wake.set()
        self.deliver(effects)
        with bound_contextvars(engine_id=hello.engine_id, tp_rank=hello.tp_rank):
            log.info("prefill session opened", session_id=session_id)
            reader = asyncio.create_task(self._read_prefill(context, session))
            try:
                await self._write_prefill(context, session)
            finally:
                reader.cancel()
                self._drop_rejections(session)
                if self._sessions.get(key) is session:
                    del self._sessions[key]
                if not self._shutting_down:
                    self.deliver(self.state.close_session(session.engine_id, session.tp_rank, session_id,
                                                          session.end_reason))
                log.info("prefill session closed", session_id=session_id, reason=session.end_reason,
                         rejected_count=session.rejected_count)

    async def _write_prefill(self, context: grpc.aio.ServicerContext, session: _PrefillSession) -> None:
        """The session's only writer: flush queued messages whenever woken, until the session ends."""
        await context.write(dpb.StreamPrefillResponse(
            opened=dpb.SessionOpened(directory_incarnation_id=self.incarnation_id),
            header=self.header(), directory_incarnation_id=self.incarnation_id))
        while True:
            await session.wake.wait()
            session.wake.clear()
            stale = self.state.session_worker(session.engine_id, session.tp_rank, session.session_id) is None
            while session.rejections:
                rejection = session.rejections.popleft()
                self.pending_rejection_count -= 1
                await context.write(rejection)
            for message in self.state.drain_outbox(session.engine_id, session.tp_rank, session.session_id):
                if message.WhichOneof("message") == "instruction":
                    session.sent_agents.strip_delivered(message.instruction)
                message.directory_incarnation_id = self.incarnation_id
                message.header.CopyFrom(self.header())
                await context.write(message)
            if session.end_status is not None:
                session.end_reason = session.end_status[1]
                await context.abort(*session.end_status)
            if stale:
                session.end_reason = "session replaced or worker removed"
                await context.abort(grpc.StatusCode.ABORTED, "this session was replaced or the worker was removed")
            if self._shutting_down:
                context.set_code(grpc.StatusCode.UNAVAILABLE)
                context.set_details(_SHUTDOWN_DETAILS)
                return
            if session.reader_done:
                return

    async def _read_prefill(self, context: grpc.aio.ServicerContext, session: _PrefillSession) -> None:
        """Apply every incoming message; a bad event earns a rejection, a bad batch ends the stream."""
        try:
            while True:
                message = await context.read()
                if message is grpc.aio.EOF:
                    session.end_reason = "prefill stream closed by the worker"
                    return
                if isinstance(message, check.Undecodable):
                    session.end_status = (grpc.StatusCode.INVALID_ARGUMENT,
                                          f"stream message does not decode: {message}")
                    return
                if message.ByteSize() > self.max_message_bytes:
                    session.end_status = (grpc.StatusCode.INVALID_ARGUMENT,
                                          f"stream message is {message.ByteSize()} bytes; "
                                          f"the limit is {self.max_message_bytes}")
                    return
                kind = message.WhichOneof("message")
                if kind == "ready":
                    try:
                        check.check_batch(message.ready, self.limits)
                    except DirectoryError as error:
                        session.end_status = (status_of(error), str(error))
                        return
                    self._apply_ready(session, message.ready.events)
                elif kind == "result":
                    self._apply_result(session, message.result)
                else:
                    self._reject(session, "",
                                 InvalidArgument(f"unexpected {kind or 'empty'} message in an open session"))
                if session.end_status is not None:
                    return
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            session.end_reason = "prefill stream broken"
        finally:
            session.reader_done = True
            session.wake.set()

    def _drop_rejections(self, session: _PrefillSession) -> None:
        self.pending_rejection_count -= len(session.rejections)
        session.rejections.clear()

    def _apply_ready(self, session: _PrefillSession, events: Iterable[dpb.LayerReady]) -> None:
        valid = []
        for event in events:
            try:
                check.check_layer_ready(event, self.limits)
                self._check_shard(event.transfer_id)
                valid.append(event)
            except DirectoryError as error:
                self._reject(session, event.transfer_id, error)
        if not valid:
            return
        effects, refused = self.state.report_ready(session.engine_id, session.tp_rank, valid)
        for event, refusal in refused:
            self._reject(session, event.transfer_id, refusal)
        self.deliver(effects)

    def _apply_result(self, session: _PrefillSession, result: dpb.WriteResult) -> None:
        try:
            check.check_result(result, self.limits)
            if result.dropped_decode_agent_name:
                # Whatever becomes of the transfer, the worker lacks that agent now.
                session.sent_agents.forget(result.dropped_decode_agent_name)
            self._check_shard(result.transfer_id)
            effects = self.state.report_result(session.engine_id, session.tp_rank, result)
        except DirectoryError as error:
            self._reject(session, result.transfer_id, error)
            return
        self.deliver(effects)

    def _reject(self, session: _PrefillSession, transfer_id: str, error: DirectoryError) -> None:
        """Queue a rejection; past the per-session or global cap, end the session RESOURCE_EXHAUSTED instead."""
        code = status_of(error)
        session.rejected_count += 1
        self.refusals.info("event", "event rejected", transfer_id=transfer_id[:self.limits.max_id_length],
                           code=code.name, error=str(error))
        if session.end_status is not None:
            return
        if (len(session.rejections) >= self.limits.max_pending_rejections_per_session
                or self.pending_rejection_count >= self.limits.max_pending_rejections):
            cap = ("this session's" if len(session.rejections) >= self.limits.max_pending_rejections_per_session
                   else "the directory's")
            self._drop_rejections(session)
            session.end_status = (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"{cap} cap on queued event rejections is reached: read the stream and "
                                  "send fewer refused events")
            session.wake.set()
            return
        session.rejections.append(dpb.StreamPrefillResponse(rejection=dpb.EventRejection(
            transfer_id=transfer_id[:self.limits.max_id_length],
            status=_rejection_status(code, error)),
            header=self.header(), directory_incarnation_id=self.incarnation_id))
        self.pending_rejection_count += 1
        session.wake.set()
