"""Directory restarts are seen from the incarnation id, whatever the sequence numbers say."""

from __future__ import annotations

import asyncio

import grpc

from kvpush.client import ChannelConfig, DirectoryClient, EngineRegistration, PrefillSession
from kvpush.directory.server import DirectoryConfig, create_server
from kvpush.directory.state import Limits
from kvpush.localstack.processes import free_port
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import DECODE, PREFILL, register_request, running_directory
from tests.integration.directory.helpers import code_of, run, stub
from tests.integration.directory.test_client import _wait_until


def _events_in_state(state, count: int) -> list[str]:
    """Before serving: register p1/d1 in the new process and end `count` transfers (its events 1..count)."""
    state.register(register_request("p1", PREFILL))
    state.register(register_request("d1", DECODE))
    ids = []
    for _ in range(count):
        record = state.plan(dpb.PlanTransferRequest(), None)[0]
        state.cancel(record.transfer_id, "before the old client reconnects")
        ids.append(record.transfer_id)
    return ids


def test_watch_sees_a_restart_even_when_the_new_process_is_ahead():
    """The new process emitted MORE events than the client saw: the client still gets on_gap, then all of them."""
    async def body():
        port = free_port()
        config = ChannelConfig(address=f"127.0.0.1:{port}", backoff_max_s=0.2, max_attempts=20)
        limits = Limits(lease_ttl_s=5.0)
        client = DirectoryClient(config)
        gaps: list[int] = []
        events: asyncio.Queue = asyncio.Queue()

        async def follow():
            async for event in client.watch_transfers("d1", on_gap=gaps.append):
                events.put_nowait(event)

        async with running_directory(limits, port=port) as first:
            channel, s = stub(first.address)
            await s.RegisterEngine(register_request("p1", PREFILL))
            await s.RegisterEngine(register_request("d1", DECODE))
            watcher = asyncio.create_task(follow())
            await asyncio.sleep(0.3)
            for _ in range(2):
                tid = (await s.PlanTransfer(dpb.PlanTransferRequest())).transfer.transfer_id
                await s.CancelTransfer(dpb.CancelTransferRequest(transfer_id=tid))
            assert [(await asyncio.wait_for(events.get(), 5)).sequence_number for _ in range(2)] == [1, 2]
            in_flight = (await s.PlanTransfer(dpb.PlanTransferRequest())).transfer.transfer_id
            first_incarnation = first.server.servicer.incarnation_id
            await channel.close()
        server, _ = create_server(DirectoryConfig(host="127.0.0.1", port=port, limits=limits, reap_interval_s=0.05))
        new_ids = _events_in_state(server.state, 5)  # sequence numbers 1..5 > the client's 2
        await server.start()
        try:
            assert server.servicer.incarnation_id != first_incarnation
            await _wait_until(lambda: gaps, timeout_s=20)
            assert gaps == [2]
            got = [await asyncio.wait_for(events.get(), 5) for _ in range(5)]
            assert [e.transfer_id for e in got] == new_ids  # the new process's first events are delivered
            assert [e.sequence_number for e in got] == [1, 2, 3, 4, 5]
            # The in-flight transfer of the old process is gone: re-reading it is NOT_FOUND.
            assert await code_of(client.stub.GetTransfer(dpb.GetTransferRequest(transfer_id=in_flight))) == \
                grpc.StatusCode.NOT_FOUND
            watcher.cancel()
            await client.close()
        finally:
            await server.stop(0.5)
    run(body())


def test_prefill_session_and_lease_see_the_new_incarnation():
    """After a restart the prefill session reports on_directory_restart once, the lease re-registers."""
    async def body():
        port = free_port()
        config = ChannelConfig(address=f"127.0.0.1:{port}", backoff_max_s=0.2, max_attempts=20)
        limits = Limits(lease_ttl_s=5.0)
        restarts: list[str] = []
        async with running_directory(limits, port=port) as first:
            client = DirectoryClient(config)
            registration = EngineRegistration(client, register_request("p1", PREFILL))
            await registration.start()
            session = PrefillSession(client, registration, on_directory_restart=restarts.append)
            await session.start()
            await _wait_until(lambda: session.directory_incarnation_id, timeout_s=5)
            assert session.directory_incarnation_id == first.server.servicer.incarnation_id
            assert registration.directory_incarnation_id == first.server.servicer.incarnation_id
        async with running_directory(limits, port=port) as second:
            new = second.server.servicer.incarnation_id
            await _wait_until(lambda: restarts and registration.directory_incarnation_id == new, timeout_s=20)
            assert restarts == [new] and session.directory_incarnation_id == new
            await session.stop()
            await registration.stop()
            await client.close()
    run(body())


