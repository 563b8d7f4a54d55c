"""What planning a prefill worker's writes costs on the forward thread: a full plan per layer vs one moved plan.

A prefill worker writes the same blocks and token range once per layer, from `save_kv_layer` on vLLM's
forward thread. `plan_write` validates the ids and computes every descriptor index each time;
`LayerPlanCache` plans the first layer and moves that plan to the others (array additions). Both are
timed side by side for layouts the connector meets: vLLM CPU (block-atomic, 128-token blocks), a GPU
K/V-first layout with 16-token blocks (many blocks per request), the same with a partial last block
(explicit token-exact rows), and a 16 -> 128 block-size mismatch (chunk tables). No NIXL, no memory
touched: the tensors are described by address only.

`save_kv_layer` case: what the prefill worker's hook costs on the forward thread for a 32-layer, 4096-token
transfer whose instruction already arrived (every save makes one write possible), with a transport that
plans each write as `PushWriter.submit` does (`LayerPlanCache`) and queues it. "forward" is the median time
inside save_kv_layer per layer; "until_submitted" the time from the first save until every write of the
transfer was planned and queued (on whichever thread the worker plans them). It runs against whichever
worker the imported package has (before and after the one-owner change), so
bench/plan_bench_compare.py can time two commits side by side.

Usage:  python bench/plan_bench.py [--reps 30] [--out NAME]
Prints JSON and writes bench/results/NAME (plan_bench.json by default).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kvpush.dataplane.describe import describe_kv_caches
from kvpush.dataplane.layout import KVLayoutSpec
from kvpush.dataplane.plan import LayerPlanCache, plan_write

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(RESULTS.parent))
from bench_io import write_result  # bench/, this script's folder


class AddressOnlyTensor:
    """A KV tensor as `describe_kv_caches` sees it: shape, strides, element size and an address."""

    def __init__(self, shape: tuple[int, ...], address: int, element_size: int = 2) -> None:
        self.shape, self.dtype, self._address, self._element = shape, "bfloat16", address, element_size
        strides, step = [], 1
        for dim in reversed(shape):
            strides.append(step)
            step *= dim
        self._strides = tuple(reversed(strides))
        self.nbytes = step * element_size

    def data_ptr(self) -> int:
        return self._address

    def element_size(self) -> int:
        return self._element

    def stride(self) -> tuple[int, ...]:
        return self._strides


def layout(layers: int, blocks: int, block_size: int, heads: int, head_size: int, hint: str, base: int) -> KVLayoutSpec:
    """Describe `layers` equal KV tensors of the `hint` form laid out one after another from `base`."""
    shapes = {"cpu_attn": (blocks, heads, block_size, 2 * head_size),
              "kv_first": (2, blocks, block_size, heads, head_size)}
    caches, address = {}, base
    for i in range(layers):
        tensor = AddressOnlyTensor(shapes[hint], address)
        caches[f"model.layers.{i}.self_attn"] = tensor
        address += tensor.nbytes
    spec, _ = describe_kv_caches(caches, block_size, heads, head_size, hint)
    return spec


@dataclass(frozen=True)
class Case:
    name: str
    layers: int
    tokens: int
    src_block: int
    dst_block: int
    heads: int
    head_size: int
    hint: str


CASES = (
    Case("cpu_attn_2048tok_block128_8layers", 8, 2048, 128, 128, 8, 64, "cpu_attn"),
    Case("gpu_kv_first_4096tok_block16_32layers", 32, 4096, 16, 16, 8, 128, "kv_first"),
    Case("gpu_kv_first_4004tok_partial_block_32layers", 32, 4004, 16, 16, 8, 128, "kv_first"),
    Case("gpu_mismatch_16_to_128_4096tok_32layers", 32, 4096, 16, 128, 8, 128, "kv_first"),
)


def run_case(case: Case, reps: int) -> dict:
    src_blocks, dst_blocks = -(-case.tokens // case.src_block), -(-case.tokens // case.dst_block)
    src = layout(case.layers, 4 * src_blocks, case.src_block, case.heads, case.head_size, case.hint, 1 << 32)
    dst = layout(case.layers, 4 * dst_blocks, case.dst_block, case.heads, case.head_size, case.hint, 1 << 40)
    # Scattered ids (every other block), as a busy engine hands them out.
    src_ids = tuple(range(1, 2 * src_blocks, 2))
    dst_ids = tuple(range(2, 2 * dst_blocks + 1, 2))
    full, moved = [], []
    for _ in range(reps):
        start = time.perf_counter()
        plans = [plan_write(src, dst, [layer], src_ids, dst_ids, 0, case.tokens) for layer in range(case.layers)]
        full.append((time.perf_counter() - start) / case.layers)
        cache = LayerPlanCache()
        start = time.perf_counter()
        cached = [cache.plan(src, dst, "peer", [layer], src_ids, dst_ids, 0, case.tokens)
                  for layer in range(case.layers)]
        moved.append((time.perf_counter() - start) / case.layers)
        assert all(a.descriptor_count == b.descriptor_count and (a.local_indices == b.local_indices).all()
                   and (a.explicit == b.explicit).all() for a, b in zip(plans, cached, strict=True))
    full_us, moved_us = statistics.median(full) * 1e6, statistics.median(moved) * 1e6
    return {"case": case.name, "layers": case.layers, "tokens": case.tokens, "src_blocks": src_blocks,
            "descriptors_per_write": plans[0].descriptor_count, "explicit_rows": int(plans[0].explicit.shape[0]),
            "full_plan_us_per_write": round(full_us, 1), "cached_us_per_write": round(moved_us, 1),
            "speedup": round(full_us / moved_us, 1),
            "forward_thread_ms_per_transfer_full": round(full_us * case.layers / 1e3, 2),
            "forward_thread_ms_per_transfer_cached": round(moved_us * case.layers / 1e3, 2)}


class _PlanningTransport:
    """A PushTransport stand-in: plans each write as PushWriter.submit does and queues it; nothing is posted."""

    def __init__(self, src: KVLayoutSpec, dst: KVLayoutSpec) -> None:
        self.src, self.dst, self.cache, self.queued = src, dst, LayerPlanCache(), 0
        self.all_queued = threading.Event()
        self.expected = 0

    def has_peer(self, agent_name) -> bool:
        return True

    def ensure_peer(self, agent_name, metadata, layout) -> None:
        pass

    def peer_block_size_tokens(self, agent_name) -> int:
        return self.dst.block_size_tokens

    def submit(self, transfer_id, peer_agent, write, notification, ready_event, traceparent,
               post_guard=None) -> None:
        self.cache.plan(self.src, self.dst, peer_agent, [write.layer], write.src_block_ids, write.dst_block_ids,
                        write.token_start, write.token_end)
        self.queued += 1
        if self.queued == self.expected:
            self.all_queued.set()

    def when_computed(self, event, callback) -> None:
        pass

    def cancel(self, transfer_id) -> None:
        pass


class _Session:
    def send_ready(self, events) -> None:
        pass

    def send_result(self, result) -> None:
        pass


class _Directory:
    session = _Session()
    registration = None  # no lease: nothing to fence


def run_save_kv_layer_case(reps: int) -> dict:
    """Time the prefill worker's save_kv_layer (see the module docstring), old or new worker API."""
    import inspect

    from kvpush.connector.config import ConnectorConfig
    from kvpush.connector.metadata import KVPushMetadata, PrefillChunk
    from kvpush.connector.worker.prefill import PrefillWorker
    from kvpush.v1 import directory_pb2 as dpb

    layers, tokens, bs = 32, 4096, 16
    src = layout(layers, 4 * tokens // bs, bs, 8, 128, "kv_first", 1 << 32)
    dst = layout(layers, 4 * tokens // bs, bs, 8, 128, "kv_first", 1 << 40)
    names = [f"model.layers.{i}.self_attn" for i in range(layers)]
    config = ConnectorConfig.from_extra_config({"directory_address": "127.0.0.1:1"}, role="prefill", engine_id="p")
    one_owner = "loop" in inspect.signature(PrefillWorker.__init__).parameters
    forward, until_submitted = [], []
    for rep in range(reps):
        transport = _PlanningTransport(src, dst)
        transport.expected = layers
        agent = None
        if one_owner:
            from kvpush.dataplane.agent import TransferAgent
            from kvpush.dataplane.config import BACKEND_INMEMORY, NixlConfig

            agent = TransferAgent(f"bench-{rep}", NixlConfig(backends=(BACKEND_INMEMORY,),
                                                              backend_params={BACKEND_INMEMORY: {"fabric": "bench"}}))
            agent.start()
            worker = PrefillWorker(config, _Directory(), names, bs, agent, transport)
        else:
            worker = PrefillWorker(config, _Directory(), names, bs)
            worker.attach_transport(transport)
        transfer = f"t{rep}"
        chunk = PrefillChunk("r", transfer, 0, tokens, tokens, tuple(range(1, 2 * tokens // bs, 2)))
        worker.begin_step(KVPushMetadata(prefill_chunks=[chunk]))
        worker.on_instruction(dpb.PushInstruction(
            transfer_id=transfer, decode_engine_id="d", decode_agent_name="peer",
            decode_block_ids=list(range(2, 2 * tokens // bs + 1, 2)), prompt_token_count=tokens, notification=b"x"))
        if agent is not None:
            agent.call_soon(lambda: None).result(5)  # the instruction is applied before the forward starts
        per_layer = []
        first = time.perf_counter()
        for name in names:
            start = time.perf_counter()
            worker.save_kv_layer(name)
            per_layer.append(time.perf_counter() - start)
        if not transport.all_queued.wait(10):  # a stand-in the worker no longer fits fails here, not as a figure
            raise RuntimeError(f"{transport.queued} of {layers} writes submitted within 10 s")
        until_submitted.append(time.perf_counter() - first)
        forward.append(statistics.median(per_layer))
        if agent is not None:
            agent.stop()
    return {"case": "save_kv_layer_32layers_4096tok_block16", "one_owner_worker": one_owner,
            "forward_us_per_layer": round(statistics.median(forward) * 1e6, 1),
            "until_submitted_ms": round(statistics.median(until_submitted) * 1e3, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30, help="repetitions per case (median reported)")
    parser.add_argument("--out", default="plan_bench.json", help="file name under bench/results/")
    args = parser.parse_args()
    from kvpush.observability import configure_logging

    # As the connector does at load (INFO unless KVPUSH_LOG_LEVEL says otherwise): unconfigured structlog prints
    # every per-write debug line, which would time the console instead of the worker.
    configure_logging()
    results = {"bench": "plan", "reps": args.reps,
               "cases": [run_case(case, args.reps) for case in CASES], "hook": run_save_kv_layer_case(args.reps)}
    write_result(RESULTS / args.out, results)


if __name__ == "__main__":
    main()
