"""Control-plane benchmark of the KV-directory: layer events/s and dispatch latency.

One directory process (`kvpush directory`, pinned with taskset to one core) and one load process
(this script, pinned to another core) with N simulated prefill workers (StreamPrefill) and M
simulated decode engines (ReportAllocation + WatchTransfers). Each simulated request:

1. the "gateway" plans a transfer (PlanTransfer, prefill pinned to the worker, decode chosen);
2. at once and concurrently, decode reports its blocks (ReportAllocation) and the prefill worker
   starts reporting readiness: one event per (chunk, layer), one event per in-flight transfer per
   simulated engine step, all of a step's events in one LayerReadyBatch (or one per message with
   `--unbatched` / the `unbatched` scenario);
3. the directory dispatches ONE instruction; dispatch latency is measured from the later of
   (allocation sent, first readiness sent) to the instruction arriving at the prefill worker;
4. after the last layer of the last chunk the worker sends DONE and decode's watch sees COMPLETE.

Scenarios in one run (same directory build, same machine), so ratios compare like with like:
  max_batched     unpaced, readiness batched per step          -> peak layer events/s
  max_unbatched   unpaced, one readiness event per message     -> what batching buys
  paced_5k        5,000 layer events/s, batched                -> dispatch latency p50/p99
  unary_rtt_baseline  sequential cheapest unary calls          -> the gRPC round-trip floor under latency

Usage:  python bench/directory_bench.py [--duration-s 10] [--prefill 4] [--decode 4] [--profile]
Prints JSON and writes it to bench/results/directory_bench.json.

Replicas (docs/directory-replicas.md): `--replica-counts 0,1,2,3` runs the in-memory directory alone (0)
and 1..N replicas on one fresh etcd; each replica gets its own load process (plans minted there are its
own transfers), unpaced (layer events/s) and paced at `--paced-rate` in total (dispatch p99); etcd's
/metrics give its KV calls per transfer, and sequential PlanTransfer/ReportAllocation round trips the ms
etcd adds (each awaits one etcd commit). JSON + PNG: bench/results/directory_replicas_bench.{json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import pstats
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpush.client import ChannelConfig, DirectoryClient, EngineRegistration
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(RESULTS.parent))
from bench_io import write_result  # bench/, this script's folder

BLOCK_SIZE = 16
DECODE_BLOCKS = 1_000_000


def layout(layer_count: int) -> tpb.KVLayout:
    """A plausible layout (block_count large so the rotating allocator never collides)."""
    block_bytes = BLOCK_SIZE * 8 * 128 * 2 * 2
    return tpb.KVLayout(
        layer_count=layer_count, block_size_tokens=BLOCK_SIZE, block_count=DECODE_BLOCKS,
        block_bytes_per_layer=block_bytes, dtype="bfloat16", memory_kind=tpb.MEMORY_KIND_DRAM,
        planes=[tpb.KVPlane(block_stride_bytes=block_bytes, block_bytes=block_bytes, segment_count=1,
                            token_stride_bytes=block_bytes // BLOCK_SIZE,
                            segment_bytes_per_token=block_bytes // BLOCK_SIZE)],
        layer_base_addresses=[1 << 20] * layer_count, layer_region_bytes=block_bytes * DECODE_BLOCKS)


# ---------------------------------------------------------------------------- directory process


class DirectoryProcess:
    """The directory under test in its own process, pinned to one core; optionally under cProfile."""

    def __init__(self, core: int | None, profile_path: str | None, extra_flags: list[str]) -> None:
        with socket.socket() as probe:  # a free port: the directory logs only warnings here
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        command = [sys.executable]
        if profile_path:
            command += ["-m", "cProfile", "-o", profile_path]
        command += ["-m", "kvpush.cli.main", "directory", "--port", str(self.port), "--lease-ttl-s", "60",
                    "--transfer-ttl-s", "120", "--max-active-transfers-per-engine", "100000", *extra_flags]
        if core is not None and shutil.which("taskset"):
            command = ["taskset", "-c", str(core), *command]
        env = {**os.environ, "KVPUSH_LOG_FORMAT": "json", "KVPUSH_LOG_LEVEL": "WARNING"}
        env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
        env.pop("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", None)
        self.process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._collect, daemon=True).start()
        deadline = time.monotonic() + 180  # a loaded machine can take long to start a process
        while not self._healthy():
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.process.kill()
                raise RuntimeError(f"directory did not start: {self.lines[-5:]}")
            time.sleep(0.2)

    def _healthy(self) -> bool:
        channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
            return response.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False
        finally:
            channel.close()

    def _collect(self) -> None:
        for line in self.process.stderr:
            self.lines.append(line)

    def cpu_seconds(self) -> float:
        """User+system CPU the directory process used so far (from /proc)."""
        try:
            fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError):
            return float("nan")

    def stop(self) -> None:
        """SIGTERM and wait (bounded)."""
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


# ---------------------------------------------------------------------------- load generator


@dataclass
class Transfer:
    """One simulated request as the load generator tracks it."""

    transfer_id: str
    decode_engine_id: str
    events_left: list[tuple[int, int]]
    alloc_sent: float = 0.0
    first_ready_sent: float = 0.0
    # Wall-clock twins (both processes share this machine's clock) to split latency in and out.
    alloc_sent_wall: float = 0.0
    first_ready_sent_wall: float = 0.0
    instructed_wall: float = 0.0
    measured: bool = False
    instructed: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Stats:
    """Counters and samples of one scenario (within the measurement window)."""

    events: int = 0
    messages: int = 0
    transfers_planned: int = 0
    transfers_done: int = 0
    completions_seen: int = 0
    rejections: int = 0
    call_errors: dict[str, int] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list)
    inbound_ms: list[float] = field(default_factory=list)
    outbound_ms: list[float] = field(default_factory=list)
    measuring: bool = False


class Load:
    """N prefill workers and M decode engines driving one directory."""

    def __init__(self, address: str, args: argparse.Namespace, rate: float, batched: bool, tag: str,
                 tokens: dict[str, str] | None = None) -> None:
        self.address = address
        # Per-principal tokens ("operator", engine ids) when the directory runs with identities; None: open.
        self.tokens = tokens
        self.args = args
        self.rate = rate
        self.batched = batched
        self.tag = tag
        self.stats = Stats()
        self.prompt = args.chunks * args.chunk_tokens
        self.blocks_per_transfer = math.ceil(self.prompt / BLOCK_SIZE)
        self.block_cursor: dict[str, itertools.count] = {}
        self.transfers: dict[str, Transfer] = {}
        self.stopping = False
        self.total_done = 0
        self.admit_per_step = max(1, math.ceil(args.in_flight / (args.layers * args.chunks)))
        # Replicas: plans name this load's own decode engines (other replicas' loads register theirs too).
        self.pin_decode = bool(getattr(args, "pin_decode", False))
        self._decode_turn = itertools.count()
        # Fire-and-forget calls (_guard): the event loop holds tasks weakly, so this set keeps each one until it ends.
        self._background: set[asyncio.Task] = set()

    async def run(self) -> Stats:
        """Warm up, measure for the duration, drain; returns the stats of the window."""
        self.client = DirectoryClient(self._config("operator"))  # the gateway: plans and inspects
        registrations = []
        decode_ids = [f"{self.tag}-d{i}" for i in range(self.args.decode)]
        prefill_ids = [f"{self.tag}-p{i}" for i in range(self.args.prefill)]
        # One channel per simulated engine, each with its own credentials, as separate engine processes have.
        self.engine_clients = {e: DirectoryClient(self._config(e)) for e in (*decode_ids, *prefill_ids)}
        for engine_id in decode_ids:
            registration = EngineRegistration(self.engine_clients[engine_id], _register(
                engine_id, tpb.ENGINE_ROLE_DECODE, self.args.layers))
            await registration.start()
            registrations.append(registration)
            self.block_cursor[engine_id] = itertools.count()
        watchers = [asyncio.create_task(self._watch(engine_id)) for engine_id in decode_ids]
        await asyncio.sleep(0.2)
        workers = []
        for engine_id in prefill_ids:
            registration = EngineRegistration(self.engine_clients[engine_id], _register(
                engine_id, tpb.ENGINE_ROLE_PREFILL, self.args.layers))
            await registration.start()
            registrations.append(registration)
            workers.append(asyncio.create_task(self._prefill_worker(registration)))
        await asyncio.sleep(self.args.warmup_s)
        loop = asyncio.get_running_loop()
        self.stats.measuring = True
        started = loop.time()
        await asyncio.sleep(self.args.duration_s)
        self.stats.measuring = False
        self.elapsed_s = loop.time() - started
        self.stopping = True
        _, pending = await asyncio.wait(workers, timeout=120)
        for task in pending:  # a starved machine: report it rather than lose the whole run
            task.cancel()
            self.stats.call_errors["drain_timeout"] = self.stats.call_errors.get("drain_timeout", 0) + 1
        deadline = loop.time() + 30
        while self.stats.completions_seen < self.total_done and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for task in watchers:
            task.cancel()
        for registration in registrations:
            await registration.stop()
        await self.client.close()
        for client in self.engine_clients.values():
            await client.close()
        return self.stats

    def _config(self, principal: str) -> ChannelConfig:
        token = self.tokens[principal] if self.tokens else ""
        return ChannelConfig(address=self.address, timeout_s=30, token=token)

    async def _watch(self, engine_id: str) -> None:
        from kvpush.client.watch import watch_one  # this load's replica only: it owns its transfers

        async for event in watch_one(self.engine_clients[engine_id], engine_id):
            if event.state == tpb.TRANSFER_STATE_COMPLETE:
                self.stats.completions_seen += 1

    async def _allocate(self, transfer: Transfer) -> None:
        cursor = next(self.block_cursor[transfer.decode_engine_id])
        start = (cursor * self.blocks_per_transfer) % (DECODE_BLOCKS - self.blocks_per_transfer)
        transfer.alloc_sent = time.perf_counter()
        transfer.alloc_sent_wall = time.time()
        decode = self.engine_clients[transfer.decode_engine_id]
        await decode.stub.ReportAllocation(dpb.ReportAllocationRequest(
            transfer_id=transfer.transfer_id, engine_id=transfer.decode_engine_id,
            block_ids=range(start, start + self.blocks_per_transfer), prompt_token_count=self.prompt), timeout=30,
            metadata=decode.config.metadata)

    async def _plan(self, engine_id: str) -> Transfer:
        decode_engine_id = ""
        if self.pin_decode:
            decode_engine_id = f"{self.tag}-d{next(self._decode_turn) % self.args.decode}"
        response = await self.client.stub.PlanTransfer(dpb.PlanTransferRequest(
            prefill_engine_id=engine_id, decode_engine_id=decode_engine_id, prompt_token_count=self.prompt),
            timeout=30, metadata=self.client.config.metadata)
        record = response.transfer
        events = [(chunk, layer) for chunk in range(self.args.chunks) for layer in range(self.args.layers)]
        transfer = Transfer(record.transfer_id, record.decode_engine_id, events[::-1])
        self.transfers[transfer.transfer_id] = transfer
        if self.stats.measuring:
            self.stats.transfers_planned += 1
        self._spawn(self._guard("ReportAllocation", self._allocate(transfer)))
        return transfer

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _guard(self, name: str, coro) -> None:
        """Run a fire-and-forget call; count its failure instead of losing it."""
        try:
            await coro
        except grpc.aio.AioRpcError as error:
            key = f"{name}:{error.code().name}"
            self.stats.call_errors[key] = self.stats.call_errors.get(key, 0) + 1

    async def _split_latency(self, transfer: Transfer) -> None:
        """Paced runs only: split dispatch latency at the directory's own timestamps (same machine clock)."""
        record = (await self.client.stub.GetTransfer(
            dpb.GetTransferRequest(transfer_id=transfer.transfer_id), timeout=30,
            metadata=self.client.config.metadata)).transfer
        later_sent = max(transfer.alloc_sent_wall, transfer.first_ready_sent_wall)
        dispatched = record.dispatch_time.ToNanoseconds() / 1e9
        self.stats.inbound_ms.append((dispatched - later_sent) * 1e3)
        self.stats.outbound_ms.append((transfer.instructed_wall - dispatched) * 1e3)

    async def _read(self, call) -> None:
        async for message in call:
            kind = message.WhichOneof("message")
            if kind == "instruction":
                now = time.perf_counter()
                transfer = self.transfers.get(message.instruction.transfer_id)
                if transfer is not None:
                    transfer.instructed_wall = time.time()
                    if self.stats.measuring:
                        origin = max(transfer.alloc_sent, transfer.first_ready_sent)
                        self.stats.latencies_ms.append((now - origin) * 1e3)
                        transfer.measured = True
                    transfer.instructed.set()
            elif kind == "rejection":
                self.stats.rejections += 1

    async def _prefill_worker(self, registration: EngineRegistration) -> None:
        engine = self.engine_clients[registration.engine_id]
        call = engine.stub.StreamPrefill(metadata=engine.config.metadata)
        await call.write(dpb.StreamPrefillRequest(hello=dpb.Hello(
            engine_id=registration.engine_id, lease_id=registration.lease_id)))
        reader = asyncio.create_task(self._read(call))
        loop = asyncio.get_running_loop()
        in_flight: list[Transfer] = []
        pending_plans: list[asyncio.Task] = []
        per_worker_rate = self.rate / self.args.prefill if self.rate else 0.0
        next_step = loop.time()
        chunk_tokens = self.args.chunk_tokens
        while True:
            for plan in pending_plans:
                if plan.done():
                    if plan.exception() is None:
                        in_flight.append(plan.result())
                    else:
                        key = "PlanTransfer:" + getattr(plan.exception(), "code", lambda: "ERROR")().__str__()
                        self.stats.call_errors[key] = self.stats.call_errors.get(key, 0) + 1
            pending_plans = [p for p in pending_plans if not p.done()]
            if not self.stopping:
                # Admit few new requests per step, as an engine does: transfers start and end staggered
                # instead of in lockstep waves (whose bursts of plans would queue behind each other).
                missing = min(self.args.in_flight - len(in_flight) - len(pending_plans), self.admit_per_step)
                for _ in range(max(0, missing)):
                    pending_plans.append(asyncio.create_task(self._plan(registration.engine_id)))
            if self.stopping and not in_flight and not pending_plans:
                break
            if not in_flight:
                await asyncio.sleep(0.001)
                continue
            events = []
            now = time.perf_counter()
            finished = []
            for transfer in in_flight:
                if not transfer.events_left:
                    continue
                chunk, layer = transfer.events_left.pop()
                if not transfer.first_ready_sent:
                    transfer.first_ready_sent = now
                    transfer.first_ready_sent_wall = time.time()
                events.append(dpb.LayerReady(
                    transfer_id=transfer.transfer_id, layer_start=layer, layer_end=layer + 1,
                    token_start=chunk * chunk_tokens, token_end=(chunk + 1) * chunk_tokens,
                    prompt_token_count=self.prompt))
                if not transfer.events_left:
                    finished.append(transfer)
            if self.batched:
                await call.write(dpb.StreamPrefillRequest(ready=dpb.LayerReadyBatch(events=events)))
                messages = 1
            else:
                for event in events:
                    await call.write(dpb.StreamPrefillRequest(ready=dpb.LayerReadyBatch(events=[event])))
                messages = len(events)
            if self.stats.measuring:
                self.stats.events += len(events)
                self.stats.messages += messages
            for transfer in finished:
                if not transfer.instructed.is_set():
                    try:
                        await asyncio.wait_for(transfer.instructed.wait(), 30)
                    except TimeoutError:
                        self.stats.call_errors["instruction_timeout"] = self.stats.call_errors.get(
                            "instruction_timeout", 0) + 1
                await call.write(dpb.StreamPrefillRequest(result=dpb.WriteResult(
                    transfer_id=transfer.transfer_id, status=dpb.WRITE_RESULT_STATUS_DONE,
                    layers_written_count=self.args.layers, bytes_written=1)))
                in_flight.remove(transfer)
                if self.rate and transfer.measured:
                    self._spawn(self._guard("GetTransfer", self._split_latency(transfer)))
                self.transfers.pop(transfer.transfer_id, None)
                self.total_done += 1
                if self.stats.measuring:
                    self.stats.transfers_done += 1
            if per_worker_rate:
                next_step += len(events) / per_worker_rate
                delay = next_step - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                else:
                    next_step = loop.time()  # behind: do not burst to catch up
                    await asyncio.sleep(0)
            else:
                await asyncio.sleep(0)
        await call.done_writing()
        try:
            await asyncio.wait_for(reader, 10)
        except (TimeoutError, grpc.aio.AioRpcError):
            reader.cancel()


