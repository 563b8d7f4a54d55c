"""Streams against a replicated directory (docs/directory-replicas.md): one per replica, routed by shard.

Each replica dispatches, cancels and reports only the transfers of the shards it serves, so a prefill
worker holds a StreamPrefill session with EVERY replica and a decode engine watches every replica.

- `replica_addresses(client)`: the replicas' addresses (GetReplicas, which also teaches the client every
  shard's owner), or [] for a directory without replicas (then the plain streams are used).
- `ReplicatedPrefillSession`: the `PrefillSession` API over one session per replica. Readiness and results
  are queued here and handed to the session of the replica serving the transfer's shard (by the shard map,
  refreshed every `refresh_s` and whenever a session breaks or a replica refuses an event naming another
  owner); an item whose owner has no connected session waits (bounded by the queue) until one connects or
  the shard moves. An event a replica refuses naming another owner is sent again there (not reported).
  Callbacks are those of `PrefillSession`, plus `on_replica_reset(concerns)`: a replica's session broke
  while it carried unfinished transfers (their owner may fail or adopt them): `concerns(transfer_id)` says
  which; the caller stops those that were dispatched and announces the others again. Without it,
  `on_reconnect()` runs instead (every transfer of the worker). Nothing runs for a drained replica.
- `watch_replicas(...)`: every replica's terminal events merged into one iterator; a transfer's first
  terminal event only (a successor may report a transfer again after its owner died).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Iterable

import grpc

from kvpush.api.shards import SHARD_NOT_OWNED, redirect_of_status, shard_of
from kvpush.client.client import DirectoryClient
from kvpush.client.errors import DirectoryCallError
from kvpush.client.lease import EngineRegistration
from kvpush.client.prefill import PrefillSession
from kvpush.observability import get_logger
from kvpush.v1 import directory_pb2 as dpb

log = get_logger("client.replicas")
# Transfer ids whose terminal event was delivered, remembered to drop a successor's repeat.
_DELIVERED_MEMORY = 100_000


async def replica_addresses(client: DirectoryClient) -> list[str]:
    """Addresses of the directory's replicas; [] when it is one process (or predates replicas)."""
    try:
        response = await client.get_replicas()
    except DirectoryCallError as error:
        if error.code == grpc.StatusCode.UNIMPLEMENTED:
            return []
        raise
    if not response.replica_id:
        return []
    return [r.address for r in response.replicas if r.address]


class _Replica:
    """One replica's session and what it carries."""

    def __init__(self, session: PrefillSession, client: DirectoryClient) -> None:
        self.session = session
        self.client = client
        # Transfers this session got an instruction for or readiness of, not finished yet, with what was sent
        # for each (resent to the right replica when this one answers that another serves the shard).
        self.carried: dict[str, list] = {}


