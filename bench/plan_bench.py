"""What planning a prefill worker's writes costs on the forward thread: a full plan per layer vs one moved plan.

A prefill worker writes the same blocks and token range once per layer, from `save_kv_layer` on vLLM's
forward thread. `plan_write` validates the ids and computes every descriptor index each time;
`LayerPlanCache` plans the first layer and moves that plan to the others (array additions). Both are
timed side by side for layouts the connector meets: vLLM CPU (block-atomic, 128-token blocks), a GPU
K/V-first layout with 16-token blocks (many blocks per request), the same with a partial last block
(explicit token-exact rows), and a 16 -> 128 block-size mismatch (chunk tables). No NIXL, no memory
touched: the tensors are described by address only.

Usage:  python bench/plan_bench.py [--reps 30]
Prints JSON and writes bench/results/plan_bench.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from kvpush.connector.dataplane.describe import describe_kv_caches
from kvpush.connector.dataplane.layout import KVLayoutSpec
from kvpush.connector.dataplane.plan import LayerPlanCache, plan_write

RESULTS = Path(__file__).resolve().parent / "results"


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30, help="repetitions per case (median reported)")
    args = parser.parse_args()
    results = {"bench": "plan", "host": platform.node(), "python": platform.python_version(),
               "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "reps": args.reps,
               "cases": [run_case(case, args.reps) for case in CASES]}
    text = json.dumps(results, indent=2)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "plan_bench.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