def _register(engine_id: str, role: int, layers: int) -> dpb.RegisterEngineRequest:
    return dpb.RegisterEngineRequest(engine_id=engine_id, role=role, tp_size=1, agent_name=f"{engine_id}-agent",
                                     agent_metadata=b"m" * 512 if role == tpb.ENGINE_ROLE_DECODE else b"",
                                     layout=layout(layers))


def _percentile(samples: list[float], q: float) -> float:
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def run_scenario(address: str, args, name: str, rate: float, batched: bool,
                       directory: DirectoryProcess, tokens: dict[str, str] | None = None) -> dict:
    """One scenario against the running directory; returns its figures."""
    load = Load(address, args, rate, batched, tag=name, tokens=tokens)
    cpu_before = directory.cpu_seconds()
    wall_before = time.perf_counter()
    stats = await load.run()
    cpu_used = directory.cpu_seconds() - cpu_before
    wall = time.perf_counter() - wall_before
    latencies = stats.latencies_ms
    return {
        "scenario": name,
        "target_events_per_s": rate or None,
        "batched": batched,
        "layer_events_per_s": round(stats.events / load.elapsed_s, 1),
        "messages_per_s": round(stats.messages / load.elapsed_s, 1),
        "transfers_per_s": round(stats.transfers_done / load.elapsed_s, 1),
        "dispatch_latency_ms": {
            "samples": len(latencies),
            "p50": round(_percentile(latencies, 50), 3),
            "p90": round(_percentile(latencies, 90), 3),
            "p99": round(_percentile(latencies, 99), 3),
            "max": round(max(latencies), 3) if latencies else None,
            "mean": round(statistics.fmean(latencies), 3) if latencies else None,
        },
        "latency_split_ms": {
            "client_send_to_directory_dispatch": {"p50": round(_percentile(stats.inbound_ms, 50), 3),
                                                  "p99": round(_percentile(stats.inbound_ms, 99), 3)},
            "directory_dispatch_to_client_arrival": {"p50": round(_percentile(stats.outbound_ms, 50), 3),
                                                     "p99": round(_percentile(stats.outbound_ms, 99), 3)},
        } if stats.inbound_ms else None,
        "rejections": stats.rejections,
        "call_errors": stats.call_errors,
        "directory_cpu_utilisation": round(cpu_used / wall, 3),
        "completions_seen": stats.completions_seen,
    }


