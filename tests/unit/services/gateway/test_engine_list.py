"""The gateway's registered-engine list (model checks, /tokenize, free blocks) is re-read off the request path.

A real directory process; the router in this process. Only the first read is waited for: after it, a request
that finds the list old is answered from it while one read runs in the background, so no request pays a
ListEngines round trip before PlanTransfer.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from kvpush.client import ChannelConfig, SyncDirectoryClient
from kvpush.gateway import routing
from kvpush.gateway.config import GatewayConfig
from kvpush.gateway.errors import GatewayError
from kvpush.localstack.processes import start_directory
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb
from tests.unit.services.gateway.test_gateway import _layout


@pytest.fixture
def directory(tmp_path):
    handle = start_directory(tmp_path)
    client = SyncDirectoryClient(ChannelConfig(address=handle.address, timeout_s=5.0))
    yield handle, client
    client.close()
    handle.process.stop(grace_s=5.0)


def _register(client: SyncDirectoryClient, model: str) -> None:
    for role, name in ((tpb.ENGINE_ROLE_PREFILL, "prefill"), (tpb.ENGINE_ROLE_DECODE, "decode")):
        client.start_registration(dpb.RegisterEngineRequest(
            engine_id=f"{model}-{name}", role=role, tp_rank=0, tp_size=1, agent_name=f"agent-{model}-{name}",
            agent_metadata=b"metadata", layout=_layout(), endpoint=f"http://127.0.0.1:1/{model}-{name}", model=model))


def test_an_old_engine_list_is_used_while_it_is_read_again_in_the_background(directory, monkeypatch):
    handle, client = directory
    _register(client, "tiny")
    monkeypatch.setattr(routing, "ENGINE_CACHE_S", 0.0)  # every request finds the list old
    router = routing.DirectoryRouter(GatewayConfig(directory_address=handle.address))

    async def scenario() -> int:
        try:
            route = await router.plan("r1", 16, "", model="tiny")  # the first read is waited for
            assert route.extra["prefill_engine_id"] == "tiny-prefill"
            _register(client, "other")
            # The list in hand predates "other": the request is answered from it (404), not after a new read.
            with pytest.raises(GatewayError) as refused:
                await router.plan("r2", 16, "", model="other")
            assert refused.value.status == 404 and "'other'" in refused.value.message
            deadline = time.monotonic() + 10.0
            while True:  # the background read lands (bounded)
                await asyncio.sleep(0.05)
                try:
                    route = await router.plan("r3", 16, "", model="other")
                    return len(route.transfer_id)
                except GatewayError as error:
                    assert error.status == 404, error.message
                    if time.monotonic() > deadline:
                        raise
        finally:
            await router.close()

    assert asyncio.run(scenario()) > 0
    planned = {t.prefill_engine_id for t in client.list_transfers(limit=10)}
    assert planned == {"tiny-prefill", "other-prefill"}

