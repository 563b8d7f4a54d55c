"""GPU variant of the data-plane benchmark: prefill KV on cuda:0, decode KV on cuda:1 (another process).

Same layout and cases as dataplane_bench.py (32 layers, 128-token blocks, 8 KV heads x 128, bf16,
K/V-first NHD), with torch tensors in VRAM, against a torch peer copy (`dst.copy_(src)` from cuda:0
to cuda:1 of the same bytes, same run). Extra cases:

  scattered with num_threads=4   UCX worker threads (each config gets its own pair of agents)
  streaming                      a small torch model computes 32 layers (~matmuls per layer); after each
                                 layer it writes the layer's KV, records a CUDA event and submits a
                                 per-layer WriteRequest with that event (the writer polls event.query());
                                 tail = last layer's KV ready -> transfer outcome, against one
                                 whole-request write submitted after the compute finished.

Run on a 2-GPU machine (see docs/benchmarks.md for the device command). Writes JSON to $OUT (or
bench/results/dataplane_gpu_bench.json) and prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_io import write_result  # bench/, this script's folder
from dataplane_bench import (
    LAYOUT_HINT,
    CaseResult,
    KVShape,
    Receiver,
    Sender,
    block_ids,
    requests_for,
    run_case,
)

from kvpush.dataplane import NixlConfig, TransferAgent, WriteRequest

SRC, DST = "cuda:0", "cuda:1"


def gpu_kv(shape: KVShape, device: str) -> dict[str, torch.Tensor]:
    """Per-layer (2, blocks, block_size, heads, head) bf16 KV with random values."""
    gen = torch.Generator(device=device).manual_seed(0)
    return {
        f"layers.{i}": torch.randn(2, shape.blocks, shape.block_size, shape.heads, shape.head_size,
                                   dtype=torch.bfloat16, device=device, generator=gen)
        for i in range(shape.layers)
    }


def peer_copy_case(nbytes: int, reps: int) -> CaseResult:
    """torch peer copy cuda:0 -> cuda:1 of `nbytes` (the ceiling), timed with a host clock after sync."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=SRC)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=DST)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(SRC)
    torch.cuda.synchronize(DST)
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(SRC)
        torch.cuda.synchronize(DST)
        seconds.append(time.perf_counter() - start)
    assert torch.equal(src[:4096].cpu(), dst[:4096].cpu())
    gbs = [nbytes / s / 1e9 for s in seconds]
    return CaseResult("torch_peer_copy", nbytes, 1, round(statistics.median(gbs) / 1.073741824, 3),
                      round(max(gbs) / 1.073741824, 3), round(statistics.median(seconds), 6))


