"""The connector's only gRPC: a thin layer over the client library's `SyncDirectoryClient`.

Life cycle (one `DirectoryLink` per process that needs the directory):
  1. Construction starts the client's private event-loop thread (no connection yet).
  2. Scheduler process (decode): `report_allocation` / `cancel_transfer` submit and return at once;
     refusals come back through a callback on the client thread. `watch_prefill_start` follows a transfer
     until its prefill started (the directory saw its first readiness) or it ended, on the client thread.
  3. Worker process: `register` (blocking, bounded; engine start-up only) returns the registration
     whose lease the client renews; prefill workers then `open_prefill_session`, decode workers
     `watch` their transfer events. Callbacks run on the client thread and must never wait (the
     prefill worker's post to its push owner on the NIXL I/O thread).
  4. `close()` stops streams and the loop thread (bounded), deregistering the worker.
No engine thread ever waits on the network here except at start-up and shutdown.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from kvpush.api import refusals
from kvpush.client.config import ChannelConfig
from kvpush.client.errors import DirectoryCallError
from kvpush.client.lease import EngineRegistration
from kvpush.client.prefill import PrefillSession
from kvpush.client.replicas import ReplicatedPrefillSession
from kvpush.client.sync import SyncDirectoryClient
from kvpush.connector.config import ConnectorConfig
from kvpush.observability import get_logger
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb

_log = get_logger("connector.directory_link")
# An allocation refused that way is retried after these pauses (doubling), until transfer_timeout_s.
_OWNED_RETRY_FIRST_S = 0.005
_OWNED_RETRY_MAX_S = 0.1
# A transfer whose prefill start is watched is read (GetTransfer) again after a tenth of the time it has been watched,
# within these bounds: a leg allocates at most ~10 % (and 100 ms) after its prefill started, and a leg that waits
# seconds behind a queued prefill costs the directory ten reads a second, not fifty.
_PREFILL_START_POLL_MIN_S = 0.01
_PREFILL_START_POLL_MAX_S = 0.1
_TERMINAL_STATES = frozenset({tpb.TRANSFER_STATE_COMPLETE, tpb.TRANSFER_STATE_FAILED, tpb.TRANSFER_STATE_CANCELLED,
                              tpb.TRANSFER_STATE_EXPIRED})


def _blocks_still_owned(error: DirectoryCallError) -> bool:
    return error.code == grpc.StatusCode.FAILED_PRECONDITION and refusals.BLOCK_STILL_OWNED in error.details


class DirectoryLink:
    """One process's connection to the KV-directory (see the module docstring)."""

    def __init__(self, config: ConnectorConfig, thread_name: str = "kvpush-connector-directory") -> None:
        self._config = config
        # The client's loop thread, and the async client whose calls it runs.
        self._loop = SyncDirectoryClient(ChannelConfig.from_dict(config.channel_config_dict()), thread_name)
        self._calls = self._loop.client
        self.registration: EngineRegistration | None = None
        # One directory's session, or (replicated directory) one per replica behind the same interface.
        self.session: PrefillSession | ReplicatedPrefillSession | None = None
        self._watch: concurrent.futures.Future[None] | None = None
        # Transfers whose prefill start is watched (engine thread adds and removes, client thread reads).
        self._start_watches: dict[str, Callable[[str], None]] = {}
        self._start_lock = threading.Lock()

    # ---------------------------------------------------------------- scheduler-side calls (never wait)

    def report_allocation(self, transfer_id: str, block_ids: list[int], prompt_token_count: int,
                          skip_token_count: int, on_refused: Callable[[str], None],
                          block_groups: Sequence[tuple[Sequence[int], int]] = ()) -> None:
        """Submit ReportAllocation for this engine (`skip_token_count`: decode's own prefix hit, not pushed;
        `block_groups`: each KV-cache group's (block ids, first token), several groups only); on_refused(reason)
        runs on the client thread on failure.

        A refusal because a block is still owned by a live transfer is retried (backing off, within
        transfer_timeout_s): decode completes a receive on prefill's notification, which comes once every write
        landed, and vLLM may give its blocks to the next request before prefill's WriteResult reached the directory.
        The directory then still owns them for that transfer, which ends as soon as the result arrives; failing the
        next request meanwhile would make its engine answer it with an error.
        """
        future = self._loop.submit(self._report_when_blocks_free(
            transfer_id, block_ids, prompt_token_count, skip_token_count, block_groups))

        def done(f: concurrent.futures.Future[tpb.Transfer]) -> None:
            error = f.exception()
            if error is not None:
                _log.warning("allocation report refused", transfer_id=transfer_id, error=str(error))
                on_refused(str(error))

        future.add_done_callback(done)

    async def _report_when_blocks_free(self, transfer_id: str, block_ids: list[int], prompt_token_count: int,
                                       skip_token_count: int,
                                       block_groups: Sequence[tuple[Sequence[int], int]]) -> tpb.Transfer:
        deadline = time.monotonic() + self._config.transfer_timeout_s
        pause = _OWNED_RETRY_FIRST_S
        waited = False
        while True:
            try:
                return await self._calls.report_allocation(
                    transfer_id, self._config.engine_id, block_ids, prompt_token_count, skip_token_count,
                    block_groups=block_groups)
            except DirectoryCallError as error:
                if not _blocks_still_owned(error) or time.monotonic() + pause > deadline:
                    raise
                if not waited:
                    waited = True
                    _log.info("allocation waits for the directory to release blocks of an ended receive",
                              transfer_id=transfer_id, reason=error.details)
            await asyncio.sleep(pause)
            pause = min(2 * pause, _OWNED_RETRY_MAX_S)

    def cancel_transfer(self, transfer_id: str, reason: str,
                        on_done: Callable[[tpb.Transfer | None, str], None] | None = None) -> None:
        """Submit CancelTransfer; on_done(transfer or None, error) runs on the client thread when it returns."""
        future = self._loop.submit(self._calls.cancel_transfer(transfer_id, reason))

        def done(f: concurrent.futures.Future[tpb.Transfer]) -> None:
            error = f.exception()
            if error is not None:
                _log.info("cancel not accepted", transfer_id=transfer_id, error=str(error))
            if on_done is not None:
                on_done(None if error is not None else f.result(), str(error or ""))

        future.add_done_callback(done)

    def watch_prefill_start(self, transfer_id: str, on_started: Callable[[str], None]) -> None:
        """Follow the transfer until its prefill started or it ended; then on_started(transfer_id) runs once on the
        client thread (also when the directory does not know it: a report would be refused, failing the request as
        it would without the wait). Returns at once; a repeat for a watched transfer changes nothing."""
        with self._start_lock:
            if transfer_id in self._start_watches:
                return
            self._start_watches[transfer_id] = on_started
        self._loop.submit(self._await_prefill_start(transfer_id))

    def forget_prefill_start(self, transfer_id: str) -> None:
        """Stop following the transfer (its request allocated or finished); on_started will not run."""
        with self._start_lock:
            self._start_watches.pop(transfer_id, None)

    async def _await_prefill_start(self, transfer_id: str) -> None:
        watched_since = time.monotonic()
        while True:
            with self._start_lock:
                if transfer_id not in self._start_watches:
                    return
            started = False
            try:
                transfer = await self._calls.get_transfer(transfer_id)
                started = transfer.HasField("first_ready_time") or transfer.state in _TERMINAL_STATES
            except DirectoryCallError as error:
                started = error.code == grpc.StatusCode.NOT_FOUND
                if not started:  # the directory is out of reach: the caller's bound lets the request go on
                    _log.debug("prefill start not read", transfer_id=transfer_id, error=str(error))
            if started:
                with self._start_lock:
                    on_started = self._start_watches.pop(transfer_id, None)
                if on_started is not None:
                    on_started(transfer_id)
                return
            waited = time.monotonic() - watched_since
            await asyncio.sleep(min(_PREFILL_START_POLL_MAX_S, max(_PREFILL_START_POLL_MIN_S, waited / 10)))

    def get_transfer(self, transfer_id: str, on_done: Callable[[tpb.Transfer | None, str], None]) -> None:
        """Submit GetTransfer; on_done(transfer or None, error) runs on the client thread."""
        future = self._loop.submit(self._calls.get_transfer(transfer_id))
        future.add_done_callback(
            lambda f: on_done(None, str(f.exception())) if f.exception() else on_done(f.result(), ""))

    # ---------------------------------------------------------------- worker start-up and streams

    def register(self, role: tpb.EngineRole, tp_rank: int, tp_size: int, agent_name: str, agent_metadata: bytes,
                 layout: tpb.KVLayout, on_lease_lost: Callable[[str, str], None] | None = None, model: str = "",
                 load_callback: Callable[[], tpb.EngineLoad | None] | None = None,
                 forces_first_token: bool = False) -> EngineRegistration:
        """Register this worker and keep its lease alive (blocking, bounded by the client's retry budget).

        load_callback (client thread, must not block) gives the load each renewal reports.
        """
        request = dpb.RegisterEngineRequest(
            engine_id=self._config.engine_id, role=role, tp_rank=tp_rank, tp_size=tp_size, agent_name=agent_name,
            agent_metadata=agent_metadata, layout=layout, endpoint=self._config.engine_endpoint, model=model,
            forces_first_token=forces_first_token)
        try:
            self.registration = self._loop.start_registration(request, on_lease_lost=on_lease_lost,
                                                              load_callback=load_callback)
        except (DirectoryCallError, TimeoutError) as exc:
            raise RuntimeError(
                f"kvpush: cannot register engine {self._config.engine_id!r} rank {tp_rank} with the directory at "
                f"{self._config.directory_address}: {exc}") from exc
        return self.registration

    def open_prefill_session(self, on_instruction: Callable[[dpb.PushInstruction], None],
                             on_cancellation: Callable[[dpb.Cancellation], None],
                             on_rejection: Callable[[dpb.EventRejection], None],
                             on_session_reset: Callable[..., None],
                             on_peer: Callable[[dpb.PeerAnnouncement], None] | None = None,
                             ) -> PrefillSession | ReplicatedPrefillSession:
        """Open the StreamPrefill session of this (registered) prefill worker.

        on_peer hears of each decode worker this one may push to (to load it ahead of the first instruction).

        on_session_reset runs when the directory dropped the transfers this worker had begun: the stream
        reconnected (the directory failed them), or the directory restarted (a new incarnation forgot them).
        """
        assert self.registration is not None, "register() first"
        self.session = self._loop.open_prefill_session(
            self.registration, on_instruction=on_instruction, on_cancellation=on_cancellation,
            on_rejection=on_rejection, on_peer=on_peer, on_reconnect=on_session_reset,
            on_directory_restart=lambda incarnation_id: on_session_reset(),
            # Replicas: one replica's session broke; only the transfers it carried are concerned.
            on_replica_reset=lambda concerns: on_session_reset(concerns))
        return self.session

    def watch(self, on_event: Callable[[dpb.TransferEvent], None], on_gap: Callable[[int], None]) -> None:
        """Follow this decode engine's terminal transfer events (callbacks on the client thread)."""
        self._watch = self._loop.watch(self._config.engine_id, on_event, on_gap=on_gap)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop streams, deregister and stop the client thread (each step bounded)."""
        with self._start_lock:
            self._start_watches.clear()
        if self._watch is not None:
            self._watch.cancel()
        try:
            if self.session is not None:
                self._loop.run(self.session.stop(timeout_s), timeout_s + 1)
            if self.registration is not None:
                self._loop.run(self.registration.stop(), timeout_s + 1)
        except Exception as exc:  # shutdown is best effort: the lease lapses on its own
            _log.info("directory link shutdown incomplete", error=str(exc))
        finally:
            self._loop.close(timeout_s)
