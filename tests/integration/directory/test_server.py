"""Integration tests of the directory server: a real grpc.aio server on 127.0.0.1, real channels."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import pytest
import structlog.testing
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvpush.client import ChannelConfig, DirectoryClient, EngineRegistration
from kvpush.directory.state import Limits
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import (
    DECODE,
    PREFILL,
    allocation,
    make_layout,
    ready,
    register_request,
    result,
    running_directory,
)
from tests.integration.directory.helpers import code_of, open_prefill, read, run, send_ready, stub

OK = grpc.StatusCode.OK
DONE = dpb.WRITE_RESULT_STATUS_DONE


async def _plan(s, **fields) -> str:
    """PlanTransfer; the new transfer's id."""
    return (await s.PlanTransfer(dpb.PlanTransferRequest(**fields))).transfer.transfer_id


async def _allocated(s) -> str:
    """A planned transfer whose decode allocation (blocks 1, 2, 3) has been reported."""
    transfer_id = await _plan(s)
    await s.ReportAllocation(allocation(transfer_id))
    return transfer_id


async def _pair(s):
    """Register prefill p1 and decode d1; return their leases."""
    p = await s.RegisterEngine(register_request("p1", PREFILL))
    d = await s.RegisterEngine(register_request("d1", DECODE))
    return p.lease_id, d.lease_id


def test_transfer_flows_end_to_end_and_metadata_is_sent_once():
    """Plan, readiness, allocation, instruction (metadata only the first time), DONE, watch event, COMPLETE."""
    async def body():
        async with running_directory() as directory:
            channel, s = stub(directory.address)
            p_lease, _ = await _pair(s)
            watch = s.WatchTransfers(dpb.WatchTransfersRequest(engine_id="d1"))
            prefill = await open_prefill(s, "p1", p_lease)
            first = await _plan(s, request_id="r1")
            second = await _plan(s, request_id="r2")
            await send_ready(prefill, ready(first, 0, 2))
            await s.ReportAllocation(allocation(first, block_ids=[1, 2, 3]))
            one = (await read(prefill)).instruction
            assert one.transfer_id == first and one.decode_agent_metadata == b"nixl-md-d1-0"
            assert one.HasField("decode_layout") and list(one.decode_block_ids) == [1, 2, 3]
            await s.ReportAllocation(allocation(second, block_ids=[4, 5, 6]))
            await send_ready(prefill, ready(second, 0, 1), ready(first, 2, 4))
            two = (await read(prefill)).instruction
            assert two.transfer_id == second and two.decode_agent_metadata == b""
            assert not two.HasField("decode_layout") and two.decode_agent_name == "d1-agent-0"
            done = result(first, DONE, layers=4, bytes_written=4096)
            done.timing.write_count = 4
            done.timing.layers_written_before_prefill_end_count = 3
            await prefill.write(dpb.StreamPrefillRequest(result=done))
            event = (await read(watch)).events[0]
            assert (event.transfer_id, event.state, event.bytes_written) == (first, tpb.TRANSFER_STATE_COMPLETE, 4096)
            got = (await s.GetTransfer(dpb.GetTransferRequest(transfer_id=first))).transfer
            assert got.state == tpb.TRANSFER_STATE_COMPLETE and got.request_id == "r1"
            assert got.HasField("dispatch_time") and got.HasField("first_ready_time")
            assert [(r.tp_rank, r.timing.write_count, r.timing.layers_written_before_prefill_end_count)
                    for r in got.rank_timings] == [(0, 4, 3)]
            listed = (await s.ListTransfers(dpb.ListTransfersRequest(page_size=1))).transfers
            assert [t.transfer_id for t in listed] == [second]
            watch.cancel()
            await prefill.done_writing()
            await channel.close()
    run(body())


