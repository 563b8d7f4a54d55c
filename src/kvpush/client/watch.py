"""`watch_transfers`: a decode engine's terminal transfer events, across reconnects.

Life cycle: open WatchTransfers after the last sequence number seen, naming the directory
incarnation it was counted in; yield each event; when the stream ends or breaks (directory restart,
max connection age, network), wait with backoff and reopen after the last sequence number, so no
retained event is missed or repeated.
A gap: OUT_OF_RANGE (events were dropped, or the directory restarted: the server compares the
incarnation id, whatever the sequence numbers say) or a greeting from a new incarnation calls
`on_gap(last_sequence_number)` so the caller re-reads its live transfers with GetTransfer (a
restarted directory answers NOT_FOUND: they are gone), then replays every event the directory
retained (`replay_retained`), so a new process's first events are delivered too; without
`on_gap` it raises `DirectoryCallError`.
INVALID_ARGUMENT, UNAUTHENTICATED and PERMISSION_DENIED raise; other codes (UNAVAILABLE,
NOT_FOUND while the engine re-registers, ...) are retried.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import grpc

from kvpush.client.client import incarnation_of
from kvpush.client.errors import DirectoryCallError
from kvpush.observability import get_logger
from kvpush.v1 import directory_pb2 as dpb

if TYPE_CHECKING:
    from kvpush.client.client import DirectoryClient

log = get_logger("client.watch")
_FATAL = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED,
                    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED})


async def watch_transfers(client: DirectoryClient, engine_id: str, after_sequence_number: int = 0,
                          on_gap: Callable[[int], None] | None = None) -> AsyncIterator[dpb.TransferEvent]:
    """Yield TransferEvents of `engine_id` in order, forever; reconnects and resumes (module docstring).

    A replicated directory: every replica is watched and their events merged (`replicas.watch_replicas`;
    sequence numbers are then per replica, so `after_sequence_number` must be 0).
    """
    from kvpush.client.replicas import replica_addresses, watch_replicas

    try:
        replicated = bool(await replica_addresses(client))
    except DirectoryCallError:
        replicated = False  # unreachable now: the single-stream watch retries on its own
    stream = (watch_replicas(client, engine_id, on_gap) if replicated and not after_sequence_number
              else watch_one(client, engine_id, after_sequence_number, on_gap))
    async for event in stream:
        yield event


async def watch_one(client: DirectoryClient, engine_id: str, after_sequence_number: int = 0,
                    on_gap: Callable[[int], None] | None = None,
                    address: str | None = None) -> AsyncIterator[dpb.TransferEvent]:
    """The events of one directory process (`address`, default the client's home one), resumed across breaks."""
    last = after_sequence_number
    attempt = 0
    incarnation = ""  # the directory process `last` counts events of ("" before the first greeting)
    replay = False    # after a gap: replay everything the directory retained
    gap_incarnation = ""  # the incarnation a gap was seen in (same one again: only the gap, no restart)
    while True:
        stub = client.stub if address is None else client.stub_for(address)
        call = stub.WatchTransfers(
            dpb.WatchTransfersRequest(engine_id=engine_id, after_sequence_number=0 if replay else last,
                                      directory_incarnation_id="" if replay else incarnation,
                                      replay_retained=replay),
            metadata=client.config.metadata)
        restarted = False
        try:
            async for response in call:
                attempt = 0
                current = incarnation_of(response)
                if current and current != incarnation:
                    if replay:
                        if current != gap_incarnation:
                            last = 0  # a new process numbers from 1: every event it has is new to us
                        replay = False
                    elif incarnation:
                        # A restart the sequence numbers hid (the new process is ahead): re-read, then replay.
                        restarted = True
                        break
                    incarnation = current
                for event in response.events:
                    if event.sequence_number <= last:
                        continue
                    last = event.sequence_number
                    yield event
            if restarted:
                code, details = grpc.StatusCode.OUT_OF_RANGE, "the directory restarted (new incarnation id)"
            else:
                code, details = await call.code(), await call.details()
        except grpc.aio.AioRpcError as error:
            code, details = error.code(), error.details() or ""
        finally:
            call.cancel()
        if code == grpc.StatusCode.OUT_OF_RANGE:
            if on_gap is None:
                raise DirectoryCallError("WatchTransfers", code, details)
            log.warning("watch gap; re-read transfers", engine_id=engine_id, after_sequence_number=last,
                        details=details)
            on_gap(last)
            gap_incarnation = "" if restarted else incarnation
            incarnation = ""
            replay = True
            continue
        if code in _FATAL:
            raise DirectoryCallError("WatchTransfers", code, details)
        delay = client.config.backoff_s(min(attempt, 10)) + (0.05 if attempt else 0)
        attempt += 1
        log.info("watch stream ended; reconnecting", engine_id=engine_id, code=code.name, details=details,
                 after_sequence_number=last, delay_s=round(delay, 3))
        await asyncio.sleep(delay)
