"""`watch_transfers`: a decode engine's terminal transfer events, across reconnects.

Life cycle: open WatchTransfers after the last sequence number seen; yield each event; when the
stream ends or breaks (directory restart, max connection age, network), wait with backoff and
reopen after the last sequence number, so no retained event is missed or repeated.
OUT_OF_RANGE (events were dropped, or the directory restarted and its numbering began again)
calls `on_gap(last_sequence_number)` so the caller re-reads its live transfers with
GetTransfer, then follows new events only; without `on_gap` it raises `DirectoryCallError`.
INVALID_ARGUMENT, UNAUTHENTICATED and PERMISSION_DENIED raise; other codes (UNAVAILABLE,
NOT_FOUND while the engine re-registers, ...) are retried.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import grpc

from kvpush.observability import get_logger
from kvpush.services.client.errors import DirectoryCallError
from kvpush.v1 import directory_pb2 as dpb

if TYPE_CHECKING:
    from kvpush.services.client.client import DirectoryClient

log = get_logger("client.watch")
_FATAL = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED,
                    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED})


async def watch_transfers(client: DirectoryClient, engine_id: str, after_sequence_number: int = 0,
                          on_gap: Callable[[int], None] | None = None) -> AsyncIterator[dpb.TransferEvent]:
    """Yield TransferEvents of `engine_id` in order, forever; reconnects and resumes (module docstring)."""
    last = after_sequence_number
    attempt = 0
    while True:
        call = client.stub.WatchTransfers(
            dpb.WatchTransfersRequest(engine_id=engine_id, after_sequence_number=last),
            metadata=client.config.metadata)
        try:
            async for response in call:
                attempt = 0
                for event in response.events:
                    if event.sequence_number <= last:
                        continue
                    last = event.sequence_number
                    yield event
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
            last = 0
            continue
        if code in _FATAL:
            raise DirectoryCallError("WatchTransfers", code, details)
        delay = client.config.backoff_s(min(attempt, 10)) + (0.05 if attempt else 0)
        attempt += 1
        log.info("watch stream ended; reconnecting", engine_id=engine_id, code=code.name, details=details,
                 after_sequence_number=last, delay_s=round(delay, 3))
        await asyncio.sleep(delay)