def test_unknown_engines_and_transfers_are_not_found():
    """Unknown transfer, engine, lease: NOT_FOUND on unary calls and on stream opens."""
    async def body():
        async with running_directory() as directory:
            channel, s = stub(directory.address)
            await _pair(s)
            plan = await s.PlanTransfer(dpb.PlanTransferRequest())
            NF = grpc.StatusCode.NOT_FOUND
            assert await code_of(s.GetTransfer(dpb.GetTransferRequest(transfer_id="ghost"))) == NF
            assert await code_of(s.ReportAllocation(allocation("ghost"))) == NF
            assert await code_of(s.ReportAllocation(allocation(plan.transfer.transfer_id, engine_id="ghost"))) == NF
            assert await code_of(s.CancelTransfer(dpb.CancelTransferRequest(transfer_id="ghost"))) == NF
            assert await code_of(s.GetEngine(dpb.GetEngineRequest(engine_id="ghost"))) == NF
            assert await code_of(s.PlanTransfer(dpb.PlanTransferRequest(decode_engine_id="ghost"))) == NF
            assert await code_of(s.DeregisterEngine(dpb.DeregisterEngineRequest(
                engine_id="p1", lease_id="wrong"))) == NF
            watch = s.WatchTransfers(dpb.WatchTransfersRequest(engine_id="ghost"))
            assert await code_of(watch.read()) == NF
            renew = s.RenewLease()
            await renew.write(dpb.RenewLeaseRequest(lease_id="ghost"))
            assert await code_of(renew.read()) == NF
            prefill = await open_prefill(s, "ghost", "lease")
            assert await code_of(prefill.read()) == NF
            await channel.close()
    run(body())


def test_malformed_input_is_invalid_argument_and_changes_nothing():
    """Empty ids, negative counts, bad ranks, bad layouts, over-cap block lists, bad pages: INVALID_ARGUMENT,
    no change."""
    async def body():
        async with running_directory(Limits(max_block_ids=8)) as directory:
            channel, s = stub(directory.address)
            await _pair(s)
            tid = await _plan(s)
            before_engines = await s.ListEngines(dpb.ListEnginesRequest())
            before_transfer = await s.GetTransfer(dpb.GetTransferRequest(transfer_id=tid))
            bad_layout = make_layout()
            del bad_layout.layer_base_addresses[-1]
            bad = [
                s.RegisterEngine(register_request("", PREFILL)),
                s.RegisterEngine(register_request("x" * 129, PREFILL)),
                s.RegisterEngine(register_request("e", tpb.ENGINE_ROLE_UNSPECIFIED)),
                s.RegisterEngine(register_request("e", PREFILL, tp_rank=2, tp_size=2)),
                s.RegisterEngine(register_request("e", PREFILL, layout=bad_layout)),
                s.RegisterEngine(dpb.RegisterEngineRequest(engine_id="e", role=DECODE, tp_size=1, agent_name="a",
                                                           layout=make_layout())),  # decode without metadata
                s.PlanTransfer(dpb.PlanTransferRequest(prompt_token_count=-1)),
                s.ReportAllocation(allocation("")),
                s.ReportAllocation(allocation(tid, prompt=-5)),
                s.ReportAllocation(allocation(tid, block_ids=[1, -2, 3])),
                s.ReportAllocation(allocation(tid, block_ids=list(range(9)))),
                s.ReportAllocation(allocation(tid, prefix=41)),
                s.ReportAllocation(allocation(tid, block_ids=[1, 2])),
                s.ListTransfers(dpb.ListTransfersRequest(page_size=1001)),
                s.ListTransfers(dpb.ListTransfersRequest(page_token="not-a-token")),
                s.ListEngines(dpb.ListEnginesRequest(page_size=-1)),
                s.GetTransfer(dpb.GetTransferRequest()),
            ]
            for call in bad:
                assert await code_of(call) == grpc.StatusCode.INVALID_ARGUMENT
            assert await s.ListEngines(dpb.ListEnginesRequest()) == before_engines
            assert await s.GetTransfer(dpb.GetTransferRequest(transfer_id=tid)) == before_transfer
            await channel.close()
    run(body())


