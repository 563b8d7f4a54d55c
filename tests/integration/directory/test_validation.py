"""Precise errors on a real directory: no input earns UNKNOWN, every meaningless value is refused."""

from __future__ import annotations

import grpc
import pytest

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

INVALID = grpc.StatusCode.INVALID_ARGUMENT
INT64_MAX = 2**63 - 1


def test_bad_page_tokens_are_invalid_argument():
    """Page tokens the server never issued (unicode digits, huge numbers, junk, 1 MB) are INVALID_ARGUMENT."""
    async def body():
        async with running_directory() as directory:
            channel, s = stub(directory.address)
            for token in ("²", "１２", "9" * 40, "abc", "x" * (1 << 20), "-1"):
                assert await code_of(s.ListTransfers(dpb.ListTransfersRequest(page_token=token))) == INVALID, token
            for token in ("²:p1", "1", "99999999999:p1", ":", "x" * 1000):
                assert await code_of(s.ListEngines(dpb.ListEnginesRequest(page_token=token))) == INVALID, token
            assert await code_of(s.ListEngines(dpb.ListEnginesRequest(role=99))) == INVALID
            await channel.close()
    run(body())


@pytest.mark.parametrize("method", ["GetTransfer", "RegisterEngine", "ListEngines", "WatchTransfers"])
def test_undecodable_request_bodies_are_invalid_argument(method):
    """Bytes that are no protobuf message of the method's type get INVALID_ARGUMENT, not UNKNOWN."""
    async def body():
        async with running_directory() as directory:
            channel = grpc.aio.insecure_channel(directory.address)
            path = f"/kvpush.v1.KVDirectoryService/{method}"
            garbage = b"\xff\xff\xff\xff\x0f"
            if method == "WatchTransfers":
                call = channel.unary_stream(path, request_serializer=None, response_deserializer=None)(garbage)
                assert await code_of(call.read()) == INVALID
            else:
                call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
                assert await code_of(call(garbage, timeout=5)) == INVALID
            await channel.close()
    run(body())


def test_undecodable_stream_messages_are_invalid_argument():
    """A StreamPrefill or RenewLease message that does not decode ends the stream INVALID_ARGUMENT."""
    async def body():
        async with running_directory() as directory:
            channel = grpc.aio.insecure_channel(directory.address)
            for method in ("StreamPrefill", "RenewLease"):
                call = channel.stream_stream(f"/kvpush.v1.KVDirectoryService/{method}", request_serializer=None,
                                             response_deserializer=None)()
                await call.write(b"\xff\xff\xff\xff\x0f")
                assert await code_of(call.read()) == INVALID, method
            await channel.close()
    run(body())


def test_two_ranks_with_huge_bytes_written_complete_without_overflow():
    """Two ranks reporting INT64_MAX bytes each: COMPLETE reaches decode and GetTransfer still answers."""
    async def body():
        async with running_directory() as directory:
            channel, s = stub(directory.address)
            leases = [(await s.RegisterEngine(register_request("p1", PREFILL, tp_rank=r, tp_size=2))).lease_id
                      for r in range(2)]
            for rank in range(2):
                await s.RegisterEngine(register_request("d1", DECODE, tp_rank=rank, tp_size=2))
            watch = s.WatchTransfers(dpb.WatchTransfersRequest(engine_id="d1"))
            sessions = [await open_prefill(s, "p1", leases[r], tp_rank=r) for r in range(2)]
            tid = (await s.PlanTransfer(dpb.PlanTransferRequest())).transfer.transfer_id
            await s.ReportAllocation(allocation(tid))
            for session in sessions:
                await send_ready(session, ready(tid, 0, 4))
                assert (await read(session)).instruction.transfer_id == tid
            for session in sessions:
                await session.write(dpb.StreamPrefillRequest(
                    result=result(tid, dpb.WRITE_RESULT_STATUS_DONE, 4, INT64_MAX)))
            (event,) = (await read(watch)).events
            assert event.state == tpb.TRANSFER_STATE_COMPLETE and event.bytes_written == INT64_MAX
            transfer = (await s.GetTransfer(dpb.GetTransferRequest(transfer_id=tid))).transfer
            assert transfer.state == tpb.TRANSFER_STATE_COMPLETE and transfer.bytes_written == INT64_MAX
            for call in (watch, *sessions):
                call.cancel()
            await channel.close()
    run(body())


def _layout(**changes) -> tpb.KVLayout:
    layout = make_layout()
    for name, value in changes.items():
        if name == "layer_names":
            layout.layer_names.extend(value)
        else:
            setattr(layout, name, value)
    return layout


MEGA = "x" * (1 << 20)
BAD_REGISTRATIONS = {
    "NUL in engine id": register_request("p\x001", PREFILL),
    "newline in engine id": register_request("p1\n", PREFILL, agent_name="a1"),
    "space in agent name": register_request("p1", PREFILL, agent_name="agent one"),
    "tp_size 2^31-1": register_request("p1", PREFILL, tp_size=2**31 - 1),
    "block_count 2^31-1": register_request("p1", PREFILL, layout=_layout(block_count=2**31 - 1)),
    "block_size 2^31-1": register_request("p1", PREFILL, layout=_layout(block_size_tokens=2**31 - 1)),
    "1 MB dtype": register_request("p1", PREFILL, layout=_layout(dtype=MEGA)),
    "dtype with newline": register_request("p1", PREFILL, layout=_layout(dtype="bf16\n")),
    "1 MB compatibility hash": register_request("p1", PREFILL, layout=_layout(compatibility_hash=MEGA)),
    "1 MB layer names": register_request("p1", PREFILL, layout=_layout(layer_names=[MEGA] * 4)),
    "1 MB endpoint": register_request("p1", PREFILL, endpoint=MEGA),
    "device id 2^31-1": register_request("p1", PREFILL, layout=_layout(device_id=2**31 - 1)),
}