class ReplicatedPrefillSession:
    """A prefill worker's sessions with every replica (module docstring); the `PrefillSession` API."""

    def __init__(self, client: DirectoryClient, registration: EngineRegistration,
                 on_instruction: Callable[[dpb.PushInstruction], None] | None = None,
                 on_cancellation: Callable[[dpb.Cancellation], None] | None = None,
                 on_rejection: Callable[[dpb.EventRejection], None] | None = None,
                 on_reconnect: Callable[[], None] | None = None,
                 on_directory_restart: Callable[[str], None] | None = None,
                 on_replica_reset: Callable[[Callable[[str], bool]], None] | None = None,
                 refresh_s: float = 1.0, max_queued: int = 1_000_000,
                 on_peer: Callable[[dpb.PeerAnnouncement], None] | None = None) -> None:
        self.client = client
        self.registration = registration
        self.on_instruction = on_instruction
        # Every replica announces the decode workers it knows of: the callee takes each agent once.
        self.on_peer = on_peer
        self.on_cancellation = on_cancellation
        self.on_rejection = on_rejection
        self.on_reconnect = on_reconnect
        self.on_directory_restart = on_directory_restart
        self.on_replica_reset = on_replica_reset
        self.refresh_s = refresh_s
        self.max_queued = max_queued
        self.replicas: dict[str, _Replica] = {}
        self.fatal_error = ""
        self._queue: deque[dpb.LayerReady | dpb.WriteResult] = deque()
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._tasks: list[asyncio.Task[None]] = []
        # Sessions of replicas learnt while routing, started without waiting; referenced until started.
        self._starting: set[asyncio.Task[None]] = set()
        self._stopping = False

    @property
    def connected(self) -> bool:
        """True while every known replica has a connected session."""
        return bool(self.replicas) and all(r.session.connected for r in self.replicas.values())

    @property
    def queued_message_count(self) -> int:
        """Items waiting here or in a replica's session."""
        return len(self._queue) + sum(r.session.queued_message_count for r in self.replicas.values())

    async def start(self, timeout_s: float | None = None) -> None:
        """Open a session with every replica now known (bounded), then keep routing and refreshing."""
        await self._refresh()
        started = await asyncio.gather(*(r.session.start(timeout_s) for r in self.replicas.values()),
                                       return_exceptions=True)
        failed = [a for a, outcome in zip(self.replicas, started) if isinstance(outcome, BaseException)]
        if failed and len(failed) == len(started):
            raise ConnectionError(f"no directory replica accepted a prefill session: {failed}")
        if failed:  # those sessions keep reconnecting; their shards' items wait meanwhile
            log.warning("some directory replicas are not reachable yet", addresses=failed)
        self._tasks = [asyncio.create_task(self._route(), name="kvpush-prefill-route"),
                       asyncio.create_task(self._refresh_forever(), name="kvpush-prefill-replicas")]

    async def _refresh(self) -> None:
        for address in await replica_addresses(self.client):
            if address not in self.replicas:
                self._add(address)

    def _add(self, address: str) -> _Replica:
        client = DirectoryClient(dataclasses.replace(self.client.config, address=address, max_attempts=2))
        replica: _Replica | None = None

        def instructed(instruction: dpb.PushInstruction) -> None:
            assert replica is not None  # set below, before the session can call back
            replica.carried.setdefault(instruction.transfer_id, [])
            if self.on_instruction is not None:
                self.on_instruction(instruction)

        def rejected(rejection: dpb.EventRejection) -> None:
            redirect = redirect_of_status(rejection.status)
            if redirect is not None:  # not refused: sent to the wrong replica; send it again to the owner
                self.client.learn(redirect)
                assert replica is not None  # set below, before the session can call back
                sent = replica.carried.pop(rejection.transfer_id, None)
                if sent:
                    self._queue.extendleft(reversed(sent))
                self._wake.set()
                return
            if self.on_rejection is not None:
                self.on_rejection(rejection)

        def reconnected() -> None:
            self._session_broke(address)

        def restarted(incarnation_id: str) -> None:
            self._session_broke(address)

        session = PrefillSession(client, self.registration, on_instruction=instructed,
                                 on_cancellation=self.on_cancellation, on_rejection=rejected,
                                 on_reconnect=reconnected, on_directory_restart=restarted,
                                 on_disconnect=reconnected, on_peer=self.on_peer)
        replica = self.replicas[address] = _Replica(session, client)
        return replica

    def _session_broke(self, address: str) -> None:
        """A replica's stream ended: the transfers it carried may be failed (or adopted) by their owner.

        The caller hears of those only (`on_replica_reset(concerns)`; without it `on_reconnect()`, which
        means every transfer of the worker), so it stops the dispatched ones and announces the others again,
        which then reach the shard's new owner.
        """
        replica = self.replicas[address]
        carried, replica.carried = replica.carried, {}
        self._wake.set()
        if not carried:
            return
        log.info("replica session reset with transfers in flight", address=address, transfer_count=len(carried))
        if self.on_replica_reset is not None:
            self.on_replica_reset(frozenset(carried).__contains__)
        elif self.on_reconnect is not None:
            self.on_reconnect()

    async def _refresh_forever(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.refresh_s)
            try:
                before = set(self.replicas)
                await self._refresh()
                for address in set(self.replicas) - before:
                    await self.replicas[address].session.start()
                self._wake.set()
            except (TimeoutError, DirectoryCallError, grpc.aio.AioRpcError) as error:
                log.info("replica refresh failed", error=str(error))

    def send_ready(self, events: Iterable[dpb.LayerReady]) -> None:
        """Queue readiness events (any thread); each goes to its transfer's replica."""
        self._enqueue(list(events))

    def send_result(self, result: dpb.WriteResult) -> None:
        """Queue a write result (any thread)."""
        self._enqueue([result])

    def _enqueue(self, items: list) -> None:
        if threading.get_ident() != self._loop_thread:
            self._loop.call_soon_threadsafe(self._enqueue, items)
            return
        if len(self._queue) + len(items) > self.max_queued:
            log.warning("replicated prefill queue full; items dropped", dropped_count=len(items))
            return
        self._queue.extend(items)
        self._wake.set()

    async def _route(self) -> None:
        """Hand each queued item to the connected session of its transfer's replica, in order per replica."""
        while not self._stopping:
            await self._wake.wait()
            self._wake.clear()
            waiting: deque = deque()
            while self._queue:
                item = self._queue.popleft()
                address = self.client.owner_address(item.transfer_id)  # None: between owners, wait
                replica = self.replicas.get(address) if address else None
                if replica is None and address:
                    replica = self._add(address)
                    starting = asyncio.ensure_future(replica.session.start())
                    self._starting.add(starting)
                    starting.add_done_callback(self._starting.discard)
                if replica is None or not replica.session.connected:
                    waiting.append(item)
                    continue
                if isinstance(item, dpb.WriteResult):
                    if item.status != dpb.WRITE_RESULT_STATUS_PROGRESS:
                        replica.carried.pop(item.transfer_id, None)
                    else:
                        replica.carried.setdefault(item.transfer_id, []).append(item)
                    replica.session.send_result(item)
                else:
                    replica.carried.setdefault(item.transfer_id, []).append(item)
                    replica.session.send_ready([item])
            self._queue = waiting
            if waiting:  # retried when a session connects or the map is refreshed
                await asyncio.sleep(0.05)
                self._wake.set()

    async def stop(self, timeout_s: float | None = None) -> None:
        """Flush and end every session (bounded)."""
        self._stopping = True
        self._wake.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*(r.session.stop(timeout_s) for r in self.replicas.values()), return_exceptions=True)
        for replica in self.replicas.values():
            await replica.client.close()