def test_oversized_message_is_refused_by_the_transport_and_changes_nothing():
    """A request over max_message_bytes is RESOURCE_EXHAUSTED from gRPC's receive limit, which is set to it; one
    under it but with a field past its own cap is INVALID_ARGUMENT; nothing registers."""
    async def body():
        async with running_directory(max_message_bytes=64 * 1024) as directory:
            channel, s = stub(directory.address)
            request = register_request("big", DECODE)
            for size in (65 * 1024, 512 * 1024):
                request.agent_metadata = b"x" * size
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await s.RegisterEngine(request)
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "larger than max" in refused.value.details()
            assert await code_of(s.GetTransfer(dpb.GetTransferRequest(transfer_id="t" * (32 * 1024)))) == \
                grpc.StatusCode.INVALID_ARGUMENT
            assert (await s.ListEngines(dpb.ListEnginesRequest())).workers == []
            await channel.close()
    run(body())


def test_bad_events_get_rejections_and_the_stream_goes_on():
    """Bad events in an open StreamPrefill earn EventRejections with precise codes; later good events still work."""
    async def body():
        async with running_directory() as directory:
            channel, s = stub(directory.address)
            p_lease, _ = await _pair(s)
            tid = await _allocated(s)
            prefill = await open_prefill(s, "p1", p_lease)
            await send_ready(prefill, ready(tid, 0, 8), ready("", 0, 1), ready("ghost", 0, 1))
            await prefill.write(dpb.StreamPrefillRequest(result=result(tid, DONE)))
            codes = [(await read(prefill)).rejection.status.code for _ in range(4)]
            assert codes == [grpc.StatusCode.INVALID_ARGUMENT.value[0]] * 2 + [
                grpc.StatusCode.NOT_FOUND.value[0], grpc.StatusCode.FAILED_PRECONDITION.value[0]]
            await send_ready(prefill, ready(tid, 0, 1))
            assert (await read(prefill)).instruction.transfer_id == tid
            await prefill.write(dpb.StreamPrefillRequest(hello=dpb.Hello(engine_id="p1", lease_id=p_lease)))
            assert (await read(prefill)).rejection.status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            await prefill.done_writing()
            await channel.close()
    run(body())


def test_stream_level_errors_end_the_stream():
    """A first message that is not a hello, a hello from a decode engine, an over-cap batch: the stream ends."""
    async def body():
        async with running_directory(Limits(max_events_per_batch=2)) as directory:
            channel, s = stub(directory.address)
            p_lease, d_lease = await _pair(s)
            call = s.StreamPrefill()
            await send_ready(call, ready("t", 0, 1))
            assert await code_of(call.read()) == grpc.StatusCode.INVALID_ARGUMENT
            call = await open_prefill(s, "d1", d_lease)
            assert await code_of(call.read()) == grpc.StatusCode.FAILED_PRECONDITION
            call = await open_prefill(s, "p1", p_lease)
            await send_ready(call, *[ready("t", 0, 1)] * 3)
            assert await code_of(read(call)) == grpc.StatusCode.INVALID_ARGUMENT
            await channel.close()
    run(body())


def test_prefill_stream_break_fails_transfer_and_decode_learns():
    """When the prefill stream breaks mid-transfer, the transfer fails; decode hears it once prefill confirmed it
    stopped.

    The prefill worker is alive (its lease holds), so a write it posted may still land: the end waits for its
    confirmation on the next session (or for its lease to go and its fence to pass).
    """
    async def body():
        async with running_directory() as directory:
            channel, s = stub(directory.address)
            p_lease, _ = await _pair(s)
            watch = s.WatchTransfers(dpb.WatchTransfersRequest(engine_id="d1"))
            tid = await _plan(s)
            prefill = await open_prefill(s, "p1", p_lease)
            await send_ready(prefill, ready(tid, 0, 1))
            await s.ReportAllocation(allocation(tid))
            assert (await read(prefill)).instruction.transfer_id == tid
            prefill.cancel()
            await asyncio.sleep(0.3)  # the directory notices the broken stream
            pending = await s.GetTransfer(dpb.GetTransferRequest(transfer_id=tid))
            assert pending.transfer.state == tpb.TRANSFER_STATE_STREAMING  # decided, not yet terminal
            prefill = await open_prefill(s, "p1", p_lease)
            assert (await read(prefill)).cancellation.transfer_id == tid
            await prefill.write(dpb.StreamPrefillRequest(result=result(tid, dpb.WRITE_RESULT_STATUS_FAILED)))
            event = (await read(watch)).events[0]
            assert event.transfer_id == tid and event.state == tpb.TRANSFER_STATE_FAILED
            assert "prefill stream" in event.reason
            await prefill.done_writing()
            await channel.close()
    run(body())