@pytest.mark.parametrize("case", sorted(BAD_REGISTRATIONS))
def test_meaningless_registrations_are_refused(case):
    """Ids outside the character set, absurd sizes and 1 MB strings: INVALID_ARGUMENT, nothing registered."""
    async def body():
        async with running_directory() as directory:
            channel, s = stub(directory.address)
            assert await code_of(s.RegisterEngine(BAD_REGISTRATIONS[case])) == INVALID
            assert not (await s.ListEngines(dpb.ListEnginesRequest())).workers
            await channel.close()
    run(body())


def test_meaningless_values_on_a_live_engine_are_refused():
    """Negative loads, negative durations, a reused agent name, ranks disagreeing on layout: refused, no change."""
    async def body():
        async with running_directory() as directory:
            channel, s = stub(directory.address)
            p_lease = (await s.RegisterEngine(register_request("p1", PREFILL, tp_size=2))).lease_id
            await s.RegisterEngine(register_request("d1", DECODE))
            # Another engine may not take a live worker's agent name.
            assert await code_of(s.RegisterEngine(register_request("d2", DECODE, agent_name="d1-agent-0"))) == \
                grpc.StatusCode.ALREADY_EXISTS
            # Ranks of one engine must agree on the layout's shape.
            assert await code_of(s.RegisterEngine(register_request(
                "p1", PREFILL, tp_rank=1, tp_size=2, layout=make_layout(block_count=32)))) == INVALID
            assert await code_of(s.RegisterEngine(register_request(
                "p1", PREFILL, tp_rank=1, tp_size=2, layout=make_layout(dtype="float16")))) == INVALID
            assert [w.tp_rank for w in (await s.GetEngine(dpb.GetEngineRequest(engine_id="p1"))).workers] == [0]
            # A negative free block count is no load.
            renew = s.RenewLease()
            await renew.write(dpb.RenewLeaseRequest(lease_id=p_lease, load=tpb.EngineLoad(free_block_count=-5)))
            assert await code_of(read(renew)) == INVALID
            renew = s.RenewLease()
            await renew.write(dpb.RenewLeaseRequest(lease_id=p_lease, load=tpb.EngineLoad(running_request_count=-1)))
            assert await code_of(read(renew)) == INVALID
            # Negative durations: a plan's ttl and a rank's post duration.
            plan = dpb.PlanTransferRequest()
            plan.ttl.seconds = -5
            assert await code_of(s.PlanTransfer(plan)) == INVALID
            plan.ttl.seconds, plan.ttl.nanos = 5, -1
            assert await code_of(s.PlanTransfer(plan)) == INVALID
            await s.RegisterEngine(register_request("p1", PREFILL, tp_rank=1, tp_size=2))
            session = await open_prefill(s, "p1", p_lease)
            bad = result("t" * 32, dpb.WRITE_RESULT_STATUS_DONE)
            bad.timing.post_duration.seconds = -1
            await session.write(dpb.StreamPrefillRequest(result=bad))
            rejection = (await read(session)).rejection
            assert rejection.status.code == INVALID.value[0] and "post_duration" in rejection.status.message
            bad = result("t\n1", dpb.WRITE_RESULT_STATUS_DONE)
            await session.write(dpb.StreamPrefillRequest(result=bad))
            assert (await read(session)).rejection.status.code == INVALID.value[0]
            session.cancel()
            await channel.close()
    run(body())


def test_listings_stay_under_the_message_size_whatever_the_registrations():
    """Engines with the largest accepted layouts: ListEngines pages stop before 2 MiB and still list every worker."""
    async def body():
        async with running_directory() as directory:
            channel, s = stub(directory.address)
            names = [f"model.layers.{i}.self_attn.attn.{'n' * 128}"[:128] for i in range(256)]
            layout = make_layout(layer_count=256)
            layout.layer_names.extend(names)
            assert 30_000 < layout.ByteSize() <= 48 * 1024
            for index in range(80):  # 80 x ~34 KB: one page of everything would be ~2.7 MB
                await s.RegisterEngine(register_request(f"d{index}", DECODE, layout=layout))
            big = make_layout(layer_count=256)
            big.layer_names.extend(names * 2)
            big.layer_count = 512
            big.layer_base_addresses.extend(big.layer_base_addresses)
            assert await code_of(s.RegisterEngine(register_request("too-big", DECODE, layout=big))) == INVALID
            seen, token, pages = [], "", 0
            while True:
                response = await s.ListEngines(dpb.ListEnginesRequest(page_size=1000, page_token=token))
                assert response.ByteSize() <= 2 * 1024 * 1024
                seen.extend(w.engine_id for w in response.workers)
                pages += 1
                token = response.next_page_token
                if not token:
                    break
            assert pages >= 2 and sorted(seen) == sorted(f"d{i}" for i in range(80))
            await channel.close()
    run(body())
