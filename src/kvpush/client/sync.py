"""`SyncDirectoryClient`: the async client on a private event-loop thread, for threaded callers.

The vLLM connector's only gRPC lives here: engine threads never touch a channel. Life cycle:
construction starts a daemon thread running its own event loop and builds a `DirectoryClient`
on it; blocking methods run one coroutine there and wait with a deadline; `submit(coro)` returns
a `concurrent.futures.Future` for fire-and-forget use; `close()` stops everything (bounded).

Streams: `start_registration()` and `open_prefill_session()` build `EngineRegistration` and
`PrefillSession` on the loop (their callbacks run on the loop thread; keep them short, hand work
to your own queues). `PrefillSession.send_ready/send_result` may be called from any thread.
`watch(engine_id, callback)` runs `watch_transfers` on the loop and calls `callback(event)` there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from kvpush.client.client import DirectoryClient
from kvpush.client.config import ChannelConfig
from kvpush.client.errors import DirectoryCallError
from kvpush.client.lease import EngineRegistration
from kvpush.client.prefill import PrefillSession
from kvpush.client.replicas import ReplicatedPrefillSession, replica_addresses
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb

T = TypeVar("T")


class SyncDirectoryClient:
    """Blocking facade over `DirectoryClient`, which runs on a private loop thread."""

    def __init__(self, config: ChannelConfig | None = None, thread_name: str = "kvpush-directory-client") -> None:
        self.config = config or ChannelConfig.from_env()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name=thread_name, daemon=True)
        self._thread.start()
        self.client: DirectoryClient = self.run(self._make_client(), timeout_s=10.0)
        self._closed = False

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def _make_client(self) -> DirectoryClient:
        return DirectoryClient(self.config)

    # ---------------------------------------------------------------- running coroutines

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule a coroutine on the client loop; returns its future (never blocks)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run a coroutine on the client loop and wait for it, at most `timeout_s` (default: a whole retry budget)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("SyncDirectoryClient.run called from its own loop thread (would deadlock)")
        budget = timeout_s or self.config.timeout_s * self.config.max_attempts + self.config.backoff_max_s * 2
        future = self.submit(coro)
        try:
            return future.result(budget)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"directory call did not finish within {budget}s") from None

    # ---------------------------------------------------------------- blocking calls

    def register_engine(self, request: dpb.RegisterEngineRequest) -> dpb.RegisterEngineResponse:
        """Blocking `DirectoryClient.register_engine`."""
        return self.run(self.client.register_engine(request))

    def deregister_engine(self, engine_id: str, tp_rank: int, lease_id: str) -> None:
        """Blocking `DirectoryClient.deregister_engine`."""
        self.run(self.client.deregister_engine(engine_id, tp_rank, lease_id))

    def plan_transfer(self, **kwargs) -> dpb.PlanTransferResponse:
        """Blocking `DirectoryClient.plan_transfer` (same keyword arguments; pass `client_id`: the calling thread's
        `PLAN_CLIENT_ID` does not reach the client's loop thread)."""
        return self.run(self.client.plan_transfer(**kwargs))

    def report_allocation(self, transfer_id: str, engine_id: str, block_ids: Sequence[int],
                          prompt_token_count: int, skip_token_count: int = 0,
                          block_groups: Sequence[tuple[Sequence[int], int]] = ()) -> tpb.Transfer:
        """Blocking `DirectoryClient.report_allocation`."""
        return self.run(self.client.report_allocation(transfer_id, engine_id, block_ids, prompt_token_count,
                                                      skip_token_count, block_groups=block_groups))

    def cancel_transfer(self, transfer_id: str, reason: str = "") -> tpb.Transfer:
        """Blocking `DirectoryClient.cancel_transfer`."""
        return self.run(self.client.cancel_transfer(transfer_id, reason))

    def report_engine_unreachable(self, engine_id: str, transfer_id: str = "", reason: str = "") -> bool:
        """Blocking `DirectoryClient.report_engine_unreachable`."""
        return self.run(self.client.report_engine_unreachable(engine_id, transfer_id, reason))

    def get_transfer(self, transfer_id: str) -> tpb.Transfer:
        """Blocking `DirectoryClient.get_transfer`."""
        return self.run(self.client.get_transfer(transfer_id))

    def list_transfers(self, **kwargs) -> list[tpb.Transfer]:
        """Blocking `DirectoryClient.list_transfers` (same keyword arguments)."""
        return self.run(self.client.list_transfers(**kwargs))

    def get_engine(self, engine_id: str) -> list[tpb.EngineWorker]:
        """Blocking `DirectoryClient.get_engine`."""
        return self.run(self.client.get_engine(engine_id))

    def list_engines(self, **kwargs) -> list[tpb.EngineWorker]:
        """Blocking `DirectoryClient.list_engines` (same keyword arguments)."""
        return self.run(self.client.list_engines(**kwargs))

    def health(self, service: str = "") -> str:
        """Blocking `DirectoryClient.health`."""
        return self.run(self.client.health(service))

    # ---------------------------------------------------------------- streams

    def start_registration(self, request: dpb.RegisterEngineRequest, **callbacks) -> EngineRegistration:
        """Register and keep the lease alive on the loop; keyword callbacks as `EngineRegistration` takes."""
        async def start() -> EngineRegistration:
            registration = EngineRegistration(self.client, request, **callbacks)
            await registration.start()
            return registration

        return self.run(start())

    def open_prefill_session(self, registration: EngineRegistration,
                             **callbacks: Any) -> PrefillSession | ReplicatedPrefillSession:
        """Open a `PrefillSession` on the loop (a `ReplicatedPrefillSession`, which offers the same interface, where
        the directory is replicated); keyword callbacks and options as it takes."""
        async def start() -> PrefillSession | ReplicatedPrefillSession:
            # A replicated directory: one session per replica, routed by shard (client/replicas.py).
            try:
                replicated = bool(await replica_addresses(self.client))
            except DirectoryCallError:
                replicated = False
            session: PrefillSession | ReplicatedPrefillSession
            if replicated:
                session = ReplicatedPrefillSession(self.client, registration, **callbacks)
            else:
                callbacks.pop("on_replica_reset", None)  # one directory: a reset concerns every transfer
                session = PrefillSession(self.client, registration, **callbacks)
            await session.start()
            return session

        return self.run(start())

    def watch(self, engine_id: str, callback: Callable[[dpb.TransferEvent], None], after_sequence_number: int = 0,
              on_gap: Callable[[int], None] | None = None) -> concurrent.futures.Future[None]:
        """Follow a decode engine's events on the loop, calling `callback(event)` there; cancel the future to stop."""
        async def follow() -> None:
            async for event in self.client.watch_transfers(engine_id, after_sequence_number, on_gap):
                callback(event)

        return self.submit(follow())

    def close(self, timeout_s: float = 5.0) -> None:
        """Close the channel and stop the loop thread (bounded)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.run(self.client.close(), timeout_s)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout_s)

    def __enter__(self) -> SyncDirectoryClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
