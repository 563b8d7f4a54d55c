"""Integration tests of the client library against a real directory on 127.0.0.1."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
import structlog.testing

from kvpush.client import (
    ChannelConfig,
    DirectoryCallError,
    DirectoryClient,
    EngineRegistration,
    PrefillSession,
    SyncDirectoryClient,
)
from kvpush.directory.state import Limits
from kvpush.localstack.processes import free_port
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import DECODE, PREFILL, ready, register_request, result, running_directory
from tests.integration.directory.helpers import run


async def _wait_until(predicate, timeout_s: float = 10.0) -> None:
    """Poll a condition every 20 ms, bounded."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.02)


def test_unary_call_retries_unavailable_until_the_server_is_up():
    """A call made before the directory listens succeeds once it starts (retry with backoff on UNAVAILABLE)."""
    async def body():
        port = free_port()
        client = DirectoryClient(ChannelConfig(address=f"127.0.0.1:{port}", max_attempts=30, backoff_max_s=0.2))
        call = asyncio.create_task(client.register_engine(register_request("p1", PREFILL)))
        await asyncio.sleep(0.4)
        assert not call.done()
        async with running_directory(port=port):
            response = await asyncio.wait_for(call, 15)
            assert response.lease_id
        await client.close()
    run(body())


def test_non_retryable_errors_raise_at_once_with_the_code():
    """NOT_FOUND is not retried: DirectoryCallError carries the code and the server's message."""
    async def body():
        async with running_directory() as directory:
            async with DirectoryClient(ChannelConfig(address=directory.address)) as client:
                with pytest.raises(DirectoryCallError) as caught:
                    await client.get_transfer("ghost")
                assert caught.value.code == grpc.StatusCode.NOT_FOUND and "ghost" in caught.value.details
    run(body())


def test_registration_renews_and_reports_load():
    """EngineRegistration renews every ttl/3 and the reported load reaches the directory."""
    async def body():
        # A 6 s lease: this shared 2-core machine has frozen whole processes for seconds at a time.
        async with running_directory(Limits(lease_ttl_s=6.0)) as directory:
            async with DirectoryClient(ChannelConfig(address=directory.address)) as client:
                renewed = []
                registration = EngineRegistration(
                    client, register_request("d1", DECODE), load_callback=lambda: tpb.EngineLoad(free_block_count=7),
                    on_lease_renewed=lambda lease, ttl: renewed.append(lease))
                await registration.start()
                await _wait_until(lambda: len(renewed) >= 4, timeout_s=30)  # first one at once, then every 2 s
                (worker,) = await client.get_engine("d1")
                assert worker.lease_id == "" and worker.load.free_block_count == 7  # a lease id is never listed
                assert set(renewed) == {registration.lease_id} and registration.registration_count == 1
                await registration.stop()
                with pytest.raises(DirectoryCallError):
                    await client.get_engine("d1")
    run(body())


def test_clients_recover_after_a_directory_restart():
    """After a restart: leases re-register, the prefill session re-hellos, the watch reports the gap, traffic flows."""
    async def body():
        port = free_port()
        config = ChannelConfig(address=f"127.0.0.1:{port}", backoff_max_s=0.2, max_attempts=20)
        limits = Limits(lease_ttl_s=5.0)
        async with running_directory(limits, port=port):
            client = DirectoryClient(config)
            p_reg = EngineRegistration(client, register_request("p1", PREFILL))
            d_reg = EngineRegistration(client, register_request("d1", DECODE))
            await p_reg.start()
            await d_reg.start()
            instructions: asyncio.Queue = asyncio.Queue()
            reconnects = []
            session = PrefillSession(client, p_reg, on_instruction=instructions.put_nowait,
                                     on_reconnect=lambda: reconnects.append(1))
            await session.start()
            gaps = []
            events: asyncio.Queue = asyncio.Queue()

            async def follow():
                async for event in client.watch_transfers("d1", on_gap=gaps.append):
                    events.put_nowait(event)

            watcher = asyncio.create_task(follow())
            await asyncio.sleep(0.2)
            plan = await client.plan_transfer()
            await client.cancel_transfer(plan.transfer.transfer_id)
            assert (await asyncio.wait_for(events.get(), 5)).sequence_number == 1
        old_leases = (p_reg.lease_id, d_reg.lease_id)
        async with running_directory(limits, port=port) as directory:
            await _wait_until(lambda: p_reg.registration_count >= 2 and d_reg.registration_count >= 2
                              and session.connected and reconnects and gaps, timeout_s=20)
            assert (p_reg.lease_id, d_reg.lease_id) != old_leases
            assert {w.engine_id for w in await client.list_engines()} == {"p1", "d1"}
            assert gaps == [1]
            await asyncio.sleep(0.3)  # let the watch re-subscribe
            tid = (await client.plan_transfer()).transfer.transfer_id
            session.send_ready([ready(tid, 0, 4)])
            await client.report_allocation(tid, "d1", [1, 2, 3], 40)
            instruction = await asyncio.wait_for(instructions.get(), 5)
            assert instruction.transfer_id == tid
            session.send_result(result(tid, dpb.WRITE_RESULT_STATUS_DONE, layers=4, bytes_written=1))
            event = await asyncio.wait_for(events.get(), 5)
            assert (event.transfer_id, event.state) == (tid, tpb.TRANSFER_STATE_COMPLETE)
            assert directory.server.state.check_invariants() == []
            watcher.cancel()
            await session.stop()
            await p_reg.stop()
            await d_reg.stop()
            await client.close()
    run(body())


