"""The decode worker after a watch gap: a transfer the directory no longer knows fails at once.

A real directory (grpc.aio on loopback) and the real DirectoryLink: after a restart GetTransfer answers
NOT_FOUND for every transfer of the old process, and no event will ever come for them.
"""

from __future__ import annotations

import asyncio
import threading
import time

from kvpush.connector.config import ConnectorConfig
from kvpush.connector.directory_link import DirectoryLink
from kvpush.connector.metadata import KVPushMetadata, ReceiveStart
from kvpush.connector.worker.decode import DecodeWorker
from kvpush.services.directory.server import DirectoryConfig, create_server


def test_a_gap_fails_receives_whose_transfer_the_directory_forgot():
    """on_gap -> GetTransfer NOT_FOUND -> the receive ends with its blocks as load errors, well before its deadline."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        server, port = create_server(DirectoryConfig(host="127.0.0.1", port=0))
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    config = ConnectorConfig.from_extra_config({"directory_address": f"127.0.0.1:{port}"}, role="decode",
                                               engine_id="d1")
    link = DirectoryLink(config)
    try:
        worker = DecodeWorker(config, link, block_size_tokens=16)
        worker.begin_step(KVPushMetadata(receives=[ReceiveStart("r1", "forgotten-transfer", (1, 2), 32, 0)]))
        worker.on_gap(0)
        deadline = time.monotonic() + 10
        finished, failed_blocks = set(), set()
        while time.monotonic() < deadline and "r1" not in finished:
            done, failed = worker.collect()
            finished |= done
            failed_blocks |= failed
            time.sleep(0.02)
        assert "r1" in finished and failed_blocks == {1, 2}
        assert worker.failed_count == 1
    finally:
        link.close()
        asyncio.run_coroutine_threadsafe(server.stop(0.2), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
