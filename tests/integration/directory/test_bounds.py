"""Floods against a real `kvpush directory` process: every backlog is capped, memory returns near its baseline.

Each flood is a bounded loop on loopback; the server's RSS is read from /proc/PID/status before,
during and after. The figures asserted are generous (a shared 2-core machine) but far below what the
unbounded directory reached (58 -> 730 MB in 20 s for the readiness flood, 1.3 GB for the large bodies).
"""

from __future__ import annotations

import asyncio
import json
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpush.directory.state import Limits
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import directory_pb2_grpc as dgrpc
from tests.fixtures.directory import DECODE, PREFILL, ready, register_request, running_directory
from tests.integration.directory.helpers import code_of, read, run, stub

MB = 1024 * 1024


def rss_bytes(pid: int) -> int:
    """Resident set size of a process, from /proc/PID/status."""
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


async def _health_latency_s(channel: grpc.aio.Channel) -> float:
    loop = asyncio.get_running_loop()
    started = loop.time()
    response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert response.status == health_pb2.HealthCheckResponse.SERVING
    return loop.time() - started


def test_invalid_readiness_flood_ends_the_session_and_memory_stays_bounded(directory_process):
    """A worker that floods refused events and never reads: RESOURCE_EXHAUSTED, bounded RSS, few log lines."""
    process = directory_process()

    async def body():
        channel, s = stub(process.address)
        lease = (await s.RegisterEngine(register_request("p1", PREFILL))).lease_id
        await _health_latency_s(channel)
        baseline = rss_bytes(process.process.pid)
        batch = dpb.StreamPrefillRequest(ready=dpb.LayerReadyBatch(
            events=[ready(f"unknown-{i}", 0, 1) for i in range(200)]))
        peak = baseline
        ends = []
        for session in range(40):  # 40 sessions x 1200 refused events, none of them read by the worker
            call = s.StreamPrefill()
            await call.write(dpb.StreamPrefillRequest(hello=dpb.Hello(engine_id="p1", lease_id=lease)))
            # 6 x 200 events (~50 KB) fit the stream's flow-control window: every write completes before the
            # directory ends the stream, so the status read next is the directory's.
            for _ in range(6):
                await asyncio.wait_for(call.write(batch), 5)
            try:
                while True:  # what came before the end (the greeting, rejections), then the status
                    if await asyncio.wait_for(call.read(), 10) is grpc.aio.EOF:
                        break
            except grpc.aio.AioRpcError as error:
                ends.append(error.code())
            if session % 5 == 0:
                peak = max(peak, rss_bytes(process.process.pid))
                assert await _health_latency_s(channel) < 5.0  # the unbounded directory took 9 s; a busy VM ~1 s
        assert set(ends) == {grpc.StatusCode.RESOURCE_EXHAUSTED} and len(ends) == 40, ends
        print(f"flood RSS MB: baseline {baseline / MB:.0f}, peak {peak / MB:.0f}")
        await asyncio.sleep(0.5)
        after = rss_bytes(process.process.pid)
        assert peak - baseline < 120 * MB, (baseline, peak)
        assert after - baseline < 60 * MB, (baseline, after)
        assert await _health_latency_s(channel) < 2.0
        await channel.close()

    run(body(), timeout_s=120)
    rejected_lines = [line for line in process.lines if '"event rejected"' in line]
    assert len(rejected_lines) < 200  # rate-limited: the old directory wrote one line per event
    for _ in range(150):  # the collector thread may still be reading the last lines
        closes = [json.loads(line) for line in process.lines if '"prefill session closed"' in line]
        if len(closes) >= 40:
            break
        time.sleep(0.1)
    # Each session counted every refused event up to its end (the cap), though few were logged.
    assert len(closes) == 40 and all(c["rejected_count"] >= 1024 for c in closes), closes
    assert all("cap on queued event rejections" in c["reason"] for c in closes)


