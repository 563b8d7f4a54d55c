"""Small async helpers for directory integration tests (real channels, bounded waits)."""

from __future__ import annotations

import asyncio

import grpc

from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import directory_pb2_grpc as dgrpc

WAIT_S = 10.0


def run(coro, timeout_s: float = 60.0):
    """Run one test coroutine on a fresh loop, bounded."""
    async def bounded():
        return await asyncio.wait_for(coro, timeout_s)

    return asyncio.run(bounded())


def stub(address: str, token: str = "") -> tuple[grpc.aio.Channel, dgrpc.KVDirectoryServiceStub]:
    """A raw stub on a new insecure channel."""
    channel = grpc.aio.insecure_channel(address)
    return channel, dgrpc.KVDirectoryServiceStub(channel)


async def read(call, timeout_s: float = WAIT_S):
    """Read the next message from a stream call, bounded, skipping the greeting every stream opens with and
    StreamPrefill's peer announcements.

    The greetings (a StreamPrefill `opened`, the first, empty WatchTransfers response) only name the
    directory's incarnation; tests that check them or the announcements read with `call.read()` directly.
    """
    async def next_message():
        while True:
            message = await call.read()
            if isinstance(message, dpb.StreamPrefillResponse) and message.WhichOneof("message") in ("opened", "peer"):
                continue
            if isinstance(message, dpb.WatchTransfersResponse) and not message.events:
                continue
            return message

    return await asyncio.wait_for(next_message(), timeout_s)


async def code_of(awaitable) -> grpc.StatusCode:
    """The status code a unary call ends with (OK when it succeeds)."""
    try:
        await awaitable
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


async def open_prefill(stub_: dgrpc.KVDirectoryServiceStub, engine_id: str, lease_id: str, tp_rank: int = 0):
    """A StreamPrefill call with its hello sent."""
    call = stub_.StreamPrefill()
    await call.write(dpb.StreamPrefillRequest(hello=dpb.Hello(engine_id=engine_id, tp_rank=tp_rank,
                                                              lease_id=lease_id)))
    return call


async def send_ready(call, *events) -> None:
    """Write one readiness batch."""
    await call.write(dpb.StreamPrefillRequest(ready=dpb.LayerReadyBatch(events=list(events))))
