"""When does the prefill side learn that a streamed layer's WRITE landed, on one GPU shared with decode?

Without vLLM: this process is the prefill side (KV on cuda:0, a TransferAgent + PushWriter), a spawned process the
decode side (zeroed KV on the same GPU, as when both engines share a card: UCX's `cuda_ipc`). A stand-in forward
computes `--layers` layers of matmuls over `--tokens` rows, writes each layer's KV, records a CUDA event and submits
that layer's write behind it, as the connector does. Per repetition it records when the I/O thread saw each layer's
event complete and when it saw each layer's write done, so:

  landed_before_end   layers whose write was seen done before the last layer's event was seen complete
  completion_lag_ms   per layer: write seen done - its event seen complete (copy + NIXL completion + polling)
  tail_ms             transfer done - last layer's event seen complete

Variants (`--variants`, each a fresh pair of agents, side by side in one run):
  default        the forward on the default (legacy) stream, the host far ahead of the GPU
  side-stream    the forward on a torch side stream (non-blocking)
  host-bound     the default stream, with `--host-us` of Python work per layer (a launch-bound host holding
                 the GIL, as vLLM's eager forward)
  launch-bound   the default stream, with `--small-kernels` tiny kernels per layer besides the matmuls: the host
                 fills CUDA's launch queue and then waits inside kernel launches, handing the GIL back and taking it
                 again around each one (vLLM's forward launches hundreds of kernels a layer)
  prog-thread    default, with NIXL's progress thread on (100 us delay)
  workers-4      default, with 4 UCX workers (`num_threads`)
  event-sync     default, and the host then waits in the last layer's `event.synchronize()` as vLLM's forward
                 thread waits for a step's output (CUDA's default spinning wait)
  stream-sync    the same, waiting in `stream.synchronize()`
  event-sync-blocking, stream-sync-blocking
                 the same with the context's scheduling flag set to blocking sync (`cuda_sync_mode`)
  yield-spinner  default, with another thread of this process spinning on `os.sched_yield()` (vLLM's
                 shared-memory message-queue readers between messages)
  busy-peer      default, with a third process on the GPU stepping (a small kernel and a synchronize every
                 0.5 ms: an engine polling while it waits)

    python bench/gpu_stream_probe.py --tokens 8192 --reps 4 --variants default,side-stream,host-bound

The process's CUDA streams share CUDA_DEVICE_MAX_CONNECTIONS hardware queues (8 by default): run it once more with
`CUDA_DEVICE_MAX_CONNECTIONS=1` to see streamed writes queued behind the forward's kernels, as they are when UCX's
copy stream lands on the forward stream's queue.

Writes $OUT/gpu_stream_probe.json (or bench/results/) and prints one line per variant. `--cpu` runs the same
plumbing on host memory (no events: a layer is ready when submitted), a dry run for machines without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_io import write_result  # bench/, this script's folder
from dataplane_bench import LAYOUT_HINT, KVShape, Receiver

from kvpush.dataplane import NixlConfig, PushWriter, TransferAgent, WriteOutcome, WriteRequest

DEVICE = "cuda:0"
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "side-stream": {"side_stream": True},
    "host-bound": {"host_bound": True},
    "launch-bound": {"small_kernels": True},
    "prog-thread": {"nixl": {"enable_prog_thread": True, "progress_thread_delay_us": 100}},
    "workers-4": {"nixl": {"num_threads": 4}},
    "event-sync": {"host_wait": "event"},
    "stream-sync": {"host_wait": "stream"},
    "event-sync-blocking": {"host_wait": "event", "sync_mode": "blocking"},
    "stream-sync-blocking": {"host_wait": "stream", "sync_mode": "blocking"},
    "yield-spinner": {"yield_spinner": True},
    "busy-peer": {"busy_peer": True},
}


def _busy_peer_main(stop: Any) -> None:
    """A process stepping on the same GPU: a small kernel and a synchronize every 0.5 ms until `stop` is set."""
    torch.cuda.set_device(DEVICE)
    x = torch.zeros(4096, device=DEVICE)
    while not stop.is_set():
        x.add_(1.0)
        torch.cuda.synchronize()
        time.sleep(0.0005)


class _Disturbance:
    """What a variant runs beside the forward: a sched_yield spinner thread, a busy peer process."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._peer: Any = None
        self._peer_stop: Any = None
        if spec.get("yield_spinner"):
            self._thread = threading.Thread(target=self._spin, daemon=True)
            self._thread.start()
        if spec.get("busy_peer"):
            import multiprocessing as mp

            ctx = mp.get_context("spawn")
            self._peer_stop = ctx.Event()
            self._peer = ctx.Process(target=_busy_peer_main, args=(self._peer_stop,), daemon=True)
            self._peer.start()
            time.sleep(5)  # its CUDA context up before the forward starts

    def _spin(self) -> None:
        while not self._stop.is_set():
            os.sched_yield()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._peer is not None:
            self._peer_stop.set()
            self._peer.join(10)