def test_unauthenticated_large_requests_are_refused_unread(directory_process):
    """Eight concurrent 32 MiB requests without the token: UNAUTHENTICATED, and the server's RSS barely moves."""
    process = directory_process("--token", "the-token")

    async def body():
        channel = grpc.aio.insecure_channel(process.address, options=[
            ("grpc.max_send_message_length", 64 * MB)])
        s = dgrpc.KVDirectoryServiceStub(channel)
        await _health_latency_s(channel)
        baseline = rss_bytes(process.process.pid)
        big = register_request("p1", DECODE)
        big.agent_metadata = b"x" * (32 * MB)
        peak = baseline
        sampling = True

        async def sample():
            nonlocal peak
            while sampling:
                peak = max(peak, rss_bytes(process.process.pid))
                await asyncio.sleep(0.01)

        sampler = asyncio.create_task(sample())
        for _ in range(3):
            codes = await asyncio.gather(*[code_of(s.RegisterEngine(big, timeout=30)) for _ in range(8)])
            assert set(codes) == {grpc.StatusCode.UNAUTHENTICATED}
        sampling = False
        await sampler
        after = rss_bytes(process.process.pid)
        # 24 x 32 MiB were sent, 8 at a time: a server that took them in would grow by >= 256 MiB. With gRPC's BDP
        # probing on, its receive windows alone took up to 84 MiB under load; the directory turns it off.
        assert peak - baseline < 16 * MB, (baseline, peak)
        assert after - baseline < 16 * MB, (baseline, after)
        await channel.close()

    run(body(), timeout_s=120)


def test_cancelled_renew_streams_leave_no_task_and_idle_ones_time_out():
    """2000 RenewLease streams opened and cancelled leave no task behind; a silent stream ends DEADLINE_EXCEEDED."""
    # The idle bound must outlast one round of 100 writes and reads on a loaded CI machine: at 0.5 s a stream
    # written early in a round was ended before its reply was read.
    idle_s = 2.0

    async def body():
        async with running_directory(Limits(renew_stream_idle_s=idle_s)) as directory:
            channel, s = stub(directory.address)
            lease = (await s.RegisterEngine(register_request("p1", PREFILL))).lease_id
            await asyncio.sleep(0.2)
            baseline = len(asyncio.all_tasks())
            for _ in range(20):
                calls = [s.RenewLease() for _ in range(100)]
                for call in calls:
                    await call.write(dpb.RenewLeaseRequest(lease_id=lease))
                for call in calls:
                    assert (await read(call)).lease_id == lease
                    call.cancel()
            for _ in range(100):
                await asyncio.sleep(0.05)
                if len(asyncio.all_tasks()) <= baseline + 2:
                    break
            assert len(asyncio.all_tasks()) <= baseline + 2, len(asyncio.all_tasks()) - baseline
            idle = s.RenewLease()
            loop = asyncio.get_running_loop()
            started = loop.time()
            assert await code_of(read(idle)) == grpc.StatusCode.DEADLINE_EXCEEDED
            assert idle_s - 0.2 < loop.time() - started < idle_s + 2.5
            await channel.close()
    run(body(), timeout_s=120)


def test_open_streams_are_capped_and_slots_come_back():
    """Past its share of max_open_streams a watch is RESOURCE_EXHAUSTED while a renewal still opens (its reserved
    slot); past the ceiling everything is; a cancelled stream frees its slot."""
    async def body():
        async with running_directory(Limits(max_open_streams=4, renewal_reserved_share=0.25)) as directory:
            channel, s = stub(directory.address)
            lease = (await s.RegisterEngine(register_request("d1", DECODE))).lease_id
            watches = [s.WatchTransfers(dpb.WatchTransfersRequest(engine_id="d1")) for _ in range(3)]
            for watch in watches:
                assert (await watch.read()).directory_incarnation_id  # the greeting: the stream is open
            refused = s.WatchTransfers(dpb.WatchTransfersRequest(engine_id="d1"))
            assert await code_of(refused.read()) == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "kept for lease renewals" in await refused.details()
            renewal = s.RenewLease()
            await renewal.write(dpb.RenewLeaseRequest(lease_id=lease))
            assert (await read(renewal)).lease_id == lease
            assert await code_of(read(s.RenewLease())) == grpc.StatusCode.RESOURCE_EXHAUSTED  # 4 of 4
            watches[0].cancel()
            for _ in range(100):
                if directory.server.servicer.open_stream_count == 3:
                    break
                await asyncio.sleep(0.02)
            again = s.WatchTransfers(dpb.WatchTransfersRequest(engine_id="d1"))
            assert (await again.read()).directory_incarnation_id
            for call in (*watches, again, renewal):
                call.cancel()
            await channel.close()
    run(body())