async def unary_rtt_baseline(address: str, count: int = 1000, interval_s: float = 0.002,
                             token: str = "") -> dict:
    """Round trips of the cheapest unary call (GetTransfer of an unknown id: NOT_FOUND) on the same channel kind.

    It is the floor any dispatch latency sits on: one client->directory->client trip through gRPC Python.
    Paced like the latency scenario (one call every `interval_s`), so both see the same machine.
    """
    client = DirectoryClient(ChannelConfig(address=address, timeout_s=30, max_attempts=1, token=token))
    samples = []
    request = dpb.GetTransferRequest(transfer_id="baseline")
    for _ in range(count):
        started = time.perf_counter()
        try:
            await client.stub.GetTransfer(request, timeout=30, metadata=client.config.metadata)
        except grpc.aio.AioRpcError:
            pass
        samples.append((time.perf_counter() - started) * 1e3)
        await asyncio.sleep(interval_s)
    await client.close()
    return {"scenario": "unary_rtt_baseline", "calls": count,
            "rtt_ms": {"p50": round(_percentile(samples, 50), 3), "p90": round(_percentile(samples, 90), 3),
                       "p99": round(_percentile(samples, 99), 3)}}


def summarize_profile(path: str, top: int = 18) -> dict:
    """Top functions of the directory by own time, from its cProfile output."""
    stats = pstats.Stats(path)
    total = sum(v[2] for v in stats.stats.values()) or 1.0
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    handlers = sorted(((k, v) for k, v in stats.stats.items() if Path(k[0]).name in ("servicer.py", "state.py")),
                      key=lambda kv: kv[1][3], reverse=True)[:top]
    return {
        "by_own_time": [{"function": f"{Path(k[0]).name}:{k[1]}:{k[2]}", "own_s": round(v[2], 3),
                         "share": round(v[2] / total, 3), "calls": v[1]} for k, v in rows],
        "directory_code_by_cumulative_time": [
            {"function": f"{Path(k[0]).name}:{k[1]}:{k[2]}", "cumulative_s": round(v[3], 3), "calls": v[1],
             "cumulative_us_per_call": round(v[3] / max(v[1], 1) * 1e6, 1)} for k, v in handlers],
        "profiled_total_s": round(total, 3),
    }