_DYING_DECODE = """
import asyncio, sys, time
from kvpush.client import ChannelConfig, DirectoryClient, EngineRegistration
from kvpush.observability import configure_logging
from tests.fixtures.directory import register_request, DECODE
configure_logging(fmt="json")  # logs to stderr; stdout carries the handshake line
async def main():
    client = DirectoryClient(ChannelConfig(address=sys.argv[1]))
    registration = EngineRegistration(client, register_request("d1", DECODE))
    await registration.start()
    print("registered", flush=True)
    await asyncio.sleep(60)
asyncio.run(main())
"""


def test_killed_decode_engine_fails_its_transfers_within_the_lease():
    """A decode process killed mid-transfer: its lease lapses and prefill gets a Cancellation within the bound."""
    async def body():
        # 5 s: renewals survive the multi-second freezes this shared 2-core machine has shown.
        async with running_directory(Limits(lease_ttl_s=5.0)) as directory:
            channel, s = stub(directory.address)
            client = DirectoryClient(ChannelConfig(address=directory.address))
            keeper = EngineRegistration(client, register_request("p1", PREFILL))  # renews every ttl/3
            await keeper.start()
            decode = subprocess.Popen([sys.executable, "-c", _DYING_DECODE, directory.address],
                                      stdout=subprocess.PIPE, text=True)
            try:
                line = await asyncio.wait_for(asyncio.to_thread(decode.stdout.readline), 30)
                assert line.strip() == "registered"
                tid = await _plan(s)
                prefill = await open_prefill(s, "p1", keeper.lease_id)
                await send_ready(prefill, ready(tid, 0, 1))
                await s.ReportAllocation(allocation(tid))
                assert (await read(prefill)).instruction.transfer_id == tid
                await asyncio.sleep(1.0)  # the decode process is alive: the transfer lives on
                assert (await s.GetTransfer(dpb.GetTransferRequest(transfer_id=tid))).transfer.state == \
                    tpb.TRANSFER_STATE_STREAMING
                decode.kill()
                loop = asyncio.get_running_loop()
                killed_at = loop.time()
                message = await read(prefill, timeout_s=10)
                elapsed = loop.time() - killed_at
                assert message.cancellation.transfer_id == tid and "lease expired" in message.cancellation.reason
                assert elapsed < 5.0 + 3.0  # lease TTL, plus the reaper period, plus slack for a busy 2-core machine
                # Prefill still holds its lease: the transfer is terminal once it confirms it stopped writing.
                await prefill.write(dpb.StreamPrefillRequest(result=result(tid, dpb.WRITE_RESULT_STATUS_CANCELLED)))
                deadline = loop.time() + 5
                while True:
                    got = (await s.GetTransfer(dpb.GetTransferRequest(transfer_id=tid))).transfer
                    if got.state != tpb.TRANSFER_STATE_STREAMING or loop.time() > deadline:
                        break
                    await asyncio.sleep(0.05)
                assert got.state == tpb.TRANSFER_STATE_FAILED
                await prefill.done_writing()
            finally:
                decode.kill()
                decode.wait(10)
                await keeper.stop()
                await client.close()
            await channel.close()
    run(body())


def test_cancel_after_dispatch_reaches_decode_when_prefill_confirms():
    """CancelTransfer sends a Cancellation to prefill; decode sees CANCELLED only after prefill reports it."""
    async def body():
        async with running_directory() as directory:
            channel, s = stub(directory.address)
            p_lease, _ = await _pair(s)
            watch = s.WatchTransfers(dpb.WatchTransfersRequest(engine_id="d1"))
            tid = await _plan(s)
            prefill = await open_prefill(s, "p1", p_lease)
            await s.ReportAllocation(allocation(tid))
            await send_ready(prefill, ready(tid, 0, 1))
            await read(prefill)
            pending = (await s.CancelTransfer(dpb.CancelTransferRequest(transfer_id=tid, reason="abort"))).transfer
            assert pending.state == tpb.TRANSFER_STATE_STREAMING
            assert (await read(prefill)).cancellation.reason == "abort"
            await prefill.write(dpb.StreamPrefillRequest(result=result(tid, dpb.WRITE_RESULT_STATUS_CANCELLED)))
            event = (await read(watch)).events[0]
            assert (event.state, event.reason) == (tpb.TRANSFER_STATE_CANCELLED, "abort")
            await prefill.done_writing()
            await channel.close()
    run(body())


