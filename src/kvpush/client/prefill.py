"""`PrefillSession`: a prefill worker's StreamPrefill session, kept open across reconnects.

Life cycle:
1. `start()` opens the stream, sends the hello with the registration's current lease and
   starts a reader (instructions, cancellations, rejections -> callbacks) and a writer.
2. `send_ready(events)` / `send_result(result)` only enqueue (thread-safe, never block): the
   writer sends consecutive readiness events as one LayerReadyBatch (up to `max_batch_events`),
   results in order between them. Nothing waits a round trip per layer.
3. When the stream breaks or the directory ends it, the session reconnects with backoff and
   re-hellos with the lease the registration holds then (it may have re-registered). The
   directory failed the transfers this worker had begun; `on_reconnect()` tells the caller, so
   it can re-send readiness of transfers it still considers live (they are refused with an
   EventRejection if the directory ended them). Queued messages not yet written are sent on
   the new stream; messages in flight at the break are not resent.
4. `stop()` sends what is queued, half-closes the stream and waits (bounded) for it to end.

Directory restart: every session opens with the directory's incarnation id (`SessionOpened`); a
different one than the previous session's means the directory restarted and forgot every transfer:
`on_directory_restart(incarnation_id)` tells the caller, who fails its in-flight pushes at once
(readiness re-sent for them would be refused NOT_FOUND anyway).

Callbacks run on the client's event loop and must not block:
`on_instruction(PushInstruction)`, `on_peer(PeerAnnouncement)`, `on_cancellation(Cancellation)`,
`on_rejection(EventRejection)`, `on_reconnect()`, `on_directory_restart(incarnation_id)`, `on_disconnect()`
(an open stream ended or broke, before any reconnect).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable, Iterable

import grpc

from kvpush.client.client import DirectoryClient
from kvpush.client.lease import EngineRegistration
from kvpush.observability import get_logger
from kvpush.v1 import directory_pb2 as dpb

log = get_logger("client.prefill")
# Streams end with these codes only for a reason that a reconnect cannot fix.
_FATAL = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED,
                    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION,
                    grpc.StatusCode.UNIMPLEMENTED})


class PrefillSession:
    """A prefill worker's StreamPrefill session with automatic reconnect (module docstring)."""

    def __init__(self, client: DirectoryClient, registration: EngineRegistration,
                 on_instruction: Callable[[dpb.PushInstruction], None] | None = None,
                 on_cancellation: Callable[[dpb.Cancellation], None] | None = None,
                 on_rejection: Callable[[dpb.EventRejection], None] | None = None,
                 on_reconnect: Callable[[], None] | None = None,
                 on_directory_restart: Callable[[str], None] | None = None,
                 max_batch_events: int = 4096, write_timeout_s: float = 30.0,
                 on_disconnect: Callable[[], None] | None = None,
                 on_peer: Callable[[dpb.PeerAnnouncement], None] | None = None) -> None:
        self.client = client
        self.registration = registration
        self.on_instruction = on_instruction
        self.on_peer = on_peer
        self.on_cancellation = on_cancellation
        self.on_rejection = on_rejection
        self.on_reconnect = on_reconnect
        self.on_directory_restart = on_directory_restart
        # Runs when an open stream ended or broke (before any reconnect); replicas use it (client/replicas.py).
        self.on_disconnect = on_disconnect
        # The incarnation of the directory the last session was opened with ("" before the first).
        self.directory_incarnation_id = ""
        # Keep at or below the directory's --max-events-per-batch: an over-cap batch ends the session.
        self.max_batch_events = max_batch_events
        # A write blocked this long (the directory stopped reading) ends the stream; the session reconnects.
        self.write_timeout_s = write_timeout_s
        self.connect_count = 0
        self.fatal_error: str = ""
        self._queue: deque[dpb.LayerReady | dpb.WriteResult] = deque()
        self._wake = asyncio.Event()
        self._connected = asyncio.Event()
        self._stopping = False
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._task: asyncio.Task | None = None

    async def start(self, timeout_s: float | None = None) -> None:
        """Open the session; returns once the first hello was sent (bounded by `timeout_s`)."""
        self._task = asyncio.create_task(self._run(), name=f"kvpush-prefill-{self.registration.engine_id}")
        await asyncio.wait_for(self._connected.wait(), timeout_s or self.client.config.timeout_s * 2)

    @property
    def connected(self) -> bool:
        """True while a stream with a sent hello is open."""
        return self._connected.is_set()

    @property
    def queued_message_count(self) -> int:
        """Readiness events and results queued here, not yet written to the stream (the session's backlog)."""
        return len(self._queue)

    def send_ready(self, events: Iterable[dpb.LayerReady]) -> None:
        """Queue readiness events (from any thread); they go out batched."""
        self._enqueue(list(events))

    def send_result(self, result: dpb.WriteResult) -> None:
        """Queue one write result (from any thread)."""
        self._enqueue([result])

    def _enqueue(self, items: list) -> None:
        if threading.get_ident() == self._loop_thread:
            self._queue.extend(items)
            self._wake.set()
        else:
            self._loop.call_soon_threadsafe(self._enqueue, items)

    async def _run(self) -> None:
        attempt = 0
        while not self._stopping:
            call = self.client.stub.StreamPrefill(metadata=self.client.config.metadata)
            reader: asyncio.Task | None = None
            try:
                lease_id = await self.registration.wait_registered(self.client.config.timeout_s * 4)
                await call.write(dpb.StreamPrefillRequest(hello=dpb.Hello(
                    engine_id=self.registration.engine_id, tp_rank=self.registration.tp_rank, lease_id=lease_id,
                    directory_incarnation_id=self.directory_incarnation_id)))
                self.connect_count += 1
                self._connected.set()
                reader = asyncio.create_task(self._read(call))
                if self.connect_count > 1:
                    log.info("prefill session reconnected", engine_id=self.registration.engine_id,
                             tp_rank=self.registration.tp_rank)
                    if self.on_reconnect is not None:
                        self.on_reconnect()
                await self._write(call, reader)
                if self._stopping:
                    await call.done_writing()
                    await asyncio.wait_for(reader, self.client.config.timeout_s)
                    return
                await reader
                attempt = 0
            except (TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError) as error:
                code = error.code() if isinstance(error, grpc.aio.AioRpcError) else None
                if code is not None and code in _FATAL and isinstance(error, grpc.aio.AioRpcError):
                    self.fatal_error = f"{code.name}: {error.details()}"
                    log.error("prefill session refused", error=self.fatal_error)
                    self._connected.clear()
                    return
                if code == grpc.StatusCode.NOT_FOUND:
                    self.registration.request_renewal()  # learn at once whether the lease is gone
            finally:
                was_connected = self._connected.is_set()
                self._connected.clear()
                if was_connected and not self._stopping and self.on_disconnect is not None:
                    try:
                        self.on_disconnect()
                    except Exception:  # a callback bug must not kill the session
                        log.exception("prefill on_disconnect callback failed")
                if reader is not None and not reader.done():
                    reader.cancel()
                call.cancel()
            if self._stopping:
                return
            status = await call.code() if call.done() else None
            if status is not None and status in _FATAL:
                self.fatal_error = f"{status.name}: {await call.details()}"
                log.error("prefill session refused", error=self.fatal_error)
                return
            delay = self.client.config.backoff_s(min(attempt, 10)) + 0.05
            attempt += 1
            log.info("prefill stream ended; reconnecting", engine_id=self.registration.engine_id,
                     status=status.name if status else None, delay_s=round(delay, 3))
            await asyncio.sleep(delay)

    async def _write(self, call, reader: asyncio.Task) -> None:
        """Send queued items until stopping or the reader ends (the stream is over)."""
        while not reader.done():
            while self._queue:
                await asyncio.wait_for(call.write(self._next_message()), self.write_timeout_s)
            if self._stopping:
                return
            self._wake.clear()
            waiter = asyncio.ensure_future(self._wake.wait())
            await asyncio.wait({waiter, reader}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()

    def _next_message(self) -> dpb.StreamPrefillRequest:
        """The next wire message: one result, or a batch of consecutive readiness events."""
        if isinstance(self._queue[0], dpb.WriteResult):
            return dpb.StreamPrefillRequest(result=self._queue.popleft())
        batch = dpb.LayerReadyBatch()
        while self._queue and isinstance(self._queue[0], dpb.LayerReady) and len(batch.events) < self.max_batch_events:
            batch.events.append(self._queue.popleft())
        return dpb.StreamPrefillRequest(ready=batch)

    async def _read(self, call) -> None:
        while True:
            message = await call.read()
            if message is grpc.aio.EOF:
                return
            kind = message.WhichOneof("message")
            try:
                if kind == "opened":
                    self._opened(message.opened.directory_incarnation_id)
                elif kind == "instruction" and self.on_instruction is not None:
                    self.on_instruction(message.instruction)
                elif kind == "cancellation" and self.on_cancellation is not None:
                    self.on_cancellation(message.cancellation)
                elif kind == "rejection" and self.on_rejection is not None:
                    self.on_rejection(message.rejection)
                elif kind == "peer" and self.on_peer is not None:
                    self.on_peer(message.peer)
            except Exception:  # a callback bug must not kill the session
                log.exception("prefill callback failed", kind=kind)

    def _opened(self, incarnation_id: str) -> None:
        previous, self.directory_incarnation_id = self.directory_incarnation_id, incarnation_id
        if previous and incarnation_id != previous:
            log.warning("directory restarted; its transfers are gone", engine_id=self.registration.engine_id,
                        previous_incarnation_id=previous, incarnation_id=incarnation_id)
            if self.on_directory_restart is not None:
                self.on_directory_restart(incarnation_id)

    async def stop(self, timeout_s: float | None = None) -> None:
        """Flush queued messages, half-close and wait (bounded) for the session to end."""
        self._stopping = True
        self._wake.set()
        if self._task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout_s or self.client.config.timeout_s)
        except (TimeoutError, grpc.aio.AioRpcError):
            self._task.cancel()
        self._task = None