def main() -> None:
    """Run every scenario and print/write the JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--prefill", type=int, default=4, help="simulated prefill workers (streams)")
    parser.add_argument("--decode", type=int, default=4, help="simulated decode engines")
    parser.add_argument("--in-flight", type=int, default=32, help="concurrent transfers per prefill worker")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=4, help="chunked-prefill steps per prompt")
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--paced-rate", type=float, default=5000.0)
    parser.add_argument("--scenarios", default="max_batched,max_unbatched,paced_5k,unary_rtt_baseline")
    parser.add_argument("--directory-core", type=int, default=0)
    parser.add_argument("--load-core", type=int, default=1)
    parser.add_argument("--no-pin", action="store_true", help="do not pin the two processes to cores")
    parser.add_argument("--no-uvloop", action="store_true", help="directory and load on asyncio's default loop")
    parser.add_argument("--nice", type=int, default=0,
                        help="run directory and load at this niceness (negative needs root): on a shared machine, "
                             "stands in for the dedicated core a production directory has")
    parser.add_argument("--realtime", action="store_true",
                        help="paced scenarios only: run directory and load under SCHED_FIFO (root) so other work on a "
                             "shared machine cannot delay them; refused with the unpaced scenarios, which would "
                             "starve a core")
    parser.add_argument("--profile", action="store_true", help="profile the directory; report where time goes")
    parser.add_argument("--auth-modes", default="off",
                        help="comma list of off (no identities) and tokens (per-engine tokens file, every call "
                             "authorised): each mode gets its own directory process, scenarios run per mode")
    args = parser.parse_args()

    cores = os.cpu_count() or 1
    load_at_start = os.getloadavg()  # other work on the machine skews latency: reported with the figures
    pin = cores > 1 and not args.no_pin
    directory_core = args.directory_core if pin else None
    if pin and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.load_core})
    profile_path = tempfile.mktemp(suffix=".prof") if args.profile else None
    if args.nice:
        os.nice(args.nice)  # the directory process inherits it
    if args.realtime:
        if any(name.startswith("max") for name in args.scenarios.split(",")):
            parser.error("--realtime is only for paced scenarios")
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))  # inherited by the directory process
    scenarios = {
        "max_batched": (0.0, True),
        "max_unbatched": (0.0, False),
        "paced_5k": (args.paced_rate, True),
    }
    results = []
    for auth in args.auth_modes.split(","):
        tokens, flags = None, ["--no-uvloop"] if args.no_uvloop else []
        if auth == "tokens":
            principals = ["operator"] + [f"{name}-{kind}{i}" for name in args.scenarios.split(",")
                                         for kind, count in (("d", args.decode), ("p", args.prefill))
                                         for i in range(count)]
            tokens = {p: f"bench-{p}-{os.urandom(8).hex()}" for p in principals}
            tokens_file = Path(tempfile.mkdtemp()) / "tokens"
            tokens_file.write_text("".join(f"{'operator' if p == 'operator' else 'engine/' + p} {t}\n"
                                           for p, t in tokens.items()))
            flags += ["--tokens-file", str(tokens_file)]
        elif auth != "off":
            parser.error(f"unknown auth mode {auth!r}")
        directory = DirectoryProcess(directory_core, profile_path, flags)
        address = f"127.0.0.1:{directory.port}"
        try:
            for name in args.scenarios.split(","):
                if name == "unary_rtt_baseline":
                    runner = unary_rtt_baseline(address, token=tokens["operator"] if tokens else "")
                else:
                    rate, batched = scenarios[name]
                    runner = run_scenario(address, args, name, rate, batched, directory, tokens)
                if args.no_uvloop:
                    results.append(asyncio.run(runner))
                else:
                    import uvloop

                    results.append(uvloop.run(runner))
                results[-1]["auth"] = auth
                print(json.dumps(results[-1]), file=sys.stderr, flush=True)
        finally:
            directory.stop()
    by_name = {r["scenario"]: r for r in results if r["auth"] == "off"} or {r["scenario"]: r for r in results}
    ratios = {}
    with_tokens = {r["scenario"]: r for r in results if r["auth"] == "tokens"}
    for name in ("max_batched", "max_unbatched", "paced_5k"):
        if name in by_name and name in with_tokens and by_name[name]["auth"] == "off":
            ratios[f"{name}_tokens_over_off_events_per_s"] = round(
                with_tokens[name]["layer_events_per_s"] / by_name[name]["layer_events_per_s"], 3)
    if "max_batched" in by_name and "max_unbatched" in by_name:
        ratios["batched_over_unbatched_events_per_s"] = round(
            by_name["max_batched"]["layer_events_per_s"] / by_name["max_unbatched"]["layer_events_per_s"], 2)
    report = {
        "benchmark": "directory_control_plane",
        "load_average_at_start": load_at_start,
        "load_average_at_end": os.getloadavg(),
        "command": "python " + " ".join(sys.argv),
        "directory_pinned_core": directory_core,
        "load_pinned_core": args.load_core if pin else None,
        "event_loop": "asyncio" if args.no_uvloop else "uvloop",
        "niceness": args.nice,
        "realtime_sched_fifo": args.realtime,
        "workload": {"prefill_workers": args.prefill, "decode_engines": args.decode,
                     "in_flight_per_worker": args.in_flight, "layers": args.layers, "chunks": args.chunks,
                     "events_per_transfer": args.layers * args.chunks, "duration_s": args.duration_s},
        "scenarios": results,
        "ratios": ratios,
        "targets": {"layer_events_per_s": 20000, "p99_ms_at_5k": 2.0},
    }
    if profile_path and os.path.exists(profile_path):
        report["directory_profile_top_own_time"] = summarize_profile(profile_path)
        os.unlink(profile_path)
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "directory_bench_profile" if args.profile else "directory_bench"
    if args.auth_modes != "off":
        name += "_auth"
    suffix = "_realtime" if args.realtime else f"_nice{args.nice}" if args.nice else ""
    write_result(RESULTS / f"{name}{suffix}.json", report)


# ---------------------------------------------------------------------------- replicas on etcd


class EtcdProcess:
    """A fresh single-member etcd on loopback (a temporary data dir), for the replica runs."""

    def __init__(self) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            raise SystemExit("etcd is not installed (scripts/setup.sh installs Debian's etcd-server)")
        ports = []
        for _ in range(2):
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                ports.append(probe.getsockname()[1])
        self.client_port, peer = ports
        self.endpoint = f"127.0.0.1:{self.client_port}"
        self.data = tempfile.mkdtemp(prefix="kvpush-bench-etcd-")
        self.process = subprocess.Popen(
            [binary, "--name", "bench", "--data-dir", self.data, "--listen-client-urls", f"http://{self.endpoint}",
             "--advertise-client-urls", f"http://{self.endpoint}", "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"bench=http://127.0.0.1:{peer}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def metrics(self) -> dict[str, float]:
        """etcd's gRPC calls handled so far, by method (from its /metrics)."""
        import urllib.request

        text = urllib.request.urlopen(f"http://{self.endpoint}/metrics", timeout=5).read().decode()
        counts: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("grpc_server_handled_total{"):
                method = line.split('grpc_method="', 1)[1].split('"', 1)[0]
                counts[method] = counts.get(method, 0.0) + float(line.rsplit(" ", 1)[1])
        return counts

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)
        shutil.rmtree(self.data, ignore_errors=True)


