"""Test helpers: numpy KV buffers that look like vLLM's per-layer KV tensors (duck-typed)."""

from __future__ import annotations

import numpy as np

from kvpush.dataplane.describe import describe_kv_caches
from kvpush.dataplane.layout import KVLayoutSpec


class NumpyTensor:
    """Wraps a numpy array with the torch-like attributes `describe_kv_caches` reads."""

    def __init__(self, array: np.ndarray, dtype_name: str = "bfloat16") -> None:
        self.array = array
        self.shape = array.shape
        self.dtype = dtype_name
        self._elem = array.itemsize

    def data_ptr(self) -> int:
        return int(self.array.ctypes.data)

    def element_size(self) -> int:
        return self._elem

    def stride(self) -> tuple[int, ...]:
        return tuple(s // self._elem for s in self.array.strides)


def make_kv(
    layers: int,
    blocks: int,
    block_size: int,
    heads: int,
    head_size: int,
    layout_hint: str = "cpu_attn",
    seed: int | None = 0,
) -> tuple[KVLayoutSpec, list[np.ndarray], dict[str, NumpyTensor]]:
    """Per-layer uint16 (bf16-sized) KV arrays in the given vLLM layout, random or zero, described."""
    rng = np.random.default_rng(seed)
    arrays = []
    for _ in range(layers):
        if layout_hint in ("cpu_attn", "fused_kv"):
            shape = (blocks, heads, block_size, 2 * head_size)
        elif layout_hint == "kv_first":
            shape = (2, blocks, block_size, heads, head_size)
        elif layout_hint == "blocks_first":
            shape = (blocks, 2, block_size, heads, head_size)
        else:
            shape = (blocks, block_size, head_size)
        arr = rng.integers(0, 65535, size=shape, dtype=np.uint16) if seed is not None else np.zeros(shape, np.uint16)
        arrays.append(arr)
    caches = {f"model.layers.{i}.self_attn": NumpyTensor(a) for i, a in enumerate(arrays)}
    layout, _ = describe_kv_caches(caches, block_size, heads, head_size, layout_hint)
    return layout, arrays, caches


def token_bytes(layout: KVLayoutSpec, arrays: list[np.ndarray], layer: int, block: int, token: int) -> bytes:
    """All bytes of one token (every plane and segment) of one block of one layer, in plane/segment order."""
    base = layout.layer_base_addresses[layer]  # offsets, so copies of the arrays work too
    flat = arrays[layer].reshape(-1).view(np.uint8)
    out = bytearray()
    for p in range(len(layout.planes)):
        for s in range(layout.planes[p].segment_count):
            addr, length = layout.token_segment_descriptor(layer, block, p, s, token, 1)
            out += flat[addr - base : addr - base + length].tobytes()
    return bytes(out)


def block_bytes(layout: KVLayoutSpec, arrays: list[np.ndarray], layer: int, block: int) -> bytes:
    """All bytes of one block (every plane) of one layer."""
    base = layout.layer_base_addresses[layer]  # offsets, so copies of the arrays work too
    flat = arrays[layer].reshape(-1).view(np.uint8)
    out = bytearray()
    for p in range(len(layout.planes)):
        addr, length = layout.block_descriptor(layer, block, p)
        out += flat[addr - base : addr - base + length].tobytes()
    return bytes(out)
