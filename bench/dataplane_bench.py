"""NIXL data-plane benchmark: PushWriter WRITE throughput against a plain memory copy, same run.

Two processes on one machine, as in production: this process is the prefill side (random KV, a
TransferAgent + PushWriter), a spawned process is the decode side (zeroed KV, a TransferAgent + a
NotificationListener that timestamps every notification). Realistic layout by default: 32 layers,
128-token blocks, 8 KV heads x 128 dims, bf16, FlashAttention K/V-first NHD (2 planes, 256 KiB per
plane-block, 512 KiB per block per layer).

Cases (each `--reps` times, median and best reported; GiB/s = bytes / (submit -> transfer outcome);
the ratio to memcpy is taken per repetition with a memcpy of the same bytes run just before it,
because this 2-core machine's bandwidth drifts with other load, and its median is reported):
  memcpy              np.copyto of the same bytes, one thread (the ceiling on this machine)
  whole_contiguous    one write of all layers, consecutive blocks on both sides (merged descriptors)
  whole_scattered     one write of all layers, shuffled source and destination blocks
  per_layer_*         one write per layer (32 submits), one handle each, notification on the last:
                      the per-layer cost
  per_layer_grouped_* the same submits with the writer's grouping on: writes that are ready together
                      share a handle (what happens when the writer falls behind)
  mismatch_16_128     prefill blocks of 16 tokens into decode blocks of 128, scattered
Each case reports post time, descriptor counts (NIXL telemetry), and the notification's arrival
after the writer saw the transfer done (CLOCK_MONOTONIC is shared by the two processes).

  bare_nixl_contiguous  the contiguous write with a bare nixl_agent (prepped once, polled every 100 us):
                      NIXL's own ceiling, so the writer's overhead shows

Usage:  python bench/dataplane_bench.py [--tokens 2048] [--reps 5] [--num-threads 0] [--prog-thread] [--telemetry]
Prints JSON and writes bench/results/dataplane_bench.json.

Two hosts (checking a P->D link, e.g. EFA with --backend LIBFABRIC; deploy/ec2-efa/README.md): on the decode
host `--serve-decode 0.0.0.0:PORT` runs the decode side and waits for one prefill host; on the prefill host
`--decode-at DHOST:PORT` runs the cases against it. Both read the shared secret KVPUSH_BENCH_AUTHKEY, and
need the same --tokens/--backend/--num-threads. Notification lags then mix two hosts' clocks: ignore them. The
GPU variant (dataplane_gpu_bench.py) reuses the receiver and the cases with torch tensors on two GPUs.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvpush.connector.worker.layout_wire import layout_from_proto, layout_to_proto
from kvpush.dataplane import KVLayoutSpec, NixlConfig, PushWriter, TransferAgent, WriteOutcome, WriteRequest
from kvpush.v1 import types_pb2

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(RESULTS.parent))
from bench_io import write_result  # bench/, this script's folder

LAYOUT_HINT = "kv_first"


@dataclass(frozen=True)
class KVShape:
    """A per-worker KV cache: layers x blocks of block_size tokens x heads x head_size (bf16)."""

    layers: int = 32
    blocks: int = 64
    block_size: int = 128
    heads: int = 8
    head_size: int = 128

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer, K and V."""
        return 2 * self.block_size * self.heads * self.head_size * 2