def test_prefill_session_batches_readiness_and_gets_rejections():
    """Readiness sent in bursts arrives as batches; a bad event comes back through on_rejection."""
    async def body():
        async with running_directory() as directory:
            async with DirectoryClient(ChannelConfig(address=directory.address)) as client:
                p_reg = EngineRegistration(client, register_request("p1", PREFILL))
                await p_reg.start()
                await client.register_engine(register_request("d1", DECODE))
                rejections: asyncio.Queue = asyncio.Queue()
                session = PrefillSession(client, p_reg, on_rejection=rejections.put_nowait)
                await session.start()
                tid = (await client.plan_transfer()).transfer.transfer_id
                session.send_ready([ready(tid, layer, layer + 1) for layer in range(4)] + [ready(tid, 9, 10)])
                rejection = await asyncio.wait_for(rejections.get(), 5)
                assert rejection.status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
                assert "layer_end 10" in rejection.status.message
                record = directory.server.state.get_transfer(tid)
                assert record.ready[0][(0, 40)] == 0b1111
                await session.stop()
                await p_reg.stop()
    run(body())


def test_sync_client_from_threads():
    """SyncDirectoryClient serves blocking calls from several threads and runs watch callbacks on its loop."""
    async def body():
        async with running_directory() as directory:
            def scenario():
                with SyncDirectoryClient(ChannelConfig(address=directory.address)) as client:
                    registration = client.start_registration(register_request("d1", DECODE))
                    client.register_engine(register_request("p1", PREFILL))
                    assert client.health() == "SERVING"
                    seen = []
                    got = threading.Event()
                    watch = client.watch("d1", lambda event: (seen.append(event), got.set()))
                    ids = []
                    threads = [threading.Thread(target=lambda: ids.append(
                        client.plan_transfer(request_id="r").transfer.transfer_id)) for _ in range(4)]
                    for thread in threads:
                        thread.start()
                    for thread in threads:
                        thread.join(10)
                    assert len(set(ids)) == 4
                    threading.Event().wait(0.2)  # let the watch subscribe before the event
                    transfer = client.report_allocation(ids[0], "d1", [1, 2, 3], 40)
                    assert transfer.state == tpb.TRANSFER_STATE_ALLOCATED
                    assert client.cancel_transfer(ids[0], "test").state == tpb.TRANSFER_STATE_CANCELLED
                    assert got.wait(5) and seen[0].transfer_id == ids[0]
                    assert len(client.list_transfers(limit=10)) == 4
                    with pytest.raises(DirectoryCallError) as caught:
                        client.get_transfer("ghost")
                    assert caught.value.code == grpc.StatusCode.NOT_FOUND
                    future = client.submit(client.client.get_engine("d1"))
                    assert future.result(5)[0].agent_name == "d1-agent-0"
                    watch.cancel()
                    client.run(registration.stop())

            await asyncio.to_thread(scenario)
    run(body())


def test_streams_survive_max_connection_age():
    """With connections recycled every second, the watch resumes without loss or repeats and the lease stays."""
    async def body():
        async with running_directory(Limits(lease_ttl_s=10), max_connection_age_ms=1000,
                                     max_connection_age_grace_ms=200) as directory:
            config = ChannelConfig(address=directory.address, backoff_max_s=0.1)
            async with DirectoryClient(config) as client:
                registration = EngineRegistration(client, register_request("d1", DECODE))
                await registration.start()
                await client.register_engine(register_request("p1", PREFILL))
                seen: list[int] = []
                cancelled: list[str] = []

                async def follow():
                    async for event in client.watch_transfers("d1"):
                        seen.append(event.sequence_number)

                with structlog.testing.capture_logs() as logs:
                    watcher = asyncio.create_task(follow())
                    await asyncio.sleep(0.3)
                    loop = asyncio.get_running_loop()
                    until = loop.time() + 4.0  # four connection lifetimes
                    while loop.time() < until:
                        tid = (await client.plan_transfer()).transfer.transfer_id
                        await client.cancel_transfer(tid)
                        cancelled.append(tid)
                        await asyncio.sleep(0.05)
                    await _wait_until(lambda: len(seen) == len(cancelled), timeout_s=15)
                reconnects = [e for e in logs if e["event"] == "watch stream ended; reconnecting"]
                assert len(reconnects) >= 2 and reconnects[0]["details"] == "max connection age"
                assert seen == list(range(1, len(cancelled) + 1))  # every event once, in order
                assert registration.registration_count == 1 and registration.renewal_count >= 2
                assert [w.agent_name for w in await client.get_engine("d1")] == ["d1-agent-0"]
                watcher.cancel()
                await registration.stop()
    run(body())