def _wait_shards(addresses: list[str], replica_count: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        channel = grpc.insecure_channel(addresses[0])
        try:
            from kvpush.v1 import directory_pb2_grpc as dgrpc

            response = dgrpc.KVDirectoryServiceStub(channel).GetReplicas(dpb.GetReplicasRequest(), timeout=2)
            owners = list(response.shard_owner_replica_ids)
            if len(response.replicas) == replica_count and all(owners) and len(set(owners)) == replica_count:
                return
        except grpc.RpcError:
            pass
        finally:
            channel.close()
        time.sleep(0.2)
    raise RuntimeError("replicas never took every shard")


def _load_process(address: str, args, name: str, rate: float, tag: str) -> subprocess.Popen:
    # Paced: few transfers in flight, so new ones keep starting (and being measured) within the window.
    in_flight = args.paced_in_flight if rate else args.in_flight
    command = [sys.executable, __file__, "--load-only", address, "--load-tag", tag, "--load-scenario", name,
               "--load-rate", str(rate), "--duration-s", str(args.duration_s), "--warmup-s", str(args.warmup_s),
               "--prefill", str(args.prefill), "--decode", str(args.decode), "--in-flight", str(in_flight),
               "--layers", str(args.layers), "--chunks", str(args.chunks), "--chunk-tokens", str(args.chunk_tokens)]
    env = {**os.environ, "KVPUSH_LOG_LEVEL": "WARNING"}
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)


