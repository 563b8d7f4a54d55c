"""`EngineRegistration`: register a worker and keep its lease alive, across directory restarts.

Life cycle:
1. `start()` registers (unary, retried on UNAVAILABLE) and starts the keep-alive task.
2. The task holds a RenewLease stream and renews every ttl/3 with `load_callback()`'s load.
   A broken stream is reopened with backoff. If no renewal succeeded for a whole TTL, the lease
   is presumed lost (`on_lease_lost`).
3. NOT_FOUND on renewal (the lease lapsed, or the directory restarted and forgot it; a renewal
   answered by another directory incarnation than the one that granted the lease counts the same): the
   registration is sent again; the new lease id is exposed by `lease_id` and `on_registered`
   is called with it (the prefill session re-hellos with it).
4. `stop()` ends the task and, by default, deregisters.

Callbacks run on the client's event loop and must not block: `load_callback() -> EngineLoad | None`,
`on_registered(lease_id)`, `on_lease_renewed(lease_id, ttl_s)`, `on_lease_lost(lease_id, reason)`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from kvpush.client.client import DirectoryClient, incarnation_of
from kvpush.client.errors import DirectoryCallError
from kvpush.observability import get_logger
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb

log = get_logger("client.lease")


class EngineRegistration:
    """One worker's registration and its lease keep-alive (module docstring)."""

    def __init__(self, client: DirectoryClient, request: dpb.RegisterEngineRequest,
                 load_callback: Callable[[], tpb.EngineLoad | None] | None = None,
                 on_registered: Callable[[str], None] | None = None,
                 on_lease_renewed: Callable[[str, float], None] | None = None,
                 on_lease_lost: Callable[[str, str], None] | None = None) -> None:
        self.client = client
        self.request = request
        self.load_callback = load_callback
        self.on_registered = on_registered
        self.on_lease_renewed = on_lease_renewed
        self.on_lease_lost = on_lease_lost
        self.lease_id = ""
        # The directory process that granted the lease; another one in a renewal means it restarted.
        self.directory_incarnation_id = ""
        self.ttl_s = 10.0
        # Monotonic time until which the directory surely holds this lease: the send time of the last accepted
        # registration or renewal + ttl (the directory counts from its receipt, later). 0: none held. A worker
        # that must act only under its lease (a prefill worker posting WRITEs) checks it with `holds_lease`.
        self.valid_until = 0.0
        self.renewal_count = 0
        self.registration_count = 0
        self._task: asyncio.Task | None = None
        self._stopping = asyncio.Event()
        self._registered = asyncio.Event()
        self._renew_now = asyncio.Event()

    @property
    def engine_id(self) -> str:
        """The registered engine id."""
        return self.request.engine_id

    @property
    def tp_rank(self) -> int:
        """The registered rank."""
        return self.request.tp_rank

    async def start(self) -> str:
        """Register and start the keep-alive; returns the lease id."""
        await self._register()
        self._task = asyncio.create_task(self._keep_alive(), name=f"kvpush-lease-{self.engine_id}-{self.tp_rank}")
        return self.lease_id

    async def wait_registered(self, timeout_s: float) -> str:
        """Wait (bounded) until a lease is held; returns its id."""
        await asyncio.wait_for(self._registered.wait(), timeout_s)
        return self.lease_id

    def holds_lease(self, registration_count: int, margin_s: float = 0.0) -> bool:
        """True while the lease granted by registration number `registration_count` is surely still held.

        Thread-safe (reads two numbers). False once a later registration replaced it (the directory had
        forgotten or dropped it) or once `valid_until - margin_s` passed without a renewal.
        """
        return (registration_count == self.registration_count
                and time.monotonic() < self.valid_until - margin_s)

    async def _register(self) -> None:
        sent = time.monotonic()
        response = await self.client.register_engine(self.request)
        self.lease_id = response.lease_id
        self.directory_incarnation_id = incarnation_of(response)
        self.ttl_s = response.ttl.ToNanoseconds() / 1e9 or self.ttl_s
        self.registration_count += 1  # first: a write of the previous lease checks the count, then the time
        self.valid_until = sent + self.ttl_s
        self._registered.set()
        log.info("engine registered", engine_id=self.engine_id, tp_rank=self.tp_rank, ttl_s=self.ttl_s)
        if self.on_registered is not None:
            self.on_registered(self.lease_id)

    def _lost(self, reason: str) -> None:
        if not self._registered.is_set():
            return
        self._registered.clear()
        log.warning("lease lost", engine_id=self.engine_id, tp_rank=self.tp_rank, reason=reason)
        if self.on_lease_lost is not None:
            self.on_lease_lost(self.lease_id, reason)

    def request_renewal(self) -> None:
        """Renew now instead of at the next ttl/3 tick (e.g. after a hello was refused NOT_FOUND)."""
        self._renew_now.set()

    async def _sleep(self, seconds: float) -> bool:
        """Sleep unless stopping or a renewal is requested; True when stop was requested."""
        self._renew_now.clear()
        stop = asyncio.ensure_future(self._stopping.wait())
        poke = asyncio.ensure_future(self._renew_now.wait())
        try:
            await asyncio.wait({stop, poke}, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            poke.cancel()
        return self._stopping.is_set()

    async def _keep_alive(self) -> None:
        loop = asyncio.get_running_loop()
        last_renewal = loop.time()
        attempt = 0
        while not self._stopping.is_set():
            call = self.client.stub.RenewLease(metadata=self.client.config.metadata)
            try:
                while not self._stopping.is_set():
                    load = self.load_callback() if self.load_callback is not None else None
                    request = dpb.RenewLeaseRequest(lease_id=self.lease_id)
                    if load is not None:
                        request.load.CopyFrom(load)
                    sent = time.monotonic()
                    await asyncio.wait_for(call.write(request), self.client.config.timeout_s)
                    response = await asyncio.wait_for(call.read(), self.client.config.timeout_s)
                    if response is grpc.aio.EOF:
                        raise DirectoryCallError("RenewLease", await call.code(), await call.details() or "")
                    # (Replicas share leases through etcd: another replica renewing ours is a takeover.)
                    renewed_by = incarnation_of(response)
                    if (renewed_by and self.directory_incarnation_id and len(self.client.addresses) == 1
                            and renewed_by != self.directory_incarnation_id):
                        # Another process renewed a lease it never granted: treat it as forgotten.
                        raise DirectoryCallError("RenewLease", grpc.StatusCode.NOT_FOUND, "the directory restarted")
                    last_renewal = loop.time()
                    attempt = 0
                    self.renewal_count += 1
                    self.ttl_s = response.ttl.ToNanoseconds() / 1e9 or self.ttl_s
                    self.valid_until = sent + self.ttl_s
                    self._registered.set()
                    if self.on_lease_renewed is not None:
                        self.on_lease_renewed(self.lease_id, self.ttl_s)
                    if await self._sleep(self.ttl_s / 3):
                        break
            except (TimeoutError, grpc.aio.AioRpcError, DirectoryCallError, asyncio.InvalidStateError) as error:
                code = error.code() if isinstance(error, grpc.aio.AioRpcError) else getattr(
                    error, "code", grpc.StatusCode.DEADLINE_EXCEEDED)
                if code == grpc.StatusCode.NOT_FOUND:
                    self.valid_until = 0.0
                    self._lost("lease unknown to the directory")
                    try:
                        await self._register()
                        last_renewal = loop.time()
                        continue
                    except DirectoryCallError as register_error:
                        log.warning("re-registration failed", engine_id=self.engine_id, error=str(register_error))
                elif loop.time() - last_renewal > self.ttl_s:
                    self._lost(f"no renewal for {self.ttl_s}s ({code.name})")
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    # Replicas: renew on the next one; it takes over keeping the (etcd) lease alive.
                    self.client.move_home()
                delay = self.client.config.backoff_s(min(attempt, 10)) + 0.05
                attempt += 1
                if await self._sleep(delay):
                    break
            finally:
                call.cancel()

    async def stop(self, deregister: bool = True) -> None:
        """Stop renewing; deregister unless told not to (errors while deregistering are logged)."""
        self._stopping.set()
        if self._task is not None:
            await self._task
            self._task = None
        if deregister and self.lease_id:
            try:
                await self.client.deregister_engine(self.engine_id, self.tp_rank, self.lease_id)
            except DirectoryCallError as error:
                log.info("deregistration failed", engine_id=self.engine_id, error=str(error))
