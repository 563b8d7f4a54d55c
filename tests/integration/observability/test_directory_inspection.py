"""A real `kvpush directory` process: `kvpush trace` prints a transfer's timeline, /metrics counts what happened,
and planning follows load, model and compatibility hash (engines registered over gRPC, loads sent on renewal)."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from google.protobuf import timestamp_pb2

from kvpush.client import ChannelConfig, DirectoryCallError, DirectoryClient, EngineRegistration, PrefillSession
from kvpush.localstack.processes import free_port, start_directory
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import DECODE, PREFILL, make_layout, ready, register_request
from tests.fixtures.metrics import scrape, value
from tests.integration.directory.helpers import run

TRACEPARENT = "00-6bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    """A directory process with /metrics on a free port."""
    metrics_port = free_port()
    handle = start_directory(Path(tmp_path_factory.mktemp("directory")), extra_args=[
        "--lease-ttl-s", "30", "--metrics-port", str(metrics_port)])
    handle.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    yield handle
    handle.process.stop(grace_s=5.0)


def _stamp(seconds: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


async def _drive(address: str, suffix: str, finish: str) -> str:
    """One 2-layer transfer from plan to `finish` ("done" with timings, or "cancel"); returns its id."""
    async with DirectoryClient(ChannelConfig(address=address)) as client:
        layout = make_layout(layer_count=2, compatibility_hash="h1")
        prefill = EngineRegistration(client, register_request(f"p-{suffix}", PREFILL, layout=layout))
        await prefill.start()
        await client.register_engine(register_request(f"d-{suffix}", DECODE, layout=layout))
        instructions: asyncio.Queue = asyncio.Queue()
        session = PrefillSession(client, prefill, on_instruction=instructions.put_nowait)
        await session.start()
        tid = (await client.plan_transfer(request_id=f"req-{suffix}", traceparent=TRACEPARENT,
                                          prefill_engine_id=f"p-{suffix}", decode_engine_id=f"d-{suffix}")
               ).transfer.transfer_id
        if finish == "cancel":
            await client.cancel_transfer(tid, "client went away")
        else:
            await client.report_allocation(tid, f"d-{suffix}", [4, 5, 6], 40)
            session.send_ready([ready(tid, 0, 1)])
            await asyncio.wait_for(instructions.get(), 10)
            await asyncio.sleep(0.02)
            session.send_ready([ready(tid, 1, 2)])
            now = time.time()
            timing = tpb.TransferTiming(first_write_start_time=_stamp(now), prefill_end_time=_stamp(now + 0.010),
                                        last_write_end_time=_stamp(now + 0.012), write_count=2, descriptor_count=6,
                                        layers_written_before_prefill_end_count=1)
            timing.post_duration.FromNanoseconds(150_000)
            timing.layer_writes.add(layer=0).end_time.CopyFrom(_stamp(now + 0.004))
            timing.layer_writes.add(layer=1).end_time.CopyFrom(_stamp(now + 0.012))
            session.send_result(dpb.WriteResult(transfer_id=tid, status=dpb.WRITE_RESULT_STATUS_DONE,
                                                layers_written_count=2, bytes_written=4096, timing=timing))
            for _ in range(100):
                if (await client.get_transfer(tid)).state == tpb.TRANSFER_STATE_COMPLETE:
                    break
                await asyncio.sleep(0.05)
        await session.stop()
        await prefill.stop(deregister=True)
        return tid


def cli(*args: str) -> subprocess.CompletedProcess:
    """The kvpush CLI, bounded."""
    return subprocess.run([sys.executable, "-m", "kvpush.cli.main", *args], capture_output=True, text=True,
                          timeout=60)


def test_kvpush_trace_prints_the_timeline(directory):
    """`kvpush trace ID` lists planned, allocated, each layer ready and written, prefill end, completion in time
    order, the trace id, and the rank's timing (exposed tail 2 ms)."""
    tid = run(_drive(directory.address, "trace", "done"))
    shown = cli("trace", tid, "--address", directory.address)
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert f"transfer {tid}  COMPLETE" in out and "6bf92f3577b34da6a3ce929d0e0e4736" in out
    events = [re.sub(r"^\s*[+-][\d.]+ ms\s+", "", line) for line in out.splitlines()
              if re.match(r"^\s*[+-][\d.]+ ms", line)]
    order = ["planned", "decode allocated 3 blocks", "layer 0 ready", "push instruction sent to prefill",
             "layer 1 ready", "complete"]
    assert [e for e in events if e in order] == order, out
    assert events.index("layer 0 written") < events.index("prefill ended") < events.index("layer 1 written")
    assert events.index("last WRITE completed") <= events.index("layer 1 written") + 1
    rank_row = next(line.split() for line in out.splitlines() if line.strip().startswith("0 "))
    assert rank_row[:4] == ["0", "2", "6", "0.150"] and rank_row[5] == "2.000" and rank_row[6] == "1/2"
    missing = cli("trace", "ghost", "--address", directory.address)
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr


def test_directory_metrics_after_real_calls(directory):
    """/metrics: a cancelled and a completed transfer are counted by state and cause, with bytes, layers, RPC
    codes (a refused plan is RESOURCE_EXHAUSTED) and no live transfer left."""
    before = scrape(directory.metrics_url)
    run(_drive(directory.address, "m1", "done"))
    run(_drive(directory.address, "m2", "cancel"))

    async def refused() -> None:
        async with DirectoryClient(ChannelConfig(address=directory.address, max_attempts=1)) as client:
            with pytest.raises(DirectoryCallError):
                await client.plan_transfer(request_id="r", model="no-such-model")
    run(refused())
    after = scrape(directory.metrics_url)

    def delta(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("kvpush_directory_transfers_planned_total") == 2
    assert delta("kvpush_directory_transfers_ended_total", state="complete", cause="none") == 1
    assert delta("kvpush_directory_transfers_ended_total", state="cancelled", cause="cancelled") == 1
    assert delta("kvpush_directory_transfer_written_bytes_total") == 4096
    assert delta("kvpush_directory_transfer_written_layers_total") == 2
    assert delta("kvpush_directory_exposed_tail_seconds_count") == 1
    assert delta("kvpush_directory_exposed_tail_seconds_sum") == pytest.approx(0.002, abs=1e-6)
    assert delta("kvpush_directory_write_post_seconds_sum") == pytest.approx(0.00015, abs=1e-9)
    assert delta("kvpush_directory_rpc_duration_seconds_count", method="PlanTransfer", code="OK") == 2
    assert delta("kvpush_directory_rpc_duration_seconds_count", method="PlanTransfer",
                 code="RESOURCE_EXHAUSTED") == 1
    assert delta("kvpush_directory_rpc_duration_seconds_count", method="CancelTransfer", code="OK") == 1
    assert value(after, "kvpush_directory_live_transfers") == 0


async def _register_with_load(client: DirectoryClient, engine_id: str, role: int, free_blocks: int,
                              compatibility_hash: str = "h", model: str = "m") -> EngineRegistration:
    layout = make_layout(layer_count=2, block_count=64, compatibility_hash=compatibility_hash)
    request = register_request(engine_id, role, layout=layout)
    request.model = model
    registration = EngineRegistration(client, request, load_callback=lambda: tpb.EngineLoad(
        free_block_count=free_blocks, running_request_count=1, waiting_request_count=0))
    await registration.start()
    registration._renew_now.set()  # send the load now rather than at ttl/3
    return registration


def test_planning_avoids_the_decode_engine_with_fewer_free_blocks(directory):
    """Two decode engines report 50 and 10 free blocks on renewal: plans go to the one with 50; a 400-token prompt
    (25 blocks of 16) pinned to the other is still planned there (free blocks order engines, capacity admits: a
    report can be stale), and a prompt larger than its 64 blocks is refused."""
    async def scenario() -> None:
        async with DirectoryClient(ChannelConfig(address=directory.address)) as client:
            registrations = [await _register_with_load(client, "load-p", PREFILL, 64, model="load"),
                             await _register_with_load(client, "load-d-busy", DECODE, 10, model="load"),
                             await _register_with_load(client, "load-d-idle", DECODE, 50, model="load")]
            for _ in range(100):
                engines = await client.list_engines(tpb.ENGINE_ROLE_DECODE)
                loads = {e.engine_id: e.load.free_block_count for e in engines if e.HasField("load")}
                if loads.get("load-d-busy") == 10 and loads.get("load-d-idle") == 50:
                    break
                await asyncio.sleep(0.05)
            assert loads["load-d-busy"] == 10 and loads["load-d-idle"] == 50
            for _ in range(3):
                plan = await client.plan_transfer(model="load", prompt_token_count=100)
                assert plan.transfer.decode_engine_id == "load-d-idle"
                await client.cancel_transfer(plan.transfer.transfer_id, "test")
            pinned = await client.plan_transfer(model="load", prompt_token_count=400, decode_engine_id="load-d-busy")
            assert pinned.transfer.decode_engine_id == "load-d-busy"
            await client.cancel_transfer(pinned.transfer.transfer_id, "test")
            with pytest.raises(DirectoryCallError) as refused:
                await client.plan_transfer(model="load", prompt_token_count=1100, decode_engine_id="load-d-busy")
            assert refused.value.code.name == "RESOURCE_EXHAUSTED" and "room for 1100 tokens" in refused.value.details
            for registration in registrations:
                await registration.stop()
    run(scenario())


def test_planning_refuses_a_mismatched_pair_and_an_unknown_model(directory):
    """A prefill and a decode engine with different compatibility hashes are never paired (FAILED_PRECONDITION
    naming both engines); a model no engine serves is RESOURCE_EXHAUSTED naming it."""
    async def scenario() -> None:
        async with DirectoryClient(ChannelConfig(address=directory.address, max_attempts=1)) as client:
            registrations = [await _register_with_load(client, "mm-p", PREFILL, 64, "hash-a", model="mm"),
                             await _register_with_load(client, "mm-d", DECODE, 64, "hash-b", model="mm")]
            with pytest.raises(DirectoryCallError) as mismatch:
                await client.plan_transfer(model="mm")
            assert mismatch.value.code.name == "FAILED_PRECONDITION"
            assert "compatibility hash" in mismatch.value.details
            assert "'mm-p'" in mismatch.value.details and "'mm-d'" in mismatch.value.details
            with pytest.raises(DirectoryCallError) as unknown:
                await client.plan_transfer(model="other-model")
            assert unknown.value.code.name == "RESOURCE_EXHAUSTED" and "other-model" in unknown.value.details
            for registration in registrations:
                await registration.stop()
    run(scenario())
