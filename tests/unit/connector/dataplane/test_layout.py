"""KVLayoutSpec (kvpush.dataplane.layout) and describe_kv_caches (describe)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvpush.connector.worker.layout_wire import layout_from_proto, layout_to_proto
from kvpush.dataplane.describe import describe_kv_caches
from kvpush.dataplane.layout import LayoutError, check_compatible
from kvpush.v1 import types_pb2
from tests.integration.dataplane.kvbuffers import NumpyTensor, make_kv


class TestKVLayoutSpec:
    def test_proto_round_trip_keeps_every_field(self):
        """layout_to_proto / layout_from_proto is lossless, block_atomic included."""
        for hint in ("kv_first", "cpu_attn", "fused_kv", "blocks_first", "mla"):
            layout, _, _ = make_kv(3, 8, 16, 2, 32, hint)
            wire = types_pb2.KVLayout.FromString(layout_to_proto(layout).SerializeToString())
            assert layout_from_proto(wire) == layout

    @pytest.mark.parametrize(
        "change,message",
        [
            ({"layer_count": 0}, "layer_count must be positive"),
            ({"block_count": -1}, "block_count must be positive"),
            ({"memory_kind": "HBM"}, "memory_kind must be DRAM or VRAM"),
            ({"layer_base_addresses": (1,)}, "layer_base_addresses has 1 entries"),
            ({"layer_region_bytes": 64}, "past layer_region_bytes"),
            ({"block_bytes_per_layer": 7}, "sum of plane block_bytes"),
            ({"planes": ()}, "at least one plane"),
        ],
    )
    def test_malformed_layout_is_refused(self, change, message):
        """validate() names the inconsistent field."""
        layout, _, _ = make_kv(2, 8, 16, 2, 32, "kv_first")
        with pytest.raises(LayoutError, match=message):
            dataclasses.replace(layout, **change).validate()

    def test_malformed_plane_is_refused(self):
        """A plane whose blocks overlap is refused."""
        layout, _, _ = make_kv(2, 8, 16, 2, 32, "kv_first")
        plane = dataclasses.replace(layout.planes[0], block_stride_bytes=layout.planes[0].block_bytes - 2)
        with pytest.raises(LayoutError, match="blocks overlap"):
            dataclasses.replace(layout, planes=(plane, layout.planes[1])).validate()

    def test_from_proto_refuses_unspecified_memory(self):
        """MEMORY_KIND_UNSPECIFIED on the wire is refused."""
        layout, _, _ = make_kv(1, 8, 16, 2, 32, "kv_first")
        wire = layout_to_proto(layout)
        wire.memory_kind = types_pb2.MEMORY_KIND_UNSPECIFIED
        with pytest.raises(LayoutError, match="not DRAM or VRAM"):
            layout_from_proto(wire)

    def test_block_and_token_addresses_are_bounds_checked(self):
        """block_descriptor / token_segment_descriptor refuse out-of-range layers, blocks and tokens."""
        layout, _, _ = make_kv(2, 8, 16, 2, 32, "kv_first")
        with pytest.raises(LayoutError, match="layer 2 out of range"):
            layout.block_descriptor(2, 0, 0)
        with pytest.raises(LayoutError, match="block 8 out of range"):
            layout.block_descriptor(0, 8, 0)
        with pytest.raises(LayoutError, match="not inside a block"):
            layout.token_segment_descriptor(0, 0, 0, 0, 10, 7)

    def test_memory_regions_merge_shared_storage(self):
        """Layers that are views of one allocation register as one region."""
        layout, _, _ = make_kv(2, 8, 16, 2, 32, "kv_first")
        shared = dataclasses.replace(
            layout, layer_base_addresses=(layout.layer_base_addresses[0], layout.layer_base_addresses[0] + 64)
        )
        assert shared.memory_regions() == [(layout.layer_base_addresses[0], layout.layer_region_bytes + 64)]

    def test_memory_regions_keep_touching_allocations_apart(self):
        """Adjacent but separate layer allocations stay separate registrations (CUDA IPC needs that)."""
        layout, _, _ = make_kv(2, 8, 16, 2, 32, "kv_first")
        base = layout.layer_base_addresses[0]
        touching = dataclasses.replace(layout, layer_base_addresses=(base, base + layout.layer_region_bytes))
        assert touching.memory_regions() == [(base, layout.layer_region_bytes),
                                             (base + layout.layer_region_bytes, layout.layer_region_bytes)]

    def test_compatibility_checks_dtype_and_token_shape(self):
        """Different dtypes or head counts are refused by check_compatible."""
        a, _, _ = make_kv(1, 8, 16, 2, 32, "kv_first")
        b, _, _ = make_kv(1, 8, 16, 4, 32, "kv_first")
        with pytest.raises(LayoutError, match="token shape differs"):
            check_compatible(a, b)
        with pytest.raises(LayoutError, match="dtype differs"):
            check_compatible(a, dataclasses.replace(a, dtype="float16"))


class TestDescribe:
    def test_kv_first_nhd(self):
        """(2, blocks, block, heads, head) contiguous is two NHD planes, V after all K blocks."""
        layout, _arrays, _ = make_kv(2, 10, 16, 4, 64, "kv_first")
        k, v = layout.planes
        assert (k.segment_count, k.segment_bytes_per_token, k.block_bytes) == (1, 4 * 64 * 2, 16 * 4 * 64 * 2)
        assert v.offset_bytes == 10 * 16 * 4 * 64 * 2
        assert layout.block_count == 10 and not layout.block_atomic

    def test_kv_first_hnd_permutation(self):
        """A logical (2, B, N, H, D) view of physical (2, B, H, N, D) memory is read as HND by its strides."""
        phys = np.zeros((2, 10, 4, 16, 64), np.uint16)
        logical = NumpyTensor(phys.transpose(0, 1, 3, 2, 4))
        layout, _ = describe_kv_caches({"l0": logical}, 16, 4, 64, "kv_first")
        k = layout.planes[0]
        assert (k.segment_count, k.segment_stride_bytes, k.token_stride_bytes) == (4, 16 * 64 * 2, 64 * 2)

    def test_blocks_first(self):
        """(blocks, 2, block, heads, head): V right after K inside each block."""
        layout, _, _ = make_kv(1, 10, 16, 4, 64, "blocks_first")
        k, v = layout.planes
        assert v.offset_bytes == k.block_bytes and k.block_stride_bytes == 2 * k.block_bytes

    def test_cpu_attn_is_block_atomic(self):
        """vLLM CPU (blocks, heads, block, 2*head) is one fused block-atomic plane (the kernel tiles keys)."""
        layout, _, _ = make_kv(2, 10, 128, 2, 32, "cpu_attn")
        assert layout.block_atomic and len(layout.planes) == 1
        assert layout.planes[0].block_bytes == 2 * 128 * 64 * 2
        assert layout.bytes_per_token_per_layer == 2 * 64 * 2
        with pytest.raises(LayoutError, match="block-atomic"):
            layout.token_segment_descriptor(0, 0, 0, 0, 0)

    def test_host_4d_defaults_to_cpu_attn(self):
        """Without a hint, a host 4-D cache is vLLM CPU's layout."""
        arr = np.zeros((4, 2, 32, 64), np.uint16)
        layout, _ = describe_kv_caches({"a": NumpyTensor(arr)}, 32, 2, 32)
        assert layout.layout_name == "cpu_attn"

    def test_mla(self):
        """(blocks, block, dim) is one single-segment plane."""
        layout, _, _ = make_kv(2, 10, 16, 1, 576, "mla")
        assert layout.planes[0].segment_bytes_per_token == 576 * 2

    def test_mla_in_vllm_032_form_is_one_token_addressable_latent(self):
        """vLLM 0.32 hands MLA caches as (blocks, 1, block, 576): one plane, each token's 576 values at t * 576."""
        arr = np.zeros((6, 1, 16, 576), np.float32)
        base = arr.__array_interface__["data"][0]
        layout, _ = describe_kv_caches({"a": NumpyTensor(arr), "b": NumpyTensor(arr.copy())}, 16, 1, 576)
        (plane,) = layout.planes
        assert (layout.layout_name, layout.block_atomic, layout.block_count) == ("mla", False, 6)
        assert (plane.segment_count, plane.segment_bytes_per_token, plane.token_stride_bytes) == (1, 576 * 4, 576 * 4)
        assert layout.block_bytes_per_layer == 16 * 576 * 4 == plane.block_stride_bytes
        assert layout.layer_base_addresses[0] == base
        # Same answer with the hint; a K/V cache of one head (content 2 * head_size) stays vLLM CPU attention's.
        assert describe_kv_caches({"a": NumpyTensor(arr)}, 16, 1, 576, "mla")[0].layout_name == "mla"
        kv_one_head = np.zeros((6, 1, 16, 64), np.float32)
        assert describe_kv_caches({"a": NumpyTensor(kv_one_head)}, 16, 1, 32)[0].layout_name == "cpu_attn"

    def test_layers_with_different_shapes_are_refused(self):
        """Every layer must share one layout; the error names the layer."""
        a = NumpyTensor(np.zeros((4, 2, 32, 64), np.uint16))
        b = NumpyTensor(np.zeros((5, 2, 32, 64), np.uint16))
        with pytest.raises(LayoutError, match="'l1' has shape"):
            describe_kv_caches({"l0": a, "l1": b}, 32, 2, 32)

    @pytest.mark.parametrize(
        "shape,hint,message",
        [
            ((4, 2, 32, 64), "mla", "does not fit a 4-D"),
            ((4, 3, 32, 64), None, "does not match kv_heads"),
            ((2, 2, 32, 2, 32), None, "ambiguous"),
            ((4, 32), None, "rank 2"),
        ],
    )
    def test_unknown_shapes_are_refused(self, shape, hint, message):
        """Shapes that fit no vLLM layout (or the given hint) raise LayoutError."""
        with pytest.raises(LayoutError, match=message):
            describe_kv_caches({"l0": NumpyTensor(np.zeros(shape, np.uint16))}, 32, 2, 32, hint)