class HostTensor:
    """A numpy array with the torch-like attributes describe_kv_caches reads."""

    def __init__(self, array: np.ndarray) -> None:
        self.array, self.shape, self.dtype = array, array.shape, "bfloat16"

    def data_ptr(self) -> int:
        return int(self.array.ctypes.data)

    def element_size(self) -> int:
        return 2

    def stride(self) -> tuple[int, ...]:
        return tuple(s // 2 for s in self.array.strides)


def host_kv(shape: KVShape, random: bool) -> dict[str, HostTensor]:
    """Per-layer (2, blocks, block_size, heads, head_size) uint16 arrays, random or zero."""
    rng = np.random.default_rng(0)
    dims = (2, shape.blocks, shape.block_size, shape.heads, shape.head_size)
    return {
        f"layers.{i}": HostTensor(
            rng.integers(0, 65535, dims, dtype=np.uint16) if random else np.zeros(dims, np.uint16))
        for i in range(shape.layers)
    }


# ---- decode side (spawned) ----------------------------------------------------------------------
def receiver_main(conn: Any, shape: KVShape, device: str, config: dict[str, Any], name: str) -> None:
    """Decode process: register zeroed KV on `device`, timestamp notifications, answer commands."""
    from kvpush.dataplane import NotificationListener

    if device == "cpu":
        caches: dict[str, Any] = host_kv(shape, random=False)
    else:
        import torch

        torch.cuda.set_device(device)  # NIXL/UCX register VRAM in the current CUDA context
        caches = {
            f"layers.{i}": torch.zeros(2, shape.blocks, shape.block_size, shape.heads, shape.head_size,
                                       dtype=torch.bfloat16, device=device)
            for i in range(shape.layers)
        }
    agent = TransferAgent(name, NixlConfig(**config))
    agent.register(caches, shape.block_size, shape.heads, shape.head_size, LAYOUT_HINT)
    agent.start()
    notes: list[tuple[float, bytes]] = []
    lock = threading.Lock()

    def on_notification(_agent: str, message: bytes) -> None:
        with lock:
            notes.append((time.monotonic(), message))

    NotificationListener(agent, on_notification)
    conn.send((agent.agent_metadata(), layout_to_proto(agent.layout).SerializeToString()))
    while True:
        cmd, arg = conn.recv()
        if cmd == "notifs":
            with lock:
                conn.send(list(notes))
                notes.clear()
        elif cmd == "block":
            layer, block = arg
            tensor = caches[f"layers.{layer}"]
            data = tensor.array[:, block] if device == "cpu" else tensor[:, block].cpu().view(torch.uint16).numpy()
            conn.send(np.ascontiguousarray(data).tobytes())
        elif cmd == "exit":
            agent.stop()
            conn.send("bye")
            return


def _authkey() -> bytes:
    key = os.environ.get("KVPUSH_BENCH_AUTHKEY", "")
    if not key:
        raise SystemExit("set KVPUSH_BENCH_AUTHKEY to the same secret on both hosts")
    return key.encode()


def serve_decode(address: str, shape: KVShape, config: dict[str, Any]) -> None:
    """Decode host: accept one prefill host, then serve its commands until it says exit."""
    from multiprocessing.connection import Listener

    host, _, port = address.rpartition(":")
    with Listener((host, int(port)), authkey=_authkey()) as listener:
        print(f"decode side listening on {address}; waiting for the prefill host", flush=True)
        with listener.accept() as conn:
            receiver_main(conn, shape, "cpu", config, "bench-decode")


class Receiver:
    """Handle on the decode process."""

    def __init__(self, shape: KVShape, device: str, config: dict[str, Any], name: str = "bench-decode",
                 visible_devices: str | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=receiver_main, args=(child, shape, device, config, name), daemon=True)
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible_devices is not None:  # the child inherits the environment at start
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
        try:
            self.process.start()
        finally:
            if visible_devices is not None:
                if saved is None:
                    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = saved
        if not self.conn.poll(300):
            raise RuntimeError("receiver did not start")
        self.metadata, layout_bytes = self.conn.recv()
        self.layout = layout_from_proto(types_pb2.KVLayout.FromString(layout_bytes))
        self.name = name

    def notifs(self) -> list[tuple[float, bytes]]:
        self.conn.send(("notifs", None))
        return self.conn.recv()

    def block(self, layer: int, block: int) -> bytes:
        self.conn.send(("block", (layer, block)))
        return self.conn.recv()

    def close(self) -> None:
        if self.process.is_alive():
            self.conn.send(("exit", None))
            self.conn.poll(30) and self.conn.recv()
        self.process.join(30)


class RemoteReceiver(Receiver):
    """Handle on a decode side served by `--serve-decode` on another host (the same commands, over TCP)."""

    def __init__(self, address: str) -> None:
        from multiprocessing.connection import Client

        host, _, port = address.rpartition(":")
        self.conn = Client((host, int(port)), authkey=_authkey())
        if not self.conn.poll(300):
            raise RuntimeError(f"decode side at {address} did not answer")
        self.metadata, layout_bytes = self.conn.recv()
        self.layout = layout_from_proto(types_pb2.KVLayout.FromString(layout_bytes))
        self.name = "bench-decode"

    def close(self) -> None:
        self.conn.send(("exit", None))
        self.conn.poll(30) and self.conn.recv()


# ---- prefill side -------------------------------------------------------------------------------
@dataclass
class CaseResult:
    """Figures of one case over its repetitions."""

    name: str
    bytes: int
    writes: int
    gib_s_median: float = 0.0
    gib_s_best: float = 0.0
    seconds_median: float = 0.0
    post_ms_per_write_median: float = 0.0
    descriptors_per_write: float = 0.0
    table_entries_per_write: float = 0.0
    nixl_xfer_ms_median: float | None = None
    notif_after_done_ms_median: float | None = None
    notif_on_handle: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class Sender:
    """Prefill agent + writer; runs a transfer and waits for its outcome."""

    def __init__(self, agent: TransferAgent) -> None:
        self.agent = agent
        self._done = threading.Event()
        self.requests: list[WriteOutcome] = []
        self.final: WriteOutcome | None = None
        self.done_at = 0.0
        self.writer = PushWriter(agent, self.requests.append, self._on_transfer)

    def _on_transfer(self, outcome: WriteOutcome) -> None:
        self.done_at = time.monotonic()
        self.final = outcome
        self._done.set()

    def run(self, requests: list[WriteRequest],
            timeout: float = 120.0) -> tuple[float, WriteOutcome, list[WriteOutcome]]:
        """Submit `requests`, wait for the transfer outcome; return (seconds, final, per-request)."""
        self._done.clear()
        self.requests.clear()
        start = time.monotonic()
        for request in requests:
            self.writer.submit(request)
        if not self._done.wait(timeout):
            raise RuntimeError("transfer did not finish")
        assert self.final is not None
        if not self.final.ok:
            raise RuntimeError(f"transfer failed: {self.final.error}")
        return self.done_at - start, self.final, list(self.requests)


def requests_for(tid: str, peer: str, layers: int, src_ids: list[int], dst_ids: list[int], tokens: int,
                 per_layer: bool, events: list[Any] | None = None) -> list[WriteRequest]:
    """One whole-request write, or one write per layer with the notification on the last."""
    if not per_layer:
        return [WriteRequest(tid, peer, range(layers), src_ids, dst_ids, 0, tokens, notify=tid.encode())]
    return [
        WriteRequest(tid, peer, range(layer, layer + 1), src_ids, dst_ids, 0, tokens,
                     notify=tid.encode() if layer == layers - 1 else None,
                     ready_event=events[layer] if events else None)
        for layer in range(layers)
    ]


def run_case(name: str, sender: Sender, receiver: Receiver, reps: int, make_requests, ceiling=None) -> CaseResult:
    """Run one case `reps` times (after one warm-up) and summarise.

    `ceiling()` (optional) runs one copy of the same bytes and returns its seconds; it runs right
    before every repetition, so each ratio compares the two under the same machine load.
    """
    sender.run(make_requests(f"{name}-warmup"))
    receiver.notifs()
    seconds, posts, xfers, descriptors, entries, done_at, ratios = [], [], [], [], [], {}, []
    total_bytes, writes, on_handle = 0, 0, False
    for rep in range(reps):
        tid = f"{name}-{rep}"
        reqs = make_requests(tid)
        ceiling_s = ceiling() if ceiling else None
        elapsed, final, per_request = sender.run(reqs)
        if ceiling_s is not None:
            ratios.append(ceiling_s / elapsed)
        done_at[tid.encode()] = sender.done_at
        seconds.append(elapsed)
        total_bytes, writes = final.bytes, final.write_count
        posts.extend(o.post_seconds for o in per_request)
        descriptors.extend(o.descriptor_count for o in per_request)
        entries.append(sum(_plan_entries(sender, r) for r in reqs) / len(reqs))
        if per_request[0].telemetry:
            xfers.append(max(o.telemetry["xfer_us"] for o in per_request) / 1e3)
        on_handle = per_request[-1].notified
    notif_lag = [(t - done_at[m]) * 1e3 for t, m in receiver.notifs() if m in done_at]
    gib = [total_bytes / s / 2**30 for s in seconds]
    return CaseResult(
        name=name,
        bytes=total_bytes,
        writes=writes,
        gib_s_median=round(statistics.median(gib), 3),
        gib_s_best=round(max(gib), 3),
        seconds_median=round(statistics.median(seconds), 6),
        post_ms_per_write_median=round(statistics.median(posts) * 1e3, 4),
        descriptors_per_write=round(statistics.mean(descriptors), 1),
        table_entries_per_write=round(statistics.mean(entries), 1),
        nixl_xfer_ms_median=round(statistics.median(xfers), 4) if xfers else None,
        notif_after_done_ms_median=round(statistics.median(notif_lag), 4) if notif_lag else None,
        notif_on_handle=on_handle,
        extra={"vs_ceiling_interleaved_median": round(statistics.median(ratios), 3),
               "vs_ceiling_interleaved_best": round(max(ratios), 3)} if ratios else {},
    )


def _plan_entries(sender: Sender, request: WriteRequest) -> int:
    from kvpush.dataplane.plan import plan_write

    plan = plan_write(sender.agent.layout, sender.agent.peer_layout(request.peer_agent), request.layers,
                      request.src_block_ids, request.dst_block_ids, request.token_start, request.token_end)
    return plan.table_descriptor_count + int(plan.explicit.shape[0])


class Memcpy:
    """One-thread np.copyto of `nbytes` between two pre-faulted buffers; each call returns seconds."""

    def __init__(self, nbytes: int) -> None:
        self.src = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
        self.dst = np.zeros_like(self.src)
        np.copyto(self.dst, self.src)

    def __call__(self) -> float:
        start = time.perf_counter()
        np.copyto(self.dst, self.src)
        return time.perf_counter() - start


def memcpy_case(nbytes: int, reps: int) -> CaseResult:
    """np.copyto of `nbytes` between two buffers, one thread: the copy ceiling."""
    src = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    np.copyto(dst, src)
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        np.copyto(dst, src)
        seconds.append(time.perf_counter() - start)
    gib = [nbytes / s / 2**30 for s in seconds]
    return CaseResult("memcpy", nbytes, 1, round(statistics.median(gib), 3), round(max(gib), 3),
                      round(statistics.median(seconds), 6))


def bare_nixl_case(kv: dict[str, Any], layout: KVLayoutSpec, receiver: Receiver, src: list[int], dst: list[int],
                   reps: int, ceiling) -> CaseResult:
    """The same contiguous write with a bare nixl_agent on this thread: NIXL's own ceiling, no writer.

    One descriptor per (layer, plane) (what the writer's plan merges to), prepared once, then
    make_prepped_xfer + transfer + check_xfer_state every 100 us, as in REFERENCE's measurements.
    """
    from kvpush.dataplane.config import _nixl_modules

    api, _ = _nixl_modules()
    agent = api.nixl_agent("bench-bare", api.nixl_agent_config(enable_prog_thread=False))
    agent.register_memory(np.array([(a, n, 0) for a, n in layout.memory_regions()], dtype=np.uint64), "DRAM")
    name = agent.add_remote_agent(receiver.metadata)
    remote = receiver.layout
    local_rows, remote_rows = [], []
    for layer in range(layout.layer_count):
        for plane in range(len(layout.planes)):
            length = len(src) * layout.planes[plane].block_bytes
            local_rows.append((layout.plane_block_address(layer, src[0], plane), length, 0))
            remote_rows.append((remote.plane_block_address(layer, dst[0], plane), length, 0))
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.array(local_rows, dtype=np.uint64), "DRAM")
    far = agent.prep_xfer_dlist(name, np.array(remote_rows, dtype=np.uint64), "DRAM")
    indices = np.arange(len(local_rows), dtype=np.int32)
    nbytes = sum(row[1] for row in local_rows)
    seconds, ratios = [], []
    for rep in range(reps + 1):
        ceiling_s = ceiling()
        start = time.perf_counter()
        handle = agent.make_prepped_xfer("WRITE", local, indices, far, indices)
        state = agent.transfer(handle)
        while state == "PROC":
            time.sleep(1e-4)
            state = agent.check_xfer_state(handle)
        elapsed = time.perf_counter() - start
        agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"bare NIXL write ended {state}")
        if rep:  # the first one connects
            seconds.append(elapsed)
            ratios.append(ceiling_s / elapsed)
    agent.release_dlist_handle(local)
    agent.release_dlist_handle(far)
    agent.remove_remote_agent(name)
    gib = [nbytes / s / 2**30 for s in seconds]
    return CaseResult("bare_nixl_contiguous", nbytes, 1, round(statistics.median(gib), 3), round(max(gib), 3),
                      round(statistics.median(seconds), 6), descriptors_per_write=len(local_rows),
                      extra={"vs_ceiling_interleaved_median": round(statistics.median(ratios), 3),
                             "vs_ceiling_interleaved_best": round(max(ratios), 3)})