def load_only(args) -> None:
    """One replica's load (a process of its own, so N replicas get N load generators); JSON on stdout."""
    args.pin_decode = True
    load = Load(args.load_only, args, args.load_rate, True, tag=args.load_tag)
    started = time.perf_counter()
    stats = asyncio.run(load.run())
    print(json.dumps({"events": stats.events, "elapsed_s": load.elapsed_s, "transfers_done": stats.transfers_done,
                      "transfers_done_whole_run": load.total_done,
                      "latencies_ms": stats.latencies_ms, "call_errors": stats.call_errors,
                      "rejections": stats.rejections, "wall_s": time.perf_counter() - started}))


async def _unary_cost(address: str, count: int) -> dict:
    """Sequential PlanTransfer + ReportAllocation round trips (each awaits one etcd commit on a replica)."""
    client = DirectoryClient(ChannelConfig(address=address, timeout_s=30))
    tag = f"cost{os.getpid()}"
    registrations = [EngineRegistration(client, _register(f"{tag}-p", tpb.ENGINE_ROLE_PREFILL, 4)),
                     EngineRegistration(client, _register(f"{tag}-d", tpb.ENGINE_ROLE_DECODE, 4))]
    for registration in registrations:
        await registration.start()
    await asyncio.sleep(0.5)
    plan_ms, allocation_ms = [], []
    for index in range(count):
        started = time.perf_counter()
        response = await client.stub.PlanTransfer(dpb.PlanTransferRequest(
            prefill_engine_id=f"{tag}-p", decode_engine_id=f"{tag}-d", prompt_token_count=16), timeout=30)
        plan_ms.append((time.perf_counter() - started) * 1e3)
        started = time.perf_counter()
        await client.stub.ReportAllocation(dpb.ReportAllocationRequest(
            transfer_id=response.transfer.transfer_id, engine_id=f"{tag}-d", block_ids=[index % 1000],
            prompt_token_count=16), timeout=30)
        allocation_ms.append((time.perf_counter() - started) * 1e3)
        await client.stub.CancelTransfer(dpb.CancelTransferRequest(transfer_id=response.transfer.transfer_id),
                                         timeout=30)
    for registration in registrations:
        await registration.stop()
    await client.close()
    return {"plan_ms_p50": round(_percentile(plan_ms, 50), 3), "plan_ms_p99": round(_percentile(plan_ms, 99), 3),
            "allocation_ms_p50": round(_percentile(allocation_ms, 50), 3),
            "allocation_ms_p99": round(_percentile(allocation_ms, 99), 3), "calls": count}