def test_watch_replays_after_sequence_number():
    """WatchTransfers replays retained events after the given number, then follows new ones."""
    async def body():
        async with running_directory() as directory:
            channel, s = stub(directory.address)
            await _pair(s)
            ids = [await _plan(s) for _ in range(3)]
            for tid in ids[:2]:
                await s.CancelTransfer(dpb.CancelTransferRequest(transfer_id=tid))
            watch = s.WatchTransfers(dpb.WatchTransfersRequest(engine_id="d1", after_sequence_number=1))
            assert [e.transfer_id for e in (await read(watch)).events] == [ids[1]]
            await s.CancelTransfer(dpb.CancelTransferRequest(transfer_id=ids[2]))
            assert [e.sequence_number for e in (await read(watch)).events] == [3]
            ahead = s.WatchTransfers(dpb.WatchTransfersRequest(engine_id="d1", after_sequence_number=50))
            assert await code_of(ahead.read()) == grpc.StatusCode.OUT_OF_RANGE
            watch.cancel()
            await channel.close()
    run(body())


def test_token_is_required_on_every_rpc_but_health():
    """With a token configured, calls without or with a wrong token are UNAUTHENTICATED; health stays open."""
    async def body():
        async with running_directory(token="s3cret") as directory:
            channel, s = stub(directory.address)
            good = (("authorization", "Bearer s3cret"),)
            bad = (("authorization", "Bearer nope"),)
            UA = grpc.StatusCode.UNAUTHENTICATED
            assert await code_of(s.ListEngines(dpb.ListEnginesRequest())) == UA
            assert await code_of(s.ListEngines(dpb.ListEnginesRequest(), metadata=bad)) == UA
            assert await code_of(s.RegisterEngine(register_request("p1", PREFILL), metadata=bad)) == UA
            watch = s.WatchTransfers(dpb.WatchTransfersRequest(engine_id="d1"))
            assert await code_of(watch.read()) == UA
            prefill = s.StreamPrefill(metadata=bad)
            assert await code_of(prefill.read()) == UA
            assert (await s.ListEngines(dpb.ListEnginesRequest(), metadata=good)).workers == []
            health = health_pb2_grpc.HealthStub(channel)
            status = (await health.Check(health_pb2.HealthCheckRequest())).status
            assert status == health_pb2.HealthCheckResponse.SERVING
            await channel.close()
    run(body())


def test_health_and_reflection():
    """Health reports SERVING for the service; reflection lists KVDirectoryService."""
    async def body():
        async with running_directory() as directory:
            channel = grpc.aio.insecure_channel(directory.address)
            health = health_pb2_grpc.HealthStub(channel)
            response = await health.Check(health_pb2.HealthCheckRequest(service="kvpush.v1.KVDirectoryService"))
            assert response.status == health_pb2.HealthCheckResponse.SERVING
            reflect = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo()
            await reflect.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            names = {s.name for s in (await read(reflect)).list_services_response.service}
            assert "kvpush.v1.KVDirectoryService" in names and "grpc.health.v1.Health" in names
            await reflect.done_writing()
            await channel.close()
    run(body())