class _Seen:
    """Times (monotonic) the I/O thread saw each layer's event complete and each layer's write done."""

    def __init__(self, layers: int) -> None:
        self.computed: list[float | None] = [None] * layers
        self.landed: list[float | None] = [None] * layers
        self.done = threading.Event()
        self.final: WriteOutcome | None = None
        self.done_at = 0.0


class _Outcomes:
    """The writer's callbacks (I/O thread), recorded into the current repetition's `_Seen`."""

    def __init__(self) -> None:
        self.current = _Seen(0)

    def on_write(self, outcome: WriteOutcome) -> None:
        now = time.monotonic()
        for layer in outcome.layers:
            self.current.landed[layer] = now

    def on_transfer(self, outcome: WriteOutcome) -> None:
        seen = self.current
        seen.done_at = time.monotonic()
        seen.final = outcome
        seen.done.set()


class _Ready:
    """--cpu: the KV is written when the layer is submitted."""

    def record(self, _stream: object) -> None:
        return None

    def query(self) -> bool:
        return True


def _spin(microseconds: float) -> None:
    end = time.perf_counter() + microseconds * 1e-6
    while time.perf_counter() < end:
        pass


def run_variant(name: str, args: argparse.Namespace, shape: KVShape) -> dict[str, Any]:
    spec = VARIANTS[name]
    config = {"poll_max_s": args.poll_max_us * 1e-6, "notif_poll_s": args.poll_max_us * 1e-6,
              **spec.get("nixl", {})}
    trace_path = Path(os.environ.get("OUT") or "/tmp") / f"probe-io-{name}.jsonl"
    trace_path.unlink(missing_ok=True)
    prefill_config = {**config, "io_trace_path": str(trace_path)}
    device = "cpu" if args.cpu else DEVICE
    receiver = Receiver(shape, device, config, name=f"probe-decode-{name}")
    if not args.cpu:
        torch.cuda.set_device(DEVICE)
    kv = {f"layers.{i}": torch.zeros(2, shape.blocks, shape.block_size, shape.heads, shape.head_size,
                                     dtype=torch.bfloat16, device=device) for i in range(shape.layers)}
    agent = TransferAgent(f"probe-prefill-{name}", NixlConfig(**prefill_config))
    agent.register(kv, shape.block_size, shape.heads, shape.head_size, LAYOUT_HINT)
    agent.start()
    n_blocks = args.tokens // shape.block_size
    ids, dst = list(range(n_blocks)), list(range(shape.blocks - n_blocks, shape.blocks))
    weights = [torch.randn(args.hidden, args.hidden, dtype=torch.bfloat16, device=device) / args.hidden ** 0.5
               for _ in range(args.matmuls)]
    x0 = torch.randn(args.tokens, args.hidden, dtype=torch.bfloat16, device=device)
    scratch = torch.zeros(1024, dtype=torch.float32, device=device)
    if args.cpu:
        stream, sync = None, (lambda: None)
    else:
        stream = torch.cuda.Stream() if spec.get("side_stream") else torch.cuda.current_stream()
        sync = torch.cuda.synchronize
        from kvpush.dataplane.cuda_sched import set_sync_mode

        set_sync_mode(spec.get("sync_mode", "auto"))  # every variant sets it: the context outlives the variant
    rows: list[dict[str, Any]] = []
    disturbance = _Disturbance(spec)
    try:
        agent.add_peer(receiver.name, receiver.metadata, receiver.layout).result(120)
        outcomes = _Outcomes()
        writer = PushWriter(agent, outcomes.on_write, outcomes.on_transfer)
        for rep in range(args.reps + 1):
            seen = outcomes.current = _Seen(shape.layers)
            tid = f"{name}-{rep}"
            sync()
            started = time.monotonic()
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                x = x0 + float(rep)
                for layer in range(shape.layers):
                    for w in weights:
                        x = torch.nn.functional.gelu(x @ w)
                    target = kv[f"layers.{layer}"][:, :n_blocks]
                    flat = x.reshape(-1)
                    if flat.numel() < target.numel():
                        flat = flat.repeat(-(-target.numel() // flat.numel()))
                    target.copy_(flat[: target.numel()].view_as(target))
                    event = _Ready() if stream is None else torch.cuda.Event()
                    event.record(stream)
                    writer.when_complete(event, lambda _t, k=layer, s=seen: s.computed.__setitem__(k, time.monotonic()))
                    writer.submit(WriteRequest(tid, receiver.name, range(layer, layer + 1), ids, dst, 0, args.tokens,
                                               notify=tid.encode() if layer == shape.layers - 1 else None,
                                               ready_event=event))
                    if spec.get("host_bound"):
                        _spin(args.host_us)
                    if spec.get("small_kernels"):
                        for _ in range(args.small_kernels):
                            scratch.add_(1.0)
            launched = time.monotonic()
            host_wait = spec.get("host_wait")
            if host_wait == "event" and stream is not None:
                event.synchronize()
            elif host_wait == "stream" and stream is not None:
                stream.synchronize()
            if not seen.done.wait(120) or seen.final is None or not seen.final.ok:
                raise RuntimeError(f"{name}: transfer did not complete: {seen.final}")
            sync()
            if rep == 0:
                continue  # warm-up
            end = seen.computed[-1]
            if end is None or any(t is None for t in seen.landed):
                raise RuntimeError(f"{name}: a layer's event or write was not seen")
            lags = [(land - comp) * 1e3 for land, comp in zip(seen.landed, seen.computed)
                    if land is not None and comp is not None]
            rows.append({
                "forward_ms": round((end - started) * 1e3, 2),
                "host_launch_ms": round((launched - started) * 1e3, 2),
                "landed_before_end": sum(1 for t in seen.landed if t is not None and t < end),
                "tail_ms": round((seen.done_at - end) * 1e3, 3),
                "completion_lag_ms": [round(x, 2) for x in lags],
            })
    finally:
        disturbance.close()
        agent.stop()
        receiver.close()
    lag_all = [x for r in rows for x in r["completion_lag_ms"]]
    io = _io_calls(trace_path)
    trace_path.unlink(missing_ok=True)
    return {"variant": name, "spec": spec, "layers": shape.layers, "tokens": args.tokens,
            "layer_bytes": n_blocks * shape.block_bytes, "reps": rows,
            "landed_before_end": [r["landed_before_end"] for r in rows],
            "tail_ms": [r["tail_ms"] for r in rows],
            "forward_ms": statistics.median(r["forward_ms"] for r in rows),
            "host_launch_ms": statistics.median(r["host_launch_ms"] for r in rows),
            "completion_lag_ms_p50": round(statistics.median(lag_all), 3),
            "completion_lag_ms_max": round(max(lag_all), 3), "io_calls": io}


def _io_calls(path: Path) -> dict[str, Any]:
    """Per kind of I/O-thread call over the whole variant: calls, mean and longest ms (GIL hand-back included)."""
    totals: dict[str, list[float]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            for kind in ("check", "post", "event", "notif"):
                if kind in row:
                    count, total_ms, longest_ms = row[kind]
                    entry = totals.setdefault(kind, [0, 0.0, 0.0])
                    entry[0] += count
                    entry[1] += total_ms
                    entry[2] = max(entry[2], longest_ms)
    return {kind: {"calls": int(c), "mean_ms": round(t / c, 4) if c else 0.0, "longest_ms": m}
            for kind, (c, t, m) in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--matmuls", type=int, default=6, help="matmuls per layer (~1 ms each at 8,192 x 4,096)")
    parser.add_argument("--host-us", type=float, default=3000.0, help="host-bound: Python work per layer")
    parser.add_argument("--small-kernels", type=int, default=2000, help="launch-bound: tiny kernels per layer")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--poll-max-us", type=float, default=200.0)
    parser.add_argument("--variants", default="default,launch-bound,host-bound,event-sync,stream-sync")
    parser.add_argument("--out-name", default="gpu_stream_probe.json")
    parser.add_argument("--cpu", action="store_true", help="host memory, no GPU: a dry run of the plumbing")
    args = parser.parse_args()
    shape = KVShape(layers=args.layers, blocks=2 * (args.tokens // 128) + 8)
    results = []
    for name in args.variants.split(","):
        result = run_variant(name, args, shape)
        results.append(result)
        print(f"{name}: forward {result['forward_ms']} ms (host launched in {result['host_launch_ms']} ms); "
              f"landed before end {result['landed_before_end']} of {shape.layers}; tail {result['tail_ms']} ms; "
              f"completion lag p50 {result['completion_lag_ms_p50']} max {result['completion_lag_ms_max']} ms; "
              f"posts {result['io_calls'].get('post')}",
              flush=True)
        out_dir = Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
        write_result(out_dir / args.out_name, {"bench": "gpu_stream_probe", "variants": results}, echo=False)


if __name__ == "__main__":
    main()