def replicas_main(args) -> None:
    """1..N replicas on one etcd (and the in-memory directory alone, `0`): events/s, dispatch p99, etcd cost."""
    counts = [int(c) for c in args.replica_counts.split(",")]
    rows = []
    for count in counts:
        etcd = EtcdProcess() if count else None
        directories = []
        try:
            for index in range(max(1, count)):
                flags = ["--no-uvloop"] if args.no_uvloop else []
                if etcd is not None:
                    flags += ["--etcd-endpoints", etcd.endpoint, "--replica-id", f"r{index}", "--shard-count", "16"]
                directories.append(DirectoryProcess(None, None, flags))
            addresses = [f"127.0.0.1:{d.port}" for d in directories]
            if etcd is not None:
                _wait_shards(addresses, count)
            row = {"replicas": count, "etcd": etcd is not None}
            for name, rate in (("max_batched", 0.0), ("paced", args.paced_rate)):
                before = etcd.metrics() if etcd is not None else {}
                loads = [_load_process(address, args, name, rate / len(addresses), f"{name}-r{i}")
                         for i, address in enumerate(addresses)]
                outputs = [json.loads(load.communicate(timeout=600)[0].strip().splitlines()[-1]) for load in loads]
                after = etcd.metrics() if etcd is not None else {}
                events = sum(o["events"] for o in outputs)
                elapsed = max(o["elapsed_s"] for o in outputs)
                transfers = sum(o["transfers_done"] for o in outputs)
                latencies = [x for o in outputs for x in o["latencies_ms"]]
                figures = {"layer_events_per_s": round(events / elapsed, 1),
                           "transfers_per_s": round(transfers / elapsed, 1),
                           "dispatch_p50_ms": round(_percentile(latencies, 50), 3),
                           "dispatch_p99_ms": round(_percentile(latencies, 99), 3),
                           "call_errors": [o["call_errors"] for o in outputs if o["call_errors"]]}
                if etcd is not None:
                    calls = {m: after.get(m, 0) - before.get(m, 0) for m in after}
                    kv_calls = sum(calls.get(m, 0) for m in ("Txn", "Put", "Range", "DeleteRange"))
                    figures["etcd_calls"] = {m: int(v) for m, v in calls.items() if v}
                    # Every transfer of the run (warm-up and drain included) against every KV call: a Txn
                    # commits many transfers' writes at once under load; shard scans add Ranges.
                    run_transfers = max(1, sum(o["transfers_done_whole_run"] for o in outputs))
                    figures["etcd_kv_calls_per_transfer"] = round(kv_calls / run_transfers, 2)
                    figures["transfers_whole_run"] = run_transfers
                row[name] = figures
                print(json.dumps({"replicas": count, name: figures}), file=sys.stderr, flush=True)
            cost = asyncio.run(_unary_cost(addresses[0], 200))
            row["unary_cost"] = cost
            rows.append(row)
        finally:
            for directory in directories:
                directory.stop()
            if etcd is not None:
                etcd.stop()
    baseline = next((r for r in rows if r["replicas"] == 0), None)
    if baseline is not None:
        for row in rows:
            if row["etcd"]:
                row["etcd_added_ms"] = {
                    "plan_p50": round(row["unary_cost"]["plan_ms_p50"] - baseline["unary_cost"]["plan_ms_p50"], 3),
                    "allocation_p50": round(row["unary_cost"]["allocation_ms_p50"]
                                            - baseline["unary_cost"]["allocation_ms_p50"], 3)}
    report = {"benchmark": "directory_replicas",
              "load_average_at_start": os.getloadavg(),
              "workload_per_replica": {"prefill_workers": args.prefill, "decode_engines": args.decode,
                                       "in_flight_per_worker": args.in_flight, "layers": args.layers,
                                       "chunks": args.chunks, "duration_s": args.duration_s,
                                       "paced_rate_total": args.paced_rate},
              "rows": rows}
    write_result(RESULTS / "directory_replicas_bench.json", report)
    _plot_replicas(report, RESULTS / "directory_replicas_bench.png")