def test_graceful_stop_flushes_and_ends_streams_unavailable():
    """Stopping the server delivers what is queued, then ends open streams with UNAVAILABLE well within the grace."""
    async def body():
        async with running_directory() as directory:
            channel, s = stub(directory.address)
            p_lease, _ = await _pair(s)
            watch = s.WatchTransfers(dpb.WatchTransfersRequest(engine_id="d1"))
            renew = s.RenewLease()
            await renew.write(dpb.RenewLeaseRequest(lease_id=p_lease))
            assert (await read(renew)).lease_id == p_lease
            prefill = await open_prefill(s, "p1", p_lease)
            tid = await _allocated(s)
            await send_ready(prefill, ready(tid, 0, 1))
            assert (await read(prefill)).instruction.transfer_id == tid
            loop = asyncio.get_running_loop()
            started = loop.time()
            await directory.server.stop(10.0)
            assert await code_of(prefill.read()) == grpc.StatusCode.UNAVAILABLE
            assert await code_of(read(watch)) == grpc.StatusCode.UNAVAILABLE
            assert await code_of(renew.read()) == grpc.StatusCode.UNAVAILABLE
            assert loop.time() - started < 5.0  # streams ended on request, not by the 10 s grace running out
            await channel.close()
    run(body())


def test_state_refusals_map_to_their_status_codes():
    """ALREADY_EXISTS, PERMISSION_DENIED, FAILED_PRECONDITION and RESOURCE_EXHAUSTED reach the caller as such."""
    async def body():
        async with running_directory(Limits(max_active_transfers_per_engine=1)) as directory:
            channel, s = stub(directory.address)
            await _pair(s)
            await s.RegisterEngine(register_request("d2", DECODE))
            assert await code_of(s.RegisterEngine(register_request("p1", PREFILL, agent_name="imposter"))) == \
                grpc.StatusCode.ALREADY_EXISTS
            tid = await _plan(s, decode_engine_id="d1")
            assert await code_of(s.ReportAllocation(allocation(tid, engine_id="d2"))) == \
                grpc.StatusCode.PERMISSION_DENIED
            assert await code_of(s.PlanTransfer(dpb.PlanTransferRequest(prefill_engine_id="p1"))) == \
                grpc.StatusCode.RESOURCE_EXHAUSTED
            await s.CancelTransfer(dpb.CancelTransferRequest(transfer_id=tid))
            assert await code_of(s.ReportAllocation(allocation(tid))) == grpc.StatusCode.FAILED_PRECONDITION
            await channel.close()
    run(body())


def test_a_second_directory_cannot_take_a_bound_port():
    """Binding a port another directory holds fails instead of silently sharing it."""
    async def body():
        async with running_directory() as directory:
            try:
                async with running_directory(port=directory.port):
                    raise AssertionError("second directory bound the same port")
            except OSError:
                pass
    run(body())


def test_transfer_end_is_logged_with_ids_bound():
    """A failed transfer leaves one structured log entry naming the transfer, both engines and the reason."""
    async def body():
        async with running_directory() as directory:
            channel, s = stub(directory.address)
            await _pair(s)
            tid = await _plan(s)
            with structlog.testing.capture_logs() as logs:
                await s.CancelTransfer(dpb.CancelTransferRequest(transfer_id=tid, reason="client gone"))
            ended = [e for e in logs if e["event"] == "transfer ended"]
            assert len(ended) == 1 and ended[0]["transfer_id"] == tid
            assert (ended[0]["state"], ended[0]["reason"]) == ("TRANSFER_STATE_CANCELLED", "client gone")
            assert (ended[0]["prefill_engine_id"], ended[0]["decode_engine_id"]) == ("p1", "d1")
            assert ended[0]["log_level"] == "info"
            await channel.close()
    run(body())


def test_prefill_session_announces_decode_workers_on_the_wire():
    """The stream opens with `opened`, then one `peer` per decode worker registered before it; a decode worker
    registering later is announced on the open stream. The first instruction still carries the metadata."""
    async def body():
        async with running_directory() as directory:
            channel, s = stub(directory.address)
            p_lease, _ = await _pair(s)
            prefill = await open_prefill(s, "p1", p_lease)
            kinds = [(await asyncio.wait_for(prefill.read(), 10)).WhichOneof("message") for _ in range(2)]
            assert kinds == ["opened", "peer"]
            await s.RegisterEngine(register_request("d2", DECODE))
            late = await asyncio.wait_for(prefill.read(), 10)
            assert (late.peer.decode_engine_id, late.peer.decode_agent_metadata) == ("d2", b"nixl-md-d2-0")
            assert late.peer.decode_layout.layer_count == 4 and late.directory_incarnation_id
            tid = await _plan(s, decode_engine_id="d1")
            await s.ReportAllocation(allocation(tid))
            await send_ready(prefill, ready(tid, 0, 4))
            assert (await read(prefill)).instruction.decode_agent_metadata == b"nixl-md-d1-0"
            await prefill.done_writing()
            await channel.close()
    run(body())


