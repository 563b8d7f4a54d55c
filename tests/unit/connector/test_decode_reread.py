"""The decode worker after a watch gap: a transfer the directory no longer knows fails once no write can land.

A real directory (grpc.aio on loopback) and the real DirectoryLink: after a restart GetTransfer answers
NOT_FOUND for every transfer of the old process, and no event will ever come for them.
"""

from __future__ import annotations

import asyncio
import threading
import time
import types

from kvpush.connector.config import ConnectorConfig
from kvpush.connector.directory_link import DirectoryLink
from kvpush.connector.metadata import KVPushMetadata, ReceiveStart
from kvpush.connector.worker.decode import DecodeWorker
from kvpush.directory.server import DirectoryConfig, create_server


def test_a_gap_fails_receives_whose_transfer_the_directory_forgot():
    """on_gap -> GetTransfer NOT_FOUND -> the receive fails (blocks as load errors) after lease TTL + max_write_s.

    Prefill's lease under the forgotten directory cannot be renewed: it posts nothing after one TTL, and its
    last write ends within max_write_s; only then may decode reuse the blocks. Well before transfer_timeout_s.
    """
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        server, port = create_server(DirectoryConfig(host="127.0.0.1", port=0))
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    config = ConnectorConfig.from_extra_config({"directory_address": f"127.0.0.1:{port}", "max_write_s": 0.4},
                                               role="decode", engine_id="d1")
    link = DirectoryLink(config)
    link.registration = types.SimpleNamespace(ttl_s=0.6)  # the lease TTL this directory would grant
    try:
        worker = DecodeWorker(config, link, block_size_tokens=16)
        worker.begin_step(KVPushMetadata(receives=[ReceiveStart("r1", "forgotten-transfer", (1, 2), 32, 0)]))
        gap_at = time.monotonic()
        worker.on_gap(0)
        deadline = time.monotonic() + 10
        finished, failed_blocks = set(), set()
        while time.monotonic() < deadline and "r1" not in finished:
            done, failed = worker.collect()
            finished |= done
            failed_blocks |= failed
            time.sleep(0.02)
        assert "r1" in finished and failed_blocks == {1, 2}
        assert time.monotonic() - gap_at >= 1.0  # not before TTL + max_write_s
        assert worker.failed_count == 1
    finally:
        link.registration = None
        link.close()
        asyncio.run_coroutine_threadsafe(server.stop(0.2), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