def _plot_replicas(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    labels = ["in-memory" if not r["etcd"] else f"{r['replicas']} replica{'s' if r['replicas'] > 1 else ''}"
              for r in rows]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(labels, [r["max_batched"]["layer_events_per_s"] for r in rows], color="tab:blue")
    left.set_ylabel("layer events/s (unpaced)")
    left.set_title("throughput")
    right.bar(labels, [r["paced"]["dispatch_p99_ms"] for r in rows], color="tab:orange")
    right.set_ylabel(f"dispatch p99 ms at {report['workload_per_replica']['paced_rate_total']:.0f} events/s")
    right.set_title("dispatch latency")
    figure.suptitle(f"KV-directory replicas on etcd ({report['machine']['cpus']} CPUs)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    if "--load-only" in sys.argv or "--replica-counts" in sys.argv:
        extra = argparse.ArgumentParser()
        for flag, kind, default in (("--duration-s", float, 10.0), ("--warmup-s", float, 2.0),
                                    ("--prefill", int, 2), ("--decode", int, 2), ("--in-flight", int, 32),
                                    ("--layers", int, 32), ("--chunks", int, 4), ("--chunk-tokens", int, 512),
                                    ("--paced-rate", float, 2000.0), ("--load-rate", float, 0.0),
                                    ("--paced-in-flight", int, 4)):
            extra.add_argument(flag, type=kind, default=default)
        extra.add_argument("--load-only", default="")
        extra.add_argument("--load-tag", default="")
        extra.add_argument("--load-scenario", default="")
        extra.add_argument("--replica-counts", default="",
                           help="e.g. 0,1,2,3: 0 is the in-memory directory alone; N replicas share one etcd")
        extra.add_argument("--no-uvloop", action="store_true")
        parsed = extra.parse_args()
        load_only(parsed) if parsed.load_only else replicas_main(parsed)
    else:
        main()