def test_new_agent_metadata_is_sent_again_under_the_same_agent_name():
    """A decode worker that re-registers under the same agent name with new NIXL metadata gets it re-sent."""
    async def body():
        async with running_directory() as directory:
            channel, s = stub(directory.address)
            p_lease, d_lease = await _pair(s)
            prefill = await open_prefill(s, "p1", p_lease)
            metadata = []
            for round_ in range(3):
                tid = await _plan(s)
                await s.ReportAllocation(allocation(tid, block_ids=[1, 2, 3]))
                await send_ready(prefill, ready(tid, 0, 4))
                metadata.append((await read(prefill)).instruction.decode_agent_metadata)
                await prefill.write(dpb.StreamPrefillRequest(result=result(tid, DONE)))
                if round_ == 1:  # the decode process restarts: same agent name, new memory registrations
                    await s.DeregisterEngine(dpb.DeregisterEngineRequest(engine_id="d1", lease_id=d_lease))
                    request = register_request("d1", DECODE)
                    request.agent_metadata = b"nixl-md-after-restart"
                    d_lease = (await s.RegisterEngine(request)).lease_id
            assert metadata == [b"nixl-md-d1-0", b"", b"nixl-md-after-restart"]
            await prefill.done_writing()
            await channel.close()
    run(body())


def test_report_engine_unreachable_marks_until_the_next_renewal():
    """ReportEngineUnreachable over gRPC: bad input INVALID_ARGUMENT, unknown ids NOT_FOUND, a transfer not
    naming the engine FAILED_PRECONDITION (nothing marked); a good report is listed (time and reason) and
    keeps the engine out of plans; the engine's next renewal clears it."""
    async def body():
        async with running_directory() as directory:
            channel, s = stub(directory.address)
            await _pair(s)
            d2 = (await s.RegisterEngine(register_request("d2", DECODE))).lease_id
            tid = await _plan(s)
            report = s.ReportEngineUnreachable
            IA, NF, FP = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                          grpc.StatusCode.FAILED_PRECONDITION)
            assert await code_of(report(dpb.ReportEngineUnreachableRequest())) == IA
            assert await code_of(report(dpb.ReportEngineUnreachableRequest(engine_id="d2", reason="\x00"))) == IA
            assert await code_of(report(dpb.ReportEngineUnreachableRequest(engine_id="ghost"))) == NF
            assert await code_of(report(dpb.ReportEngineUnreachableRequest(engine_id="d2", transfer_id="ghost"))) == NF
            assert await code_of(report(dpb.ReportEngineUnreachableRequest(engine_id="d2", transfer_id=tid))) == FP
            listed = (await s.ListEngines(dpb.ListEnginesRequest())).workers
            assert not any(w.HasField("unreachable_time") for w in listed)
            answer = await report(dpb.ReportEngineUnreachableRequest(engine_id="d2", reason="connection refused"))
            assert answer.marked and answer.directory_incarnation_id
            (worker,) = (await s.GetEngine(dpb.GetEngineRequest(engine_id="d2"))).workers
            assert worker.HasField("unreachable_time") and worker.unreachable_reason == "connection refused"
            for _ in range(3):
                plan = await s.PlanTransfer(dpb.PlanTransferRequest())
                assert plan.transfer.decode_engine_id == "d1"
            renew = s.RenewLease()
            await renew.write(dpb.RenewLeaseRequest(lease_id=d2))
            await renew.read()
            (worker,) = (await s.GetEngine(dpb.GetEngineRequest(engine_id="d2"))).workers
            assert not worker.HasField("unreachable_time") and worker.unreachable_reason == ""
            await renew.done_writing()
            await channel.close()
    run(body())
