"""The connector's worker halves on GPU (or DRAM), driven the way vLLM's model runner drives them.

What runs (one script, modes by argv; `run` starts the others as child processes):

  directory   the real KV-directory (`kvpush.cli.main directory`) on 127.0.0.1
  decode      `DecodeWorker` + `NotificationListener` on a `TransferAgent` (`create_agent`, the connector's
              own function) over vLLM's GPU KV layout, registered and watching through `DirectoryLink`
              exactly as `KVPushConnector.register_kv_caches` wires it; a second `DirectoryLink` plays the
              decode scheduler process (ReportAllocation via `DirectoryLink.report_allocation`, as
              `DecodeScheduler.update_state_after_alloc` does). CUDA_VISIBLE_DEVICES=1 on a GPU machine.
  prefill     `PrefillWorker` + `PushTransport` on a `TransferAgent`, registered with an open StreamPrefill
              session (again as `register_kv_caches` wires it), and a small torch "model" whose layers
              write KV into its blocks. CUDA_VISIBLE_DEVICES=0.
  run         the orchestrator: starts the three, plans transfers with the client library
              (`SyncDirectoryClient.plan_transfer`), hands each request to decode (allocate) and prefill
              (compute), reads `GetTransfer` (state, rank_timings) and compares decode's destination
              bytes with prefill's source bytes (SHA-256 per layer over every prompt token).

vLLM's part, played here. CUDA vLLM cannot be carried to the GPU machine, so this script calls the
worker halves' hooks in the order vLLM 0.33's GPU model runner does (src/kvpush/connector/connector.py):
  prefill step: begin_step(meta) [bind_connector_metadata] -> per layer: the layer's KV is written
  (index_copy_ into the paged cache), then save_kv_layer(layer_name) -> wait_for_save() ->
  get_finished_sending(finished_req_ids) [get_transfer_results] -> build_worker_meta()
  [build_connector_worker_meta] -> the step's sync (vLLM's sampler; torch.cuda.synchronize here).
  After a request's last chunk the next step's metadata carries it in held_prefills and
  finished_req_ids (request_finished returned True); while holds are open the engine keeps stepping
  (has_pending_push_work): empty steps every --idle-step-s.
  decode step: begin_step(meta with the ReceiveStart the scheduler queued) -> collect().
The `KVPushMetadata` (PrefillChunk, ReceiveStart, held_prefills) is built as src/kvpush/connector/scheduler/prefill.py
and decode.py build it. On GPU, `PrefillWorker(on_gpu=True)` records a CUDA event per layer in
save_kv_layer, so no WRITE reads a layer before its kernels ran; the model here runs asynchronously on
the GPU exactly like vLLM's forward (the host runs ahead of the GPU).

vLLM stand-in (GPU machine only): kvpush/connector/metadata.py imports two base classes from
`vllm.distributed.kv_transfer.kv_connector.v1.base`. Where vLLM is not installed, this script installs a
minimal module at that one import path holding two EMPTY base classes (`KVConnectorMetadata`,
`KVConnectorWorkerMetadata`) -- nothing else of vLLM is stood in for, and src/kvpush/connector/connector.py (the
facade that needs real vLLM) is never imported. Where vLLM is installed (the CPU machine) the real
classes are used.

Model: hidden 4096, 8 KV heads x 128 (Llama-3-8B-shaped), per layer KV = x @ W_kv, an MLP (4096 ->
--intermediate -> 4096) and a layer norm, bf16; tokens are independent (no attention), so chunked and
whole prompts give the same KV; inputs are seeded per request, KV is deterministic.

Scenarios (one `run`): a warm-up request (loads the peer); --reps alternating single requests of
--prompt tokens, streamed (save_kv_layer after each layer) and after-compute (the same hooks called only
once the whole forward finished: one push after the compute, the baseline); one request in chunked
prefill steps ending mid-block; four concurrent requests over two mixed steps (prefill dispatched without
waiting for decode's allocation); one request whose allocation reaches the directory after prefill
started (late allocation).

Figures per request: tail = last_write_end - prefill_end as the directory reports it (rank_timings; the
connector stamps prefill_end when its I/O thread sees the last layer's CUDA event complete), and against the
GPU's real end of the last layer (CUDA events); layers written before prefill end (directory) and before the GPU
finished; bytes; decode's finished_recving time after the GPU end.

Usage: python bench/connector_gpu_run.py run [--device cuda|cpu] [--block-size 128] [--out-name NAME]
  GPU (2 GPUs): run --reps 5  (and --block-size 16 --out-name connector_gpu_run_bs16.json)
  CPU dry run:  run --device cpu --layers 4 --hidden 256 --intermediate 512 --heads 2 --head-size 64
                --block-size 16 --prompt 256 --chunked-prompt 600 --chunk 200 --scale-den 10 --reps 2
Writes JSON to $OUT/NAME when OUT is set, else bench/results/NAME; logs of every process beside it.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import os
import secrets
import socket
import statistics
import subprocess
import sys
import threading
import time
import types
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from bench_io import write_result  # bench/, this script's folder

LAYER_NAME = "model.layers.{}.self_attn.attn"
PREFILL_ENGINE = "prefill-0"
DECODE_ENGINE = "decode-0"


# ==================================================================== imports without installing kvpush


def setup_imports() -> None:
    """Make `kvpush.*` importable from the checkout and, only where vLLM is absent, stand in for vLLM's two bases."""
    src = str(REPO / "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    if "vllm" not in sys.modules and importlib.util.find_spec("vllm") is None:
        install_vllm_base_stand_in()


def install_vllm_base_stand_in() -> None:
    """Stand-in for vLLM's `KVConnectorMetadata` / `KVConnectorWorkerMetadata` ONLY (two empty base classes).

    src/kvpush/connector/metadata.py subclasses them; nothing else of vLLM is imported by the worker halves this
    script drives. Used only where vLLM is not installed (the GPU machine).
    """
    path = "vllm.distributed.kv_transfer.kv_connector.v1.base"
    parts = path.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = []  # a package, so the next part imports
            module.__doc__ = "kvpush bench stand-in: vLLM is not installed here"
            sys.modules[name] = module
            if i > 1:
                setattr(sys.modules[".".join(parts[: i - 1])], parts[i - 1], module)
    base = sys.modules[path]

    class KVConnectorMetadata:
        """Stand-in for vLLM's empty KVConnectorMetadata base (vLLM absent)."""

    class KVConnectorWorkerMetadata:
        """Stand-in for vLLM's KVConnectorWorkerMetadata base (vLLM absent)."""

    base.KVConnectorMetadata = KVConnectorMetadata
    base.KVConnectorWorkerMetadata = KVConnectorWorkerMetadata
    base.KVPUSH_STAND_IN = True


def vllm_is_stand_in() -> bool:
    base = sys.modules.get("vllm.distributed.kv_transfer.kv_connector.v1.base")
    return bool(getattr(base, "KVPUSH_STAND_IN", False))


# ==================================================================== shared pieces


def connector_config(role: str, engine_id: str, args: argparse.Namespace) -> Any:
    """The ConnectorConfig vLLM's kv_connector_extra_config would give; logging and tracing set up as
    KVPushConnector.__init__ does (configure_logging: INFO, so the per-write debug lines cost nothing)."""
    from kvpush.connector.config import ConnectorConfig
    from kvpush.connector.tracing import configure_engine_tracing
    from kvpush.observability import configure_logging

    configure_logging()
    configure_engine_tracing(role)

    extra = {"directory_address": args.directory, "transfer_timeout_s": args.timeout_s,
             "push_timeout_s": args.timeout_s, "nixl_num_threads": args.nixl_threads}
    return ConnectorConfig.from_extra_config(extra, role=role, engine_id=engine_id)


def make_kv_caches(args: argparse.Namespace, device: str, fill: str) -> dict[str, Any]:
    """vLLM's GPU layout: per layer (2, num_blocks, block_size, num_kv_heads, head_size) bf16."""
    import torch

    shape = (2, args.num_blocks, args.block_size, args.heads, args.head_size)
    caches = {}
    gen = torch.Generator(device=device).manual_seed(1234)
    for i in range(args.layers):
        if fill == "zeros":
            t = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        else:  # distinct noise, so a copy of never-computed KV is visibly wrong
            t = torch.randn(shape, dtype=torch.bfloat16, device=device, generator=gen)
        caches[LAYER_NAME.format(i)] = t
    return caches


def layer_hashes(kv_caches: dict[str, Any], block_ids: list[int], tokens: int, block_size: int) -> list[str]:
    """SHA-256 per layer of tokens [0, tokens) of these blocks (K and V planes), bytes as stored."""
    import torch

    out = []
    idx = torch.tensor(block_ids, dtype=torch.long, device=next(iter(kv_caches.values())).device)
    for t in kv_caches.values():
        sel = t.index_select(1, idx)  # (2, n, bs, H, D)
        sel = sel.reshape(2, len(block_ids) * block_size, *sel.shape[3:])[:, :tokens].contiguous()
        data = sel.view(torch.uint8).cpu().numpy().tobytes()
        out.append(hashlib.sha256(data).hexdigest())
    return out


def ts(stamp: Any) -> float | None:
    """A protobuf Timestamp as unix seconds (None when unset)."""
    if stamp is None or (stamp.seconds == 0 and stamp.nanos == 0):
        return None
    return stamp.seconds + stamp.nanos / 1e9


class BlockPool:
    """Hands out block ids in ascending order (a fresh vLLM engine's free list); never reuses one in a run."""

    def __init__(self, first: int, count: int) -> None:
        self.next = first
        self.end = count

    def take(self, n: int) -> list[int]:
        if self.next + n > self.end:
            raise RuntimeError(f"block pool exhausted: need {n}, {self.end - self.next} left")
        ids = list(range(self.next, self.next + n))
        self.next += n
        return ids


# ==================================================================== directory


def directory_main(args: argparse.Namespace) -> int:
    setup_imports()
    from kvpush.cli.main import main

    return main(["directory", "--host", "127.0.0.1", "--port", str(args.port), "--lease-ttl-s", "30",
                 "--transfer-ttl-s", str(args.timeout_s * 2)])


# ==================================================================== decode process


def decode_main(args: argparse.Namespace) -> int:
    setup_imports()
    import torch

    from kvpush.connector.directory_link import DirectoryLink
    from kvpush.connector.halves import build_worker_half
    from kvpush.connector.metadata import KVPushMetadata, ReceiveStart

    device = "cuda:0" if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(0)
    config = connector_config("decode", DECODE_ENGINE, args)
    kv_caches = make_kv_caches(args, device, "zeros")
    notified: dict[str, float] = {}

    def on_notification(agent_name: str, message: bytes) -> None:  # tap: stamp arrival (the worker's runs next)
        notified.setdefault(message.decode("utf-8", "replace"), time.time())

    # Wired by the connector's own builder, as KVPushConnector.register_kv_caches wires a decode worker.
    parts = build_worker_half(config, kv_caches, args.block_size, args.heads, args.head_size, 0, 1,
                              f"{DECODE_ENGINE}-tp0-bench", tap_notification=on_notification)
    worker, agent = parts.half, parts.agent
    # The decode scheduler process's own link (DecodeScheduler reports allocations through it).
    scheduler_link = DirectoryLink(config, "kvpush-scheduler-directory")
    pool = BlockPool(1, args.num_blocks)  # block 0 is vLLM's null block
    conn = Client(tuple(args.control), authkey=bytes.fromhex(args.authkey))
    conn.send({"op": "ready", "role": "decode", "agent": agent.agent_name, "layout": agent.layout.layout_name,
               "memory": agent.layout.memory_kind, "stand_in": vllm_is_stand_in()})

    pending: list[Any] = []
    refused: list[tuple[str, str]] = []
    refused_lock = threading.Lock()
    requests: dict[str, dict[str, Any]] = {}       # request id -> record
    batches: dict[str, set[str]] = {}               # batch id -> request ids still waiting
    waiting: set[str] = set()
    while True:
        if conn.poll(args.idle_step_s if waiting else 0.5):
            msg = conn.recv()
            op = msg["op"]
            if op == "receive":
                batches[msg["batch"]] = set()
                for req in msg["requests"]:
                    rid, tid, prompt = req["request_id"], req["transfer_id"], req["prompt"]
                    blocks = pool.take(-(-prompt // args.block_size))
                    requests[rid] = {"transfer_id": tid, "prompt": prompt, "blocks": blocks,
                                     "report_time": time.time()}
                    pending.append(ReceiveStart(request_id=rid, transfer_id=tid, block_ids=tuple(blocks),
                                                prompt_token_count=prompt, skip_token_count=0))

                    def on_refused(reason: str, rid: str = rid) -> None:
                        with refused_lock:
                            refused.append((rid, reason))

                    scheduler_link.report_allocation(tid, blocks, prompt, 0, on_refused)
                    batches[msg["batch"]].add(rid)
                    waiting.add(rid)
                conn.send({"op": "allocated", "batch": msg["batch"]})
            elif op == "hash":
                out = {rid: layer_hashes(kv_caches, requests[rid]["blocks"], requests[rid]["prompt"], args.block_size)
                       for rid in msg["request_ids"]}
                conn.send({"op": "hashes", "hashes": out})
            elif op == "stop":
                break
        if not waiting and not pending:
            continue
        # One decode engine step: the scheduler's metadata, then the worker's hooks.
        with refused_lock:
            failed, refused[:] = list(refused), []
        meta = KVPushMetadata(receives=pending, failed_receives=failed, empty_step=True)
        pending = []
        worker.begin_step(meta)
        finished, load_errors = worker.collect()
        now = time.time()
        for rid in finished:
            rec = requests[rid]
            rec["finished_recving_time"] = now
            rec["notification_time"] = notified.get(rec["transfer_id"])
            rec["load_error_blocks"] = sorted(b for b in load_errors if b in rec["blocks"])
            rec["ok"] = not rec["load_error_blocks"]
            waiting.discard(rid)
        for batch, rids in list(batches.items()):
            if rids and not (rids & waiting):
                conn.send({"op": "received", "batch": batch,
                           "requests": {r: {k: v for k, v in requests[r].items() if k != "blocks"} | {
                               "block_count": len(requests[r]["blocks"]), "first_block": requests[r]["blocks"][0]}
                                        for r in rids}})
                del batches[batch]
    parts.shutdown()
    scheduler_link.close()
    return 0


# ==================================================================== prefill process


class TinyModel:
    """Per layer: KV = x @ W_kv (8 heads x 128, K and V), x = LN(x + MLP(x)); bf16, deterministic."""

    def __init__(self, args: argparse.Namespace, device: str) -> None:
        import torch

        gen = torch.Generator(device=device).manual_seed(7)
        h, kv = args.hidden, 2 * args.heads * args.head_size
        self.args = args
        self.device = device
        self.w_kv = (torch.randn(h, kv, generator=gen, device=device) / h ** 0.5).to(torch.bfloat16)
        self.w_up = (torch.randn(h, args.intermediate, generator=gen, device=device) / h ** 0.5).to(torch.bfloat16)
        self.w_down = (torch.randn(args.intermediate, h, generator=gen, device=device)
                       / args.intermediate ** 0.5).to(torch.bfloat16)
        self.bias = (torch.randn(args.layers, h, generator=gen, device=device) * 0.1).to(torch.bfloat16)

    def embed(self, seed: int, tokens: int) -> Any:
        import torch

        gen = torch.Generator(device=self.device).manual_seed(seed)
        return torch.randn(tokens, self.args.hidden, generator=gen, device=self.device).to(torch.bfloat16)

    def layer(self, layer: int, x: Any, kv_cache: Any, slots: Any) -> Any:
        import torch

        x = x + self.bias[layer]
        kv = (x @ self.w_kv).view(x.shape[0], 2, self.args.heads, self.args.head_size).transpose(0, 1)
        flat = kv_cache.view(2, -1, self.args.heads, self.args.head_size)
        flat.index_copy_(1, slots, kv)  # vLLM's reshape_and_cache: this layer's KV into its paged blocks
        y = torch.nn.functional.gelu(x @ self.w_up) @ self.w_down
        return torch.nn.functional.layer_norm(x + y, (x.shape[-1],))


def prefill_main(args: argparse.Namespace) -> int:
    setup_imports()
    import torch

    from kvpush.api.outcome import PushOutcome
    from kvpush.connector.halves import build_worker_half
    from kvpush.connector.metadata import KVPushMetadata, PrefillChunk, combine_rank_timelines

    on_gpu = args.device == "cuda"
    device = "cuda:0" if on_gpu else "cpu"
    if on_gpu:
        torch.cuda.set_device(0)
    config = connector_config("prefill", PREFILL_ENGINE, args)
    kv_caches = make_kv_caches(args, device, "noise")
    layer_names = list(kv_caches)
    model = TinyModel(args, device)
    writes: list[dict[str, Any]] = []
    instructions: dict[str, float] = {}
    tap_lock = threading.Lock()

    def on_write_done(done: Any) -> None:  # tap: record each write (the worker's callback runs next)
        with tap_lock:
            writes.append({"transfer_id": done.transfer_id, "ok": done.outcome is PushOutcome.DONE,
                           "error": done.error, "layer": done.layer, "start": done.start_time, "end": done.end_time,
                           "bytes": done.bytes_written, "descriptors": done.descriptor_count,
                           "post_s": done.post_duration_s})

    def on_instruction(instruction: Any) -> None:  # tap: stamp arrival
        instructions.setdefault(instruction.transfer_id, time.time())

    # Wired by the connector's own builder, as KVPushConnector.register_kv_caches wires a prefill worker.
    parts = build_worker_half(config, kv_caches, args.block_size, args.heads, args.head_size, 0, 1,
                              f"{PREFILL_ENGINE}-tp0-bench", tap_write_done=on_write_done,
                              tap_instruction=on_instruction)
    worker, agent = parts.half, parts.agent
    pool = BlockPool(1, args.num_blocks)
    requests: dict[str, dict[str, Any]] = {}
    conn = Client(tuple(args.control), authkey=bytes.fromhex(args.authkey))
    conn.send({"op": "ready", "role": "prefill", "agent": agent.agent_name, "layout": agent.layout.layout_name,
               "memory": agent.layout.memory_kind, "stand_in": vllm_is_stand_in()})

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    def new_event() -> Any:
        if not on_gpu:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    timelines: dict[str, dict[str, Any]] = {}

    def engine_hooks_after_forward(finished_req_ids: set[str], done: set[str], done_at: dict[str, float]) -> None:
        worker.wait_for_save()
        for rid in worker.get_finished_sending(finished_req_ids):
            done.add(rid)
            done_at[rid] = time.time()
        meta_out = worker.build_worker_meta()
        if meta_out is not None:
            for rid, by_rank in meta_out.timelines.items():
                timelines.setdefault(rid, {}).update(combine_rank_timelines(by_rank))

    def run_batch(msg: dict[str, Any]) -> dict[str, Any]:
        mode = msg["mode"]
        done: set[str] = set()
        done_at: dict[str, float] = {}
        held_next: list[str] = []
        finished_prev: set[str] = set()
        hidden: dict[str, Any] = {}
        step_records = []
        all_rids = []
        for step in msg["steps"]:
            chunks = []
            xs, slot_lists = [], []
            for c in step:
                rid = c["request_id"]
                if rid not in requests:
                    all_rids.append(rid)
                    requests[rid] = {"transfer_id": c["transfer_id"], "prompt": c["prompt"],
                                     "blocks": pool.take(-(-c["prompt"] // args.block_size)), "mode": mode}
                    hidden[rid] = model.embed(c["seed"], c["prompt"])
                rec = requests[rid]
                needed = -(-c["end"] // args.block_size)
                chunks.append(PrefillChunk(request_id=rid, transfer_id=c["transfer_id"], token_start=c["start"],
                                           token_end=c["end"], prompt_token_count=c["prompt"],
                                           block_ids=tuple(rec["blocks"][:needed]), cached_token_count=0))
                xs.append(hidden[rid][c["start"]:c["end"]])
                tok = torch.arange(c["start"], c["end"], device=device)
                blocks = torch.tensor(rec["blocks"], dtype=torch.long, device=device)
                slot_lists.append(blocks[tok // args.block_size] * args.block_size + tok % args.block_size)
            x = torch.cat(xs)
            slots = torch.cat(slot_lists)
            sync()  # inputs ready before the timed forward (vLLM prepares inputs before the forward)
            # --- one engine step: bind_connector_metadata -> forward with save_kv_layer -> after-forward hooks
            worker.begin_step(KVPushMetadata(prefill_chunks=chunks, held_prefills=held_next))
            held_next = []
            t0 = time.time()
            start_ev = new_event()
            layer_ev, layer_host, hook_s = [], [], []
            for i, name in enumerate(layer_names):
                x = model.layer(i, x, kv_caches[name], slots)
                if mode == "stream":
                    h0 = time.perf_counter()
                    worker.save_kv_layer(name)
                    hook_s.append(time.perf_counter() - h0)
                layer_ev.append(new_event())
                layer_host.append(time.time())
            host_enqueued = time.time()
            if mode == "after":
                sync()  # the whole forward finished; only now are the layers handed to the connector
                t_after = time.time()
                for name in layer_names:
                    h0 = time.perf_counter()
                    worker.save_kv_layer(name)
                    hook_s.append(time.perf_counter() - h0)
            h0 = time.perf_counter()
            engine_hooks_after_forward(finished_prev, done, done_at)
            after_hooks_s = time.perf_counter() - h0
            finished_prev = set()
            sync()  # the step's end (vLLM's sampler syncs)
            t_sync = time.time()
            if on_gpu:
                layer_end = [t0 + start_ev.elapsed_time(ev) / 1e3 for ev in layer_ev]
            else:
                layer_end = layer_host
            step_records.append({"tokens": int(x.shape[0]), "chunks": len(chunks), "t0": t0,
                                 "compute_ms": round((layer_end[-1] - t0) * 1e3, 3),
                                 "host_enqueue_ms": round((host_enqueued - t0) * 1e3, 3),
                                 "sync_after_ms": round((t_sync - layer_end[-1]) * 1e3, 3),
                                 "save_kv_layer_ms_total": round(sum(hook_s) * 1e3, 3),
                                 "save_kv_layer_ms_median": round(statistics.median(hook_s) * 1e3, 3),
                                 "save_kv_layer_ms_max": round(max(hook_s) * 1e3, 3),
                                 "after_forward_hooks_ms": round(after_hooks_s * 1e3, 3),
                                 **({"save_kv_layer_calls_after_ms": round((t_after - t0) * 1e3, 3)}
                                    if mode == "after" else {})})
            for c in step:
                rec = requests[c["request_id"]]
                rec["layer_gpu_end"] = layer_end  # last step's per-layer ends (the last chunk's)
                rec["compute_ms"] = round(rec.get("compute_ms", 0.0) + step_records[-1]["compute_ms"], 3)
                rec["steps"] = rec.get("steps", 0) + 1
                if c["end"] >= c["prompt"]:
                    rec["gpu_end"] = layer_end[-1]
                    rec["host_last_save_kv_layer"] = layer_host[-1]
                    held_next.append(c["request_id"])
                    finished_prev.add(c["request_id"])
            del x, slots
        # The engine keeps stepping while holds are open (has_pending_push_work): empty steps.
        deadline = time.monotonic() + args.timeout_s
        empty_steps = 0
        while not set(all_rids) <= done and time.monotonic() < deadline:
            worker.begin_step(KVPushMetadata(held_prefills=held_next, empty_step=True))
            held_next = []
            engine_hooks_after_forward(finished_prev, done, done_at)
            finished_prev = set()
            empty_steps += 1
            time.sleep(args.idle_step_s)
        result = {}
        for rid in all_rids:
            rec = requests[rid]
            tid = rec["transfer_id"]
            with tap_lock:
                mine = [w for w in writes if w["transfer_id"] == tid]
            result[rid] = {"transfer_id": tid, "prompt": rec["prompt"], "mode": mode,
                           "gpu_end": rec.get("gpu_end"), "host_last_save_kv_layer": rec.get("host_last_save_kv_layer"),
                           "layer_gpu_end": rec.get("layer_gpu_end"), "instruction_time": instructions.get(tid),
                           "finished_sending_time": done_at.get(rid), "finished_sending": rid in done,
                           "writes": mine, "timeline": timelines.get(rid), "block_count": len(rec["blocks"]),
                           "compute_ms": rec.get("compute_ms"), "steps": rec.get("steps"),
                           "first_block": rec["blocks"][0]}
        return {"op": "prefilled", "batch": msg["batch"], "requests": result, "steps": step_records,
                "empty_steps": empty_steps}

    def calibrate(token_counts: list[int]) -> dict[str, float]:
        """The same forward with no connector hook at all, KV into a scratch cache (GPU time of the model alone)."""
        out = {}
        for n in token_counts:
            scratch = torch.empty(2, -(-n // args.block_size), args.block_size, args.heads, args.head_size,
                                  dtype=torch.bfloat16, device=device)
            slots = torch.arange(n, device=device)
            times = []
            for _ in range(3):
                x = model.embed(1, n)
                sync()
                t0 = time.perf_counter()
                start_ev = new_event()
                for i in range(args.layers):
                    x = model.layer(i, x, scratch, slots)
                end_ev = new_event()
                sync()
                times.append(start_ev.elapsed_time(end_ev) if on_gpu else (time.perf_counter() - t0) * 1e3)
            out[str(n)] = round(statistics.median(times), 3)
            del scratch
        return out

    profiled = False
    while True:
        msg = conn.recv()
        if msg["op"] == "prefill":
            if args.profile and not profiled and msg["mode"] == "stream" and msg.get("name") == "single_stream":
                import cProfile
                import io
                import pstats

                profiled = True
                prof = cProfile.Profile()
                prof.enable()
                reply = run_batch(msg)
                prof.disable()
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(40)
                print("=== cProfile of one streamed single request (prefill forward thread) ===\n" + buf.getvalue(),
                      flush=True)
                conn.send(reply)
            else:
                conn.send(run_batch(msg))
        elif msg["op"] == "calibrate":
            conn.send({"op": "calibrated", "forward_ms": calibrate(msg["tokens"])})
        elif msg["op"] == "hash":
            out = {rid: layer_hashes(kv_caches, requests[rid]["blocks"], requests[rid]["prompt"], args.block_size)
                   for rid in msg["request_ids"]}
            conn.send({"op": "hashes", "hashes": out})
        elif msg["op"] == "stop":
            break
    parts.shutdown()
    return 0


# ==================================================================== orchestrator


def wait_port(port: int, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"directory exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"directory port {port} not open within {timeout_s}s")


def accept_bounded(listener: Listener, procs: list[subprocess.Popen], timeout_s: float) -> Any:
    """listener.accept() in a helper thread, failing when a child exits or the bound passes."""
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(listener.accept()), daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not box:
        thread.join(0.5)
        if box:
            break
        dead = [p.args[2] for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"child {dead} exited before connecting (see its log)")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no child connected within {timeout_s}s")
    return box[0]


class Child:
    def __init__(self, name: str, conn: Any, proc: subprocess.Popen) -> None:
        self.name, self.conn, self.proc = name, conn, proc

    def recv(self, op: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: no {op!r} within {timeout_s}s")
            if self.conn.poll(min(left, 1.0)):
                msg = self.conn.recv()
                if msg["op"] != op:
                    raise RuntimeError(f"{self.name}: expected {op!r}, got {msg['op']!r}")
                return msg
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")


def child_argv(mode: str, args: argparse.Namespace, extra: list[str]) -> list[str]:
    shared = ["--device", args.device, "--block-size", str(args.block_size), "--layers", str(args.layers),
              "--heads", str(args.heads), "--head-size", str(args.head_size), "--hidden", str(args.hidden),
              "--intermediate", str(args.intermediate), "--num-blocks", str(args.num_blocks),
              "--timeout-s", str(args.timeout_s), "--idle-step-s", str(args.idle_step_s),
              "--nixl-threads", str(args.nixl_threads), *(["--profile"] if args.profile else [])]
    return [sys.executable, str(Path(__file__).resolve()), mode, *shared, *extra]


def build_scenarios(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The batches of the run: each is one prefill command (steps of chunks) and the decode allocations it needs."""
    p = args.prompt
    out: list[dict[str, Any]] = [{"name": "warmup", "mode": "stream", "order": "alloc_first",
                                  "steps": [[("w0", 0, 2048 * args.scale_num // args.scale_den)]]}]
    for i in range(args.reps):
        for mode in ("stream", "after"):
            out.append({"name": f"single_{mode}", "mode": mode, "order": "alloc_first",
                        "steps": [[(f"s{i}{mode[0]}", 0, p)]]})
    # Chunked prefill: chunk ends mid-block, last block partial.
    long = args.chunked_prompt
    c = args.chunk
    out.append({"name": "chunked", "mode": "stream", "order": "alloc_first",
                "steps": [[("c0", s, min(s + c, long))] for s in range(0, long, c)]})
    # Concurrent requests in mixed steps; prefill dispatched at once with decode's allocation (gateway order).
    a, b, cc, d = (x * args.scale_num // args.scale_den for x in (5000, 1000, 1500, 2500))
    out.append({"name": "concurrent", "mode": "stream", "order": "together",
                "steps": [[("a", 0, 2000 * args.scale_num // args.scale_den), ("b", 0, b), ("c", 0, cc)],
                          [("a", 2000 * args.scale_num // args.scale_den, a), ("d", 0, d)]],
                "prompts": {"a": a, "b": b, "c": cc, "d": d}})
    # Decode's allocation reaches the directory after prefill started computing.
    out.append({"name": "late_allocation", "mode": "stream", "order": "prefill_first",
                "steps": [[("l0", 0, p)]]})
    return out


def scenario_prompts(sc: dict[str, Any]) -> dict[str, int]:
    prompts: dict[str, int] = dict(sc.get("prompts", {}))
    for step in sc["steps"]:
        for rid, _start, end in step:
            prompts[rid] = max(prompts.get(rid, 0), end)
    return prompts


def run_main(args: argparse.Namespace) -> int:
    setup_imports()
    from kvpush.client.config import ChannelConfig
    from kvpush.client.sync import SyncDirectoryClient
    from kvpush.localstack.processes import free_port
    from kvpush.v1 import types_pb2 as tpb

    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    log_dir = Path(args.log_dir) if args.log_dir else out_dir
    log_dir.mkdir(parents=True, exist_ok=True)
    scenarios = build_scenarios(args)
    # Size the pools: every request gets fresh blocks (none reused, so the final byte check sees what was pushed).
    need = sum(-(-n // args.block_size) for sc in scenarios for n in scenario_prompts(sc).values())
    args.num_blocks = need + 2
    port = free_port()
    args.directory = f"127.0.0.1:{port}"
    base_env = {**os.environ, "KVPUSH_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen] = []

    def spawn(name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        # The child writes to its own copy of the log's descriptor; this process's copy closes once it has started.
        with open(log_dir / f"{args.out_name.removesuffix('.json')}.{name}.log", "w") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))
        procs.append(proc)
        return proc

    started = time.time()
    result: dict[str, Any] = {}
    try:
        directory = spawn("directory", child_argv("directory", args, ["--port", str(port)]), base_env)
        wait_port(port, 60, directory)
        authkey = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        control = ["--control", "127.0.0.1", str(listener.address[1]), "--authkey", authkey.hex(),
                   "--directory", args.directory]
        children: dict[str, Child] = {}
        spawned = {}
        for name, gpu in (("decode", "1"), ("prefill", "0")):
            env = dict(base_env)
            if args.device == "cuda":
                env["CUDA_VISIBLE_DEVICES"] = gpu  # each process sees only its GPU
            spawned[name] = spawn(name, child_argv(name, args, control), env)
        for _ in spawned:  # each connects once registered with the directory
            conn = accept_bounded(listener, list(spawned.values()), 300)
            first = conn.recv()
            name = first["role"]
            children[name] = Child(name, conn, spawned[name])
            children[name].ready = first
            print(f"{name} ready: {first}", flush=True)
        prefill, decode = children["prefill"], children["decode"]
        client = SyncDirectoryClient(ChannelConfig.from_dict({"directory_address": args.directory}), "bench-gateway")
        records: list[dict[str, Any]] = []
        step_tokens: list[dict[str, Any]] = []
        seed = 100
        for n, sc in enumerate(scenarios):
            prompts = scenario_prompts(sc)
            tids = {}
            for rid in prompts:
                plan = client.plan_transfer(request_id=f"{sc['name']}-{n}-{rid}", prompt_token_count=prompts[rid],
                                            prefill_engine_id=PREFILL_ENGINE, decode_engine_id=DECODE_ENGINE)
                tids[rid] = plan.transfer.transfer_id
            seeds = {rid: seed + i for i, rid in enumerate(prompts)}
            seed += len(prompts)
            batch = f"b{n}"
            recv_msg = {"op": "receive", "batch": batch,
                        "requests": [{"request_id": f"{batch}-{rid}", "transfer_id": tids[rid], "prompt": prompts[rid]}
                                     for rid in prompts]}
            prefill_msg = {"op": "prefill", "batch": batch, "mode": sc["mode"], "name": sc["name"],
                           "steps": [[{"request_id": f"{batch}-{rid}", "transfer_id": tids[rid], "start": s, "end": e,
                                       "prompt": prompts[rid], "seed": seeds[rid]} for rid, s, e in step]
                                     for step in sc["steps"]]}
            sent = {}
            if sc["order"] == "prefill_first":
                prefill.conn.send(prefill_msg)
                sent["prefill"] = time.time()
                time.sleep(args.late_alloc_s)
                decode.conn.send(recv_msg)
                sent["decode"] = time.time()
                decode.recv("allocated", 30)
            else:
                decode.conn.send(recv_msg)
                sent["decode"] = time.time()
                decode.recv("allocated", 30)
                if sc["order"] == "alloc_first":  # wait until the directory holds the allocation (bounded)
                    deadline = time.monotonic() + 10
                    for tid in tids.values():
                        while client.get_transfer(tid).state == tpb.TRANSFER_STATE_PLANNED:
                            if time.monotonic() > deadline:
                                raise TimeoutError(f"allocation of {tid} not seen")
                            time.sleep(0.002)
                prefill.conn.send(prefill_msg)
                sent["prefill"] = time.time()
            pre = prefill.recv("prefilled", args.timeout_s + 60)
            step_tokens.extend({"batch": n, "scenario": sc["name"], "mode": sc["mode"], **st} for st in pre["steps"])
            dec = decode.recv("received", args.timeout_s + 30)
            for rid in prompts:
                full = f"{batch}-{rid}"
                p, d = pre["requests"][full], dec["requests"][full]
                t = client.get_transfer(tids[rid])
                records.append(summarize(sc, n, full, p, d, t, tpb))
            r = [x for x in records if x["batch"] == n]
            print(f"{sc['name']:>16} {sc['mode']:>6}: " + "; ".join(
                f"{x['request_id']} {x['state']} tail_dir={x['tail_ms_directory']} tail_gpu={x['tail_ms_gpu_end']} "
                f"pre_end_layers={x['layers_written_before_prefill_end_count']} compute={x['compute_ms']}"
                for x in r) + f" steps={pre['steps']}", flush=True)
        prefill.conn.send({"op": "calibrate", "tokens": sorted({st["tokens"] for st in step_tokens})})
        calibration = prefill.recv("calibrated", 300)["forward_ms"]
        print(f"forward without connector hooks (ms by tokens): {calibration}", flush=True)
        # Byte check: every layer of every request, decode's destination vs prefill's source.
        rids = [x["request_id"] for x in records]
        prefill.conn.send({"op": "hash", "request_ids": rids})
        decode.conn.send({"op": "hash", "request_ids": rids})
        ph = prefill.recv("hashes", 600)["hashes"]
        dh = decode.recv("hashes", 600)["hashes"]
        for x in records:
            a, b = ph[x["request_id"]], dh[x["request_id"]]
            x["layers_equal"] = sum(1 for u, v in zip(a, b) if u == v)
            x["bytes_equal"] = a == b
            x["layers_differing"] = [i for i, (u, v) in enumerate(zip(a, b)) if u != v]
        for c in children.values():
            c.conn.send({"op": "stop"})
        result = build_report(args, scenarios, records, children, started)
        result["steps"] = step_tokens
        result["forward_without_connector_ms"] = calibration
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
    path = write_result(out_dir / args.out_name, result, indent=1, echo=False)
    print_table(result)
    print(f"wrote {path}")
    return 0 if result.get("all_ok") else 1


def summarize(sc: dict[str, Any], n: int, rid: str, p: dict[str, Any], d: dict[str, Any], t: Any, tpb: Any) -> dict:
    timing = t.rank_timings[0].timing if len(t.rank_timings) else None
    last_write_end = ts(timing.last_write_end_time) if timing is not None else None
    prefill_end = ts(timing.prefill_end_time) if timing is not None else None
    first_write_start = ts(timing.first_write_start_time) if timing is not None else None
    gpu_end = p["gpu_end"]
    writes = p["writes"]
    ok_writes = [w for w in writes if w["ok"]]
    layer_end = p.get("layer_gpu_end") or []
    lag = [w["end"] - layer_end[w["layer"]] for w in ok_writes if 0 <= w["layer"] < len(layer_end)
           and p.get("steps") == 1]

    def ms(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round((a - b) * 1e3, 3)

    return {
        "batch": n, "scenario": sc["name"], "mode": sc["mode"], "order": sc["order"], "request_id": rid,
        "transfer_id": p["transfer_id"], "prompt_tokens": p["prompt"], "state": tpb.TransferState.Name(t.state),
        "failure_reason": t.failure_reason,
        "bytes_written_directory": t.bytes_written, "bytes_written_writes": sum(w["bytes"] for w in ok_writes),
        "layers_written_count": t.layers_written_count,
        "write_count": timing.write_count if timing is not None else None,
        "descriptor_count": timing.descriptor_count if timing is not None else None,
        "post_ms": round(timing.post_duration.ToNanoseconds() / 1e6, 3) if timing is not None else None,
        "layers_written_before_prefill_end_count": (timing.layers_written_before_prefill_end_count
                                                    if timing is not None else None),
        "writes_before_gpu_end": sum(1 for w in ok_writes if gpu_end is not None and w["end"] < gpu_end),
        "failed_writes": [w for w in writes if not w["ok"]][:3],
        # Tails (ms). "directory": the task's definition, from rank_timings (prefill_end = last layer's CUDA event
        # seen complete).
        "tail_ms_directory": ms(last_write_end, prefill_end),
        "tail_ms_gpu_end": ms(last_write_end, gpu_end),
        "host_ahead_of_gpu_ms": ms(gpu_end, prefill_end),
        "decode_finished_after_gpu_end_ms": ms(d.get("finished_recving_time"), gpu_end),
        "notification_after_gpu_end_ms": ms(d.get("notification_time"), gpu_end),
        "instruction_after_gpu_end_ms": ms(p.get("instruction_time"), gpu_end),
        "first_write_before_gpu_end_ms": ms(gpu_end, first_write_start),
        "write_lag_after_layer_gpu_end_ms_median": round(statistics.median(lag) * 1e3, 3) if lag else None,
        "write_lag_after_layer_gpu_end_ms_max": round(max(lag) * 1e3, 3) if lag else None,
        "compute_ms": p.get("compute_ms"), "steps": p.get("steps"),
        "directory": {"allocate_time": ts(t.allocate_time), "first_ready_time": ts(t.first_ready_time),
                      "dispatch_time": ts(t.dispatch_time), "end_time": ts(t.end_time)},
        "gpu_end": gpu_end, "prefill_end": prefill_end, "last_write_end": last_write_end,
        "decode_ok": d.get("ok"), "decode_load_error_blocks": d.get("load_error_blocks"),
        "finished_sending": p["finished_sending"], "src_first_block": p["first_block"],
        "dst_first_block": d.get("first_block"), "blocks": p["block_count"],
    }


def build_report(args: argparse.Namespace, scenarios: list, records: list, children: dict, started: float) -> dict:
    import platform

    info: dict[str, Any] = {}
    try:
        import torch

        info["torch"] = torch.__version__
        if args.device == "cuda":
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception as exc:  # pragma: no cover - informational
        info["torch_error"] = repr(exc)
    measured = [r for r in records if r["scenario"] != "warmup"]

    def med(key: str, scenario: str | None = None, mode: str | None = None) -> float | None:
        vals = [r[key] for r in measured if r[key] is not None and (scenario is None or r["scenario"] == scenario)
                and (mode is None or r["mode"] == mode)]
        return round(statistics.median(vals), 3) if vals else None

    def mx(key: str, scenario: str | None = None, mode: str | None = None) -> float | None:
        vals = [r[key] for r in measured if r[key] is not None and (scenario is None or r["scenario"] == scenario)
                and (mode is None or r["mode"] == mode)]
        return round(max(vals), 3) if vals else None

    summary = {}
    for name, mode in (("single_stream", "stream"), ("single_after", "after"), ("chunked", "stream"),
                       ("concurrent", "stream"), ("late_allocation", "stream")):
        summary[name] = {k: {"median": med(k, name, mode), "max": mx(k, name, mode)} for k in (
            "tail_ms_directory", "tail_ms_gpu_end", "decode_finished_after_gpu_end_ms", "compute_ms",
            "host_ahead_of_gpu_ms", "layers_written_before_prefill_end_count", "writes_before_gpu_end",
            "write_lag_after_layer_gpu_end_ms_median")}
    all_complete = all(r["state"] == "TRANSFER_STATE_COMPLETE" for r in records)
    all_equal = all(r["bytes_equal"] for r in records)
    return {
        "command": " ".join(sys.argv), "host": platform.node(), **info, "device": args.device,
        "vllm_base_classes": "stand-in (vLLM absent)" if children["prefill"].ready.get("stand_in") else "vLLM's own",
        "shape": {"layers": args.layers, "block_size": args.block_size, "heads": args.heads,
                  "head_size": args.head_size, "hidden": args.hidden, "intermediate": args.intermediate,
                  "num_blocks": args.num_blocks, "dtype": "bfloat16",
                  "kv_layout": "(2, num_blocks, block_size, kv_heads, head_size) per layer"},
        "agents": {k: c.ready for k, c in children.items()},
        "settings": {"idle_step_s": args.idle_step_s, "timeout_s": args.timeout_s,
                     "nixl_num_threads": args.nixl_threads, "late_alloc_s": args.late_alloc_s,
                     "nixl_polls": "connector defaults (poll_max_s 1e-3, notif_poll_s 1e-3)"},
        "all_complete": all_complete, "all_bytes_equal": all_equal, "all_ok": all_complete and all_equal,
        "requests": len(records), "wall_s": round(time.time() - started, 1),
        "summary": summary, "records": records,
    }


def print_table(result: dict[str, Any]) -> None:
    print(f"all_complete={result.get('all_complete')} all_bytes_equal={result.get('all_bytes_equal')} "
          f"requests={result.get('requests')} wall_s={result.get('wall_s')}")
    for r in result.get("records", []):
        print(f"{r['scenario']:>16} {r['mode']:>6} {r['request_id']:>10} {r['prompt_tokens']:>6} tok "
              f"{r['state'][15:]:>9} equal={r['bytes_equal']} diff_layers={r['layers_differing'][:6]} "
              f"bytes={r['bytes_written_directory']} tail_dir={r['tail_ms_directory']} tail_gpu={r['tail_ms_gpu_end']} "
              f"dec={r['decode_finished_after_gpu_end_ms']} pre_end={r['layers_written_before_prefill_end_count']} "
              f"gpu_pre_end={r['writes_before_gpu_end']} compute={r['compute_ms']} ahead={r['host_ahead_of_gpu_ms']}")


# ==================================================================== argv


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("run", "directory", "prefill", "decode"))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--num-blocks", type=int, default=0)
    parser.add_argument("--prompt", type=int, default=4096, help="tokens of the single requests")
    parser.add_argument("--chunked-prompt", type=int, default=10000)
    parser.add_argument("--chunk", type=int, default=2000)
    parser.add_argument("--scale-num", type=int, default=1, help="scale the warm-up/concurrent prompts by num/den")
    parser.add_argument("--scale-den", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--late-alloc-s", type=float, default=0.005)
    parser.add_argument("--idle-step-s", type=float, default=2e-4, help="sleep between empty engine steps")
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--nixl-threads", type=int, default=0)
    parser.add_argument("--out-name", default="connector_gpu_run.json")
    parser.add_argument("--log-dir", default="")
    parser.add_argument("--profile", action="store_true", help="cProfile one streamed request in the prefill log")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--control", nargs=2, default=None)
    parser.add_argument("--authkey", default="")
    parser.add_argument("--directory", default="")
    args = parser.parse_args(argv)
    if args.control is not None:
        args.control = (args.control[0], int(args.control[1]))
    modes = {"run": run_main, "directory": directory_main, "prefill": prefill_main, "decode": decode_main}
    return modes[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