def verify(kv: dict[str, torch.Tensor], receiver: Receiver, src: list[int], dst: list[int], layers: list[int]) -> bool:
    """Byte-compare sampled destination blocks with their sources."""
    for layer in layers:
        for s, d in list(zip(src, dst))[:: max(1, len(src) // 4)]:
            want = kv[f"layers.{layer}"][:, s].contiguous().cpu().view(torch.uint16).numpy().tobytes()
            if receiver.block(layer, d) != want:
                return False
    return True


def streaming_case(shape: KVShape, kv: dict[str, torch.Tensor], sender: Sender, receiver: Receiver, tokens: int,
                   reps: int, hidden: int, matmuls: int) -> dict[str, Any]:
    """Per-layer streamed writes behind a computing model vs one write after the compute."""
    n_blocks = tokens // shape.block_size
    ids = list(range(n_blocks))
    dst = list(range(shape.blocks - n_blocks, shape.blocks))
    weights = [torch.randn(hidden, hidden, dtype=torch.bfloat16, device=SRC) / hidden**0.5 for _ in range(matmuls)]
    x0 = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=SRC)
    per_layer_elems = kv["layers.0"][:, :n_blocks].numel()

    def compute(submit_per_layer: bool, tid: str, rep: int) -> tuple[float, float]:
        x = x0 + float(rep)  # different KV every repetition, so a lost write shows in the check below
        layer_ms = []
        events = []
        for layer in range(shape.layers):
            start_ev = torch.cuda.Event(enable_timing=True)
            start_ev.record()
            for w in weights:
                x = torch.nn.functional.gelu(x @ w)
            flat = x.reshape(-1)
            target = kv[f"layers.{layer}"][:, :n_blocks]
            target.copy_(flat.repeat(-(-per_layer_elems // flat.numel()))[:per_layer_elems].view_as(target))
            done_ev = torch.cuda.Event(blocking=True, enable_timing=True)
            done_ev.record()
            events.append((start_ev, done_ev))
            if submit_per_layer:
                sender.writer.submit(WriteRequest(tid, receiver.name, range(layer, layer + 1), ids, dst, 0, tokens,
                                                  notify=tid.encode() if layer == shape.layers - 1 else None,
                                                  ready_event=done_ev))
        events[-1][1].synchronize()
        ready_at = time.monotonic()
        layer_ms = [s.elapsed_time(e) for s, e in events]
        return ready_at, statistics.median(layer_ms)

    results: dict[str, list[float]] = {"streamed_tail_ms": [], "after_compute_tail_ms": [], "layer_compute_ms": []}
    for rep in range(reps + 1):
        tid = f"stream-{rep}"
        sender._done.clear()
        ready_at, layer_ms = compute(True, tid, rep)
        if not sender._done.wait(60) or not sender.final.ok:
            raise RuntimeError(f"streamed transfer failed: {sender.final}")
        streamed = (sender.done_at - ready_at) * 1e3
        if rep == reps:
            verified = verify(kv, receiver, ids[:1], dst[:1], list(range(shape.layers)))
            results["streamed_bytes_verified"] = [float(verified)]
        tid = f"after-{rep}"
        ready_at, _ = compute(False, tid, rep + 1000)
        sender._done.clear()
        sender.writer.submit(WriteRequest(tid, receiver.name, range(shape.layers), ids, dst, 0, tokens,
                                          notify=tid.encode()))
        if not sender._done.wait(60) or not sender.final.ok:
            raise RuntimeError(f"whole transfer failed: {sender.final}")
        after = (sender.done_at - ready_at) * 1e3
        if rep:  # the first round warms up
            results["streamed_tail_ms"].append(streamed)
            results["after_compute_tail_ms"].append(after)
            results["layer_compute_ms"].append(layer_ms)
    receiver.notifs()
    return {k: round(statistics.median(v), 4) for k, v in results.items()} | {
        "streamed_tail_ms_max": round(max(results["streamed_tail_ms"]), 4),
        "layer_kv_bytes": n_blocks * shape.block_bytes,
    }


def run_config(shape: KVShape, tokens: int, reps: int, num_threads: int, full: bool, args,
               isolated: bool) -> dict[str, Any]:
    """All cases for one NIXL config, with a fresh pair of agents."""
    config = {"num_threads": num_threads, "capture_telemetry": True, "poll_max_s": args.poll_max_us * 1e-6,
              "notif_poll_s": args.notif_poll_us * 1e-6}
    receiver = Receiver(shape, "cuda:0" if isolated else DST, config, name=f"gpu-decode-t{num_threads}",
                        visible_devices="1" if isolated else None)
    torch.cuda.set_device(SRC)
    kv = gpu_kv(shape, SRC)
    torch.cuda.synchronize()
    agent = TransferAgent(f"gpu-prefill-t{num_threads}", NixlConfig(**config))
    agent.register(kv, shape.block_size, shape.heads, shape.head_size, LAYOUT_HINT)
    agent.start()
    out: dict[str, Any] = {"num_threads": num_threads, "cases": []}
    try:
        start = time.monotonic()
        agent.add_peer(receiver.name, receiver.metadata, receiver.layout).result(120)
        out["add_peer_s"] = round(time.monotonic() - start, 4)
        sender = Sender(agent)
        n_blocks = tokens // shape.block_size
        ok = True
        for scattered in ((False, True) if full else (True,)):
            src = block_ids(n_blocks, shape.blocks, scattered, 1)
            dst = block_ids(n_blocks, shape.blocks, scattered, 2, offset=shape.blocks - n_blocks)
            label = "scattered" if scattered else "contiguous"
            for name, per_layer, group in ((f"whole_{label}", False, 64), (f"per_layer_{label}", True, 1),
                                           (f"per_layer_grouped_{label}", True, 64)):
                sender.writer.max_group_writes = group
                out["cases"].append(asdict(run_case(name, sender, receiver, reps,
                                                    lambda tid, s=src, d=dst, p=per_layer: requests_for(
                                                        tid, receiver.name, shape.layers, s, d, tokens, p))))
            sender.writer.max_group_writes = 64
            ok = ok and verify(kv, receiver, src, dst, [0, shape.layers - 1])
        if full:
            out["streaming"] = streaming_case(shape, kv, sender, receiver, args.stream_tokens, reps,
                                              args.hidden, args.matmuls)
        out["bytes_verified"] = ok
    finally:
        agent.stop()
        receiver.close()
    return out


def _probe_target(conn: Any, device: str, nbytes: int) -> None:
    """Probe peer: register `nbytes` of zeros on `device` with a bare nixl agent, poll until told."""
    torch.cuda.set_device(device)
    from nixl._api import nixl_agent, nixl_agent_config

    buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    agent = nixl_agent("probe-target", nixl_agent_config(enable_prog_thread=False))
    agent.register_memory([buf])
    conn.send((agent.get_agent_metadata(), buf.data_ptr(), torch.cuda.current_device()))
    while True:
        agent.get_new_notifs()
        if conn.poll(0.001):
            if conn.recv() == "sum":
                torch.cuda.synchronize()
                conn.send(int(buf.sum().item()))
            else:
                return


def probe(nbytes: int = 64 << 20) -> list[dict[str, Any]]:
    """Bare NIXL VRAM WRITE cuda:0 -> other GPU: which visibility and descriptor form work."""
    import multiprocessing as mp

    import numpy as np
    from nixl._api import nixl_agent, nixl_agent_config

    torch.cuda.set_device(SRC)
    src = torch.ones(nbytes, dtype=torch.uint8, device=SRC)
    report = []
    for isolated in (False, True):
        for strided in (False, True):
            ctx = mp.get_context("spawn")
            conn, child = ctx.Pipe()
            saved = os.environ.get("CUDA_VISIBLE_DEVICES")
            if isolated:
                os.environ["CUDA_VISIBLE_DEVICES"] = "1"
            proc = ctx.Process(target=_probe_target, args=(child, "cuda:0" if isolated else DST, nbytes), daemon=True)
            proc.start()
            if isolated:
                os.environ.pop("CUDA_VISIBLE_DEVICES") if saved is None else os.environ.__setitem__(
                    "CUDA_VISIBLE_DEVICES", saved)
            entry: dict[str, Any] = {"isolated": isolated, "strided": strided}
            try:
                metadata, remote_addr, remote_dev = conn.recv()
                agent = nixl_agent(f"probe-init-{isolated}-{strided}", nixl_agent_config(enable_prog_thread=False))
                agent.register_memory([src])
                name = agent.add_remote_agent(metadata)
                half = nbytes // 2
                if strided:
                    local = np.array([[src.data_ptr(), half, 0, half, 2]], dtype=np.uint64)
                    remote = np.array([[remote_addr, half, remote_dev, half, 2]], dtype=np.uint64)
                else:
                    local = np.array([[src.data_ptr(), half, 0], [src.data_ptr() + half, half, 0]], dtype=np.uint64)
                    remote = np.array([[remote_addr, half, remote_dev], [remote_addr + half, half, remote_dev]],
                                      dtype=np.uint64)
                lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "VRAM")
                rh = agent.prep_xfer_dlist(name, remote, "VRAM")
                start = time.perf_counter()
                handle = agent.make_prepped_xfer("WRITE", lh, [0, 1], rh, [0, 1])
                state = agent.transfer(handle)
                while state == "PROC":
                    time.sleep(0.0001)
                    state = agent.check_xfer_state(handle)
                entry["state"] = state
                entry["gb_s"] = round(nbytes / (time.perf_counter() - start) / 1e9, 1)
                conn.send("sum")
                entry["bytes_ok"] = conn.recv() == nbytes
            except Exception as exc:
                entry["error"] = repr(exc)
            finally:
                try:
                    conn.send("exit")
                except OSError:
                    pass
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
            report.append(entry)
            print("probe", entry, flush=True)
    return report


def main() -> None:
    """Run the GPU cases and write JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--stream-tokens", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--matmuls", type=int, default=4)
    parser.add_argument("--threads", default="0,4")
    parser.add_argument("--probe-only", action="store_true")
    parser.add_argument("--poll-max-us", type=float, default=1000.0, help="NixlConfig.poll_max_s in microseconds")
    parser.add_argument("--notif-poll-us", type=float, default=1000.0, help="NixlConfig.notif_poll_s in microseconds")
    parser.add_argument("--out-name", default="dataplane_gpu_bench.json")
    args = parser.parse_args()
    if args.probe_only:
        print(json.dumps(probe(), indent=2))
        return
    assert torch.cuda.device_count() >= 2, "needs two GPUs"
    shape = KVShape(blocks=max(256, 2 * args.tokens // 128))
    request_bytes = shape.layers * (args.tokens // 128) * shape.block_bytes
    results: dict[str, Any] = {
        "gpus": [torch.cuda.get_device_name(i) for i in range(2)], "torch": torch.__version__,
        "shape": asdict(shape), "tokens": args.tokens, "request_bytes": request_bytes,
        "ucx_tls": os.environ.get("UCX_TLS", ""),
    }
    results["probe"] = probe()
    working = [p for p in results["probe"] if p.get("state") == "DONE" and p.get("bytes_ok")]
    # Prefer the decode process seeing only its own GPU (one process per GPU), as deployments do.
    isolated = any(p["isolated"] for p in working) or not working
    results["decode_sees_only_its_gpu"] = isolated
    results["torch_peer_copy"] = asdict(peer_copy_case(request_bytes, max(args.reps, 10)))
    results["configs"] = [
        run_config(shape, args.tokens, args.reps, int(t), i == 0, args, isolated)
        for i, t in enumerate(args.threads.split(","))
    ]
    ceiling = results["torch_peer_copy"]["gib_s_median"]
    table = [("case", "threads", "GiB/s med", "best", "vs peer copy", "post ms/write", "desc/write", "notif lag ms")]
    for cfg in results["configs"]:
        for c in cfg["cases"]:
            table.append((c["name"], cfg["num_threads"], c["gib_s_median"], c["gib_s_best"],
                          round(c["gib_s_median"] / ceiling, 3), c["post_ms_per_write_median"],
                          c["descriptors_per_write"], c["notif_after_done_ms_median"]))
    out_dir = Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    results["poll_max_us"], results["notif_poll_us"] = args.poll_max_us, args.notif_poll_us
    write_result(out_dir / args.out_name, results)
    print(f"torch peer copy: {ceiling} GiB/s median")
    for row in table:
        print(" | ".join(str(x) for x in row))
    if "streaming" in results["configs"][0]:
        print("streaming:", results["configs"][0]["streaming"])


if __name__ == "__main__":
    main()