def block_ids(count: int, limit: int, scattered: bool, seed: int, offset: int = 0) -> list[int]:
    """`count` ids out of [0, limit): consecutive from `offset`, or shuffled (never two neighbours in order)."""
    if not scattered:
        return list(range(offset, offset + count))
    ids = np.random.default_rng(seed).permutation(limit)[:count]
    return [int(x) for x in ids]


def verify(sender_kv: dict[str, Any], receiver: Receiver, src_ids: list[int], dst_ids: list[int],
           layers: list[int]) -> bool:
    """Byte-compare a few destination blocks with their sources."""
    for layer in layers:
        for s, d in list(zip(src_ids, dst_ids))[:: max(1, len(src_ids) // 4)]:
            src = np.ascontiguousarray(sender_kv[f"layers.{layer}"].array[:, s]).tobytes()
            if receiver.block(layer, d) != src:
                return False
    return True


def main() -> None:
    """Run every case, print JSON, write bench/results/dataplane_bench.json."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per request (multiple of 128)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--num-threads", type=int, default=0)
    parser.add_argument("--prog-thread", action="store_true", help="NIXL progress thread on (paced, 100 us)")
    parser.add_argument("--skip-mismatch", action="store_true")
    parser.add_argument("--telemetry", action="store_true", help="NIXL per-transfer telemetry (costs on CPU)")
    parser.add_argument("--backend", default="UCX", help="NIXL backend: UCX, or LIBFABRIC on EFA")
    parser.add_argument("--serve-decode", metavar="HOST:PORT", help="run only the decode side, for a prefill host")
    parser.add_argument("--decode-at", metavar="HOST:PORT", help="write to a decode side on another host")
    args = parser.parse_args()
    shape = KVShape(blocks=max(64, 2 * args.tokens // 128))
    config = {"num_threads": args.num_threads, "enable_prog_thread": args.prog_thread,
              "capture_telemetry": args.telemetry, "backends": (args.backend,)}
    if args.serve_decode:
        serve_decode(args.serve_decode, shape, config)
        return
    n_blocks = args.tokens // 128
    request_bytes = shape.layers * n_blocks * shape.block_bytes
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "shape": asdict(shape), "tokens": args.tokens, "request_bytes": request_bytes, "config": config, "cases": [],
    }
    cases: list[CaseResult] = [memcpy_case(request_bytes, max(args.reps, 5))]
    receiver = RemoteReceiver(args.decode_at) if args.decode_at else Receiver(shape, "cpu", config)
    results["decode_at"] = args.decode_at or "local process"
    kv = host_kv(shape, random=True)
    agent = TransferAgent("bench-prefill", NixlConfig(**config))
    agent.register(kv, shape.block_size, shape.heads, shape.head_size, LAYOUT_HINT)
    agent.start()
    try:
        agent.add_peer(receiver.name, receiver.metadata, receiver.layout).result(60)
        sender = Sender(agent)
        ceiling = Memcpy(request_bytes)
        ok = True
        for scattered in (False, True):
            src = block_ids(n_blocks, shape.blocks, scattered, 1)
            dst = block_ids(n_blocks, shape.blocks, scattered, 2, offset=shape.blocks - n_blocks)
            label = "scattered" if scattered else "contiguous"
            for name, per_layer, group in ((f"whole_{label}", False, 64), (f"per_layer_{label}", True, 1),
                                           (f"per_layer_grouped_{label}", True, 64)):
                sender.writer.max_group_writes = group
                cases.append(run_case(name, sender, receiver, args.reps,
                                      lambda tid, s=src, d=dst, p=per_layer: requests_for(
                                          tid, receiver.name, shape.layers, s, d, args.tokens, p), ceiling))
            ok = ok and verify(kv, receiver, src, dst, [0, shape.layers - 1])
            if not scattered:
                cases.append(bare_nixl_case(kv, agent.layout, receiver, src, dst, args.reps, ceiling))
        if not args.skip_mismatch:
            cases.append(mismatch_case(shape, config, receiver, args, ceiling))
        results["bytes_verified"] = ok
    finally:
        agent.stop()
        receiver.close()
    # The ceiling is measured before and after the NIXL cases (this machine's bandwidth drifts).
    after = memcpy_case(request_bytes, max(args.reps, 5))
    results["memcpy_before_after_gib_s"] = [cases[0].gib_s_median, after.gib_s_median]
    if after.gib_s_median > cases[0].gib_s_median:
        cases[0] = after
    summarise(results, cases)
    write_result(RESULTS / "dataplane_bench.json", results)


def mismatch_case(shape: KVShape, config: dict[str, Any], receiver: Receiver, args, ceiling) -> CaseResult:
    """A second prefill agent with 16-token blocks writing into the 128-token decode blocks."""
    small = KVShape(shape.layers, shape.blocks * 8, 16, shape.heads, shape.head_size)
    kv = host_kv(small, random=True)
    agent = TransferAgent("bench-prefill-16", NixlConfig(**config))
    agent.register(kv, 16, small.heads, small.head_size, LAYOUT_HINT)
    agent.start()
    try:
        agent.add_peer(receiver.name, receiver.metadata, receiver.layout).result(60)
        sender = Sender(agent)
        src = block_ids(args.tokens // 16, small.blocks, True, 3)
        dst = block_ids(args.tokens // 128, shape.blocks, True, 4)
        return run_case("mismatch_16_128_scattered", sender, receiver, args.reps,
                        lambda tid: requests_for(tid, receiver.name, shape.layers, src, dst, args.tokens, False),
                        ceiling)
    finally:
        agent.stop()


def summarise(results: dict[str, Any], cases: list[CaseResult]) -> None:
    """Attach cases and the ratios the docs quote."""
    by = {c.name: c for c in cases}
    ceiling = by["memcpy"].gib_s_median
    results["cases"] = [asdict(c) for c in cases]
    results["ratios"] = {
        f"{name}_vs_memcpy": c.extra.get("vs_ceiling_interleaved_median", round(c.gib_s_median / ceiling, 3))
        for name, c in by.items() if name != "memcpy"
    }
    for label in ("contiguous", "scattered"):
        whole, per = by.get(f"whole_{label}"), by.get(f"per_layer_{label}")
        if whole and per:
            results["ratios"][f"per_layer_time_over_whole_{label}"] = round(
                per.seconds_median / whole.seconds_median, 3)


if __name__ == "__main__":
    main()