def test_a_watch_naming_another_incarnation_is_out_of_range():
    """WatchTransfers with another process's incarnation id is OUT_OF_RANGE even at sequence 0."""
    async def body():
        async with running_directory() as directory:
            channel, s = stub(directory.address)
            await s.RegisterEngine(register_request("d1", DECODE))
            call = s.WatchTransfers(dpb.WatchTransfersRequest(engine_id="d1", directory_incarnation_id="another"))
            assert await code_of(call.read()) == grpc.StatusCode.OUT_OF_RANGE
            call = s.WatchTransfers(dpb.WatchTransfersRequest(
                engine_id="d1", directory_incarnation_id=directory.server.servicer.incarnation_id))
            greeting = await call.read()
            assert not greeting.events and greeting.directory_incarnation_id == directory.server.servicer.incarnation_id
            call.cancel()
            response = await s.GetEngine(dpb.GetEngineRequest(engine_id="d1"))
            assert response.directory_incarnation_id == directory.server.servicer.incarnation_id
            assert response.workers[0].role == tpb.ENGINE_ROLE_DECODE
            await channel.close()
    run(body())


def test_every_response_carries_the_header_and_the_deprecated_field_alike():
    """Each RPC's response names the answering process in its ResponseHeader and, alike, in the deprecated field."""
    async def body():
        async with running_directory() as directory:
            incarnation = directory.server.servicer.incarnation_id
            channel, s = stub(directory.address)
            registered = await s.RegisterEngine(register_request("p1", PREFILL))
            await s.RegisterEngine(register_request("d1", DECODE))
            plan = await s.PlanTransfer(dpb.PlanTransferRequest(prompt_token_count=16))
            transfer_id = plan.transfer.transfer_id
            renew = s.RenewLease()
            await renew.write(dpb.RenewLeaseRequest(lease_id=registered.lease_id))
            watch = s.WatchTransfers(dpb.WatchTransfersRequest(engine_id="d1"))
            session = s.StreamPrefill()
            await session.write(dpb.StreamPrefillRequest(hello=dpb.Hello(engine_id="p1", lease_id=registered.lease_id)))
            responses = [
                registered, plan, await renew.read(), await watch.read(), await session.read(),
                await s.ReportAllocation(dpb.ReportAllocationRequest(
                    transfer_id=transfer_id, engine_id="d1", block_ids=[0], prompt_token_count=16)),
                await s.GetTransfer(dpb.GetTransferRequest(transfer_id=transfer_id)),
                await s.ListTransfers(dpb.ListTransfersRequest()),
                await s.GetEngine(dpb.GetEngineRequest(engine_id="d1")),
                await s.ListEngines(dpb.ListEnginesRequest()),
                await s.GetReplicas(dpb.GetReplicasRequest()),
                await s.ReportEngineUnreachable(dpb.ReportEngineUnreachableRequest(engine_id="d1")),
                await s.CancelTransfer(dpb.CancelTransferRequest(transfer_id=transfer_id)),
                await s.DeregisterEngine(dpb.DeregisterEngineRequest(engine_id="p1", lease_id=registered.lease_id)),
            ]
            for call in (renew, watch, session):
                call.cancel()
            for response in responses:
                name = type(response).__name__
                assert response.HasField("header"), name
                assert response.header.directory_incarnation_id == incarnation, name
                assert response.directory_incarnation_id == incarnation, name
                assert response.header.replica_id == "", name  # one directory, no replicas
            await channel.close()
    run(body())
