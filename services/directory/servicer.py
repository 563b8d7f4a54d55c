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
- RenewLease: one response per renewal; an unknown lease ends the stream with NOT_FOUND.

Shutdown: `begin_shutdown()` wakes every stream; each flushes what is queued and ends with
UNAVAILABLE ("directory shutting down") without failing transfers, so clients reconnect elsewhere.
"""

from __future__ import annotations

import asyncio
from collections import deque

import grpc
from google.protobuf import duration_pb2
from structlog.contextvars import bound_contextvars

from kvpush.observability import get_logger
from kvpush.services.directory import validation as check
from kvpush.services.directory.errors import (
    AlreadyExists,
    DirectoryError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
)
from kvpush.services.directory.state import DirectoryState, Effects, Worker
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
}
HELLO_TIMEOUT_S = 10.0
WATCH_EVENTS_PER_MESSAGE = 1000
_SHUTDOWN_DETAILS = "directory shutting down"


def status_of(error: DirectoryError) -> grpc.StatusCode:
    """The status code for a domain error (INTERNAL for an unmapped one: a broken invariant)."""
    return STATUS_BY_ERROR.get(type(error), grpc.StatusCode.INTERNAL)


def _duration(seconds: float) -> duration_pb2.Duration:
    ttl = duration_pb2.Duration()
    ttl.FromNanoseconds(int(seconds * 1e9))
    return ttl


def worker_to_proto(worker: Worker, active_transfer_count: int) -> tpb.Engine:
    """The wire form of one registered worker."""
    engine = tpb.Engine(
        engine_id=worker.engine_id, role=worker.role, tp_rank=worker.tp_rank, tp_size=worker.tp_size,
        agent_name=worker.agent_name, agent_metadata=worker.agent_metadata, layout=worker.layout,
        endpoint=worker.endpoint, lease_id=worker.lease_id, active_transfer_count=active_transfer_count,
    )
    engine.lease_expire_time.FromNanoseconds(int(worker.lease_deadline_wall * 1e9))
    engine.register_time.FromNanoseconds(int(worker.register_wall * 1e9))
    if worker.load is not None:
        engine.load.CopyFrom(worker.load)
    return engine


class _PrefillSession:
    """Per-stream bookkeeping of one StreamPrefill call."""

    def __init__(self, engine_id: str, tp_rank: int, session_id: int) -> None:
        self.engine_id = engine_id
        self.tp_rank = tp_rank
        self.session_id = session_id
        self.wake = asyncio.Event()
        self.rejections: deque[dpb.StreamPrefillResponse] = deque()
        self.sent_agents: set[tuple[str, int]] = set()
        self.reader_done = False
        self.end_status: tuple[grpc.StatusCode, str] | None = None
        self.end_reason = "prefill stream closed"


class DirectoryServicer(dgrpc.KVDirectoryServiceServicer):
    """KVDirectoryService over one `DirectoryState`; see the module docstring."""

    def __init__(self, state: DirectoryState, max_message_bytes: int = 16 * 1024 * 1024) -> None:
        self.state = state
        self.max_message_bytes = max_message_bytes
        self.limits = state.limits
        self._sessions: dict[tuple[str, int], _PrefillSession] = {}
        self._watchers: dict[str, set[asyncio.Event]] = {}
        self._shutting_down = False
        self._renew_streams: set[asyncio.Event] = set()

    # ---------------------------------------------------------------- plumbing

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

    @staticmethod
    async def _abort(context: grpc.aio.ServicerContext, error: DirectoryError) -> None:
        await context.abort(status_of(error), str(error))

    # ---------------------------------------------------------------- engines and leases

    async def RegisterEngine(self, request, context):
        """Register one worker and grant a lease."""
        with bound_contextvars(engine_id=request.engine_id, tp_rank=request.tp_rank):
            try:
                check.check_register(request, self.limits)
                worker, effects = self.state.register(request)
            except DirectoryError as error:
                log.info("registration refused", code=status_of(error).name, error=str(error))
                await self._abort(context, error)
            self.deliver(effects)
            log.info("engine registered", role=tpb.EngineRole.Name(worker.role), agent_name=worker.agent_name,
                     lease_id=worker.lease_id)
            return dpb.RegisterEngineResponse(lease_id=worker.lease_id, ttl=_duration(self.limits.lease_ttl_s))

    async def DeregisterEngine(self, request, context):
        """Remove one worker; its engine's transfers fail towards the peers."""
        with bound_contextvars(engine_id=request.engine_id, tp_rank=request.tp_rank):
            try:
                check.require_id(request.engine_id, "engine_id", self.limits)
                check.require_id(request.lease_id, "lease_id", self.limits)
                effects = self.state.deregister(request.engine_id, request.tp_rank, request.lease_id)
            except DirectoryError as error:
                await self._abort(context, error)
            self.deliver(effects)
            log.info("engine deregistered")
            return dpb.DeregisterEngineResponse()

    async def RenewLease(self, request_iterator, context):
        """Renew leases as requests arrive; NOT_FOUND ends the stream for an unknown or lapsed lease."""
        ttl = _duration(self.limits.lease_ttl_s)
        stopping = asyncio.Event()
        self._renew_streams.add(stopping)
        try:
            while not self._shutting_down:
                reading = asyncio.ensure_future(context.read())
                waiting = asyncio.ensure_future(stopping.wait())
                await asyncio.wait({reading, waiting}, return_when=asyncio.FIRST_COMPLETED)
                waiting.cancel()
                if not reading.done():  # stopping: the client renews on the next directory
                    reading.cancel()
                    break
                request = reading.result()
                if request is grpc.aio.EOF:
                    return
                try:
                    check.require_id(request.lease_id, "lease_id", self.limits)
                    self.state.renew(request.lease_id, request.load if request.HasField("load") else None)
                except DirectoryError as error:
                    log.info("renewal refused", lease_id=request.lease_id, error=str(error))
                    await self._abort(context, error)
                await context.write(dpb.RenewLeaseResponse(lease_id=request.lease_id, ttl=ttl))
            context.set_code(grpc.StatusCode.UNAVAILABLE)
            context.set_details(_SHUTDOWN_DETAILS)
        finally:
            self._renew_streams.discard(stopping)

    async def GetEngine(self, request, context):
        """One engine's workers in rank order."""
        try:
            check.require_id(request.engine_id, "engine_id", self.limits)
            workers = self.state.get_engine(request.engine_id)
        except DirectoryError as error:
            await self._abort(context, error)
        active = self.state.active_transfer_count(request.engine_id)
        return dpb.GetEngineResponse(workers=[worker_to_proto(w, active) for w in workers])

    async def ListEngines(self, request, context):
        """One page of workers by (engine id, rank)."""
        try:
            page_size = check.check_page(request.page_size, self.limits)
            workers, token = self.state.list_workers(page_size, request.page_token, request.role)
        except DirectoryError as error:
            await self._abort(context, error)
        return dpb.ListEnginesResponse(
            workers=[worker_to_proto(w, self.state.active_transfer_count(w.engine_id)) for w in workers],
            next_page_token=token)

    # ---------------------------------------------------------------- transfers

    async def PlanTransfer(self, request, context):
        """Pick engines and mint a transfer."""
        try:
            ttl = check.check_plan(request, self.limits)
            record = self.state.plan(request, ttl)
        except DirectoryError as error:
            log.info("plan refused", code=status_of(error).name, error=str(error), request_id=request.request_id)
            await self._abort(context, error)
        prefill = self.state.get_engine(record.prefill_engine_id)[0]
        decode = self.state.get_engine(record.decode_engine_id)[0]
        return dpb.PlanTransferResponse(transfer=record.to_proto(), prefill_endpoint=prefill.endpoint,
                                        decode_endpoint=decode.endpoint)

    async def ReportAllocation(self, request, context):
        """Record decode's blocks; may dispatch the push instructions."""
        with bound_contextvars(transfer_id=request.transfer_id, engine_id=request.engine_id):
            try:
                check.check_allocation(request, self.limits)
                record, effects = self.state.report_allocation(request)
            except DirectoryError as error:
                log.info("allocation refused", code=status_of(error).name, error=str(error))
                await self._abort(context, error)
            self.deliver(effects)
            return dpb.ReportAllocationResponse(transfer=record.to_proto())

    async def CancelTransfer(self, request, context):
        """Cancel a transfer (no-op on a terminal one)."""
        with bound_contextvars(transfer_id=request.transfer_id):
            try:
                check.require_id(request.transfer_id, "transfer_id", self.limits)
                check.require_text(request.reason, "reason")
                record, effects = self.state.cancel(request.transfer_id, request.reason)
            except DirectoryError as error:
                await self._abort(context, error)
            self.deliver(effects)
            log.info("transfer cancel requested", state=tpb.TransferState.Name(record.state), reason=request.reason)
            return dpb.CancelTransferResponse(transfer=record.to_proto())

    async def GetTransfer(self, request, context):
        """One retained transfer."""
        try:
            check.require_id(request.transfer_id, "transfer_id", self.limits)
            record = self.state.get_transfer(request.transfer_id)
        except DirectoryError as error:
            await self._abort(context, error)
        return dpb.GetTransferResponse(transfer=record.to_proto())

    async def ListTransfers(self, request, context):
        """One page of transfers, newest first."""
        try:
            page_size = check.check_page(request.page_size, self.limits)
            check.require_id(request.engine_id, "engine_id", self.limits, required=False)
            if request.state not in tpb.TransferState.values():
                raise InvalidArgument(f"state {request.state} is not a TransferState")
            records, token = self.state.list_transfers(page_size, request.page_token, request.state,
                                                       request.engine_id)
        except DirectoryError as error:
            await self._abort(context, error)
        return dpb.ListTransfersResponse(transfers=[r.to_proto() for r in records], next_page_token=token)

    # ---------------------------------------------------------------- watch

    async def WatchTransfers(self, request, context):
        """Replay retained events after the given sequence number, then follow the decode engine's log."""
        try:
            check.require_id(request.engine_id, "engine_id", self.limits)
            if request.after_sequence_number < 0:
                raise InvalidArgument("after_sequence_number must not be negative")
            if not self.state.is_decode_engine(request.engine_id):
                raise NotFound(f"engine {request.engine_id!r} is not a registered decode engine")
        except DirectoryError as error:
            await self._abort(context, error)
        wake = asyncio.Event()
        watchers = self._watchers.setdefault(request.engine_id, set())
        watchers.add(wake)
        last = request.after_sequence_number or self.state.last_event_sequence
        try:
            while True:
                try:
                    events = self.state.watch_events(request.engine_id, last)
                except DirectoryError as error:
                    await self._abort(context, error)
                if events:
                    for start in range(0, len(events), WATCH_EVENTS_PER_MESSAGE):
                        yield dpb.WatchTransfersResponse(events=events[start:start + WATCH_EVENTS_PER_MESSAGE])
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

    async def StreamPrefill(self, request_iterator, context):
        """A prefill worker's session: hello, then readiness and results in; instructions out."""
        try:
            first = await asyncio.wait_for(context.read(), HELLO_TIMEOUT_S)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"no hello within {HELLO_TIMEOUT_S}s")
        if first is grpc.aio.EOF:
            return
        try:
            if first.WhichOneof("message") != "hello":
                raise InvalidArgument("the first message of a StreamPrefill must be a hello")
            hello = first.hello
            check.check_hello(hello, self.limits)
            session_id, effects = self.state.open_session(hello.engine_id, hello.tp_rank, hello.lease_id)
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
                if self._sessions.get(key) is session:
                    del self._sessions[key]
                if not self._shutting_down:
                    self.deliver(self.state.close_session(session.engine_id, session.tp_rank, session_id,
                                                          session.end_reason))
                log.info("prefill session closed", session_id=session_id, reason=session.end_reason)

    async def _write_prefill(self, context: grpc.aio.ServicerContext, session: _PrefillSession) -> None:
        """The session's only writer: flush queued messages whenever woken, until the session ends."""
        while True:
            await session.wake.wait()
            session.wake.clear()
            stale = self.state.session_worker(session.engine_id, session.tp_rank, session.session_id) is None
            while session.rejections:
                await context.write(session.rejections.popleft())
            for message in self.state.drain_outbox(session.engine_id, session.tp_rank, session.session_id):
                if message.WhichOneof("message") == "instruction":
                    instruction = message.instruction
                    # Keyed by the metadata too: a decode worker re-registered under the same agent name
                    # (a restarted process) has new memory registrations that prefill must load.
                    agent = (instruction.decode_agent_name, hash(instruction.decode_agent_metadata))
                    if agent in session.sent_agents:
                        instruction.ClearField("decode_agent_metadata")
                        instruction.ClearField("decode_layout")
                    else:
                        session.sent_agents.add(agent)
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
                    self._reject(session, message.hello.engine_id if kind == "hello" else "",
                                 InvalidArgument(f"unexpected {kind or 'empty'} message in an open session"))
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            session.end_reason = "prefill stream broken"
        finally:
            session.reader_done = True
            session.wake.set()

    def _apply_ready(self, session: _PrefillSession, events) -> None:
        valid = []
        for event in events:
            try:
                check.check_layer_ready(event, self.limits)
                valid.append(event)
            except DirectoryError as error:
                self._reject(session, event.transfer_id, error)
        if not valid:
            return
        effects, refused = self.state.report_ready(session.engine_id, session.tp_rank, valid)
        for event, error in refused:
            self._reject(session, event.transfer_id, error)
        self.deliver(effects)

    def _apply_result(self, session: _PrefillSession, result: dpb.WriteResult) -> None:
        try:
            check.check_result(result, self.limits)
            effects = self.state.report_result(session.engine_id, session.tp_rank, result)
        except DirectoryError as error:
            self._reject(session, result.transfer_id, error)
            return
        self.deliver(effects)

    def _reject(self, session: _PrefillSession, transfer_id: str, error: DirectoryError) -> None:
        code = status_of(error)
        session.rejections.append(dpb.StreamPrefillResponse(rejection=dpb.EventRejection(
            transfer_id=transfer_id, code=code.value[0], message=str(error))))
        session.wake.set()
        log.info("event rejected", transfer_id=transfer_id, code=code.name, error=str(error))