async def watch_replicas(client: DirectoryClient, engine_id: str, on_gap: Callable[[int], None] | None,
                         refresh_s: float = 2.0) -> AsyncIterator[dpb.TransferEvent]:
    """Every replica's terminal events of `engine_id`, merged; each transfer's first one only."""
    from kvpush.client.watch import watch_one

    queue: asyncio.Queue = asyncio.Queue()
    watchers: dict[str, asyncio.Task] = {}
    delivered: OrderedDict[str, None] = OrderedDict()

    async def follow(address: str) -> None:
        try:
            async for event in watch_one(client, engine_id, 0, on_gap, address=address):
                await queue.put(event)
        except Exception as error:  # a fatal refusal: surface it through the merged iterator
            await queue.put(error)

    async def refresh() -> None:
        while True:
            try:
                for address in await replica_addresses(client):
                    if address not in watchers:
                        watchers[address] = asyncio.create_task(follow(address))
            except (TimeoutError, DirectoryCallError) as error:
                log.info("replica refresh failed", error=str(error))
            await asyncio.sleep(refresh_s)

    refresher = asyncio.create_task(refresh())
    try:
        while True:
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item.transfer_id in delivered:
                continue
            delivered[item.transfer_id] = None
            if len(delivered) > _DELIVERED_MEMORY:
                delivered.popitem(last=False)
            yield item
    finally:
        refresher.cancel()
        for task in watchers.values():
            task.cancel()


__all__ = ["SHARD_NOT_OWNED", "ReplicatedPrefillSession", "replica_addresses", "shard_of", "watch_replicas"]
