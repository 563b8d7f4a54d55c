"""Descriptor maths (kvpush.dataplane.plan), checked by executing plans on real memory."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.dataplane.layout import LayoutError
from kvpush.dataplane.plan import (
    TABLE_BLOCK,
    TABLE_CHUNK,
    LayerPlanCache,
    WriteRequestError,
    block_table_rows,
    chunk_table_rows,
    move_to_layer,
    plan_write,
)
from tests.integration.dataplane.kvbuffers import block_bytes, make_kv, token_bytes


def _entries(rows: np.ndarray) -> np.ndarray:
    """Expand Nx5 rows (address, length, device, stride, count) into (address, length) entries."""
    out = []
    for addr, length, _dev, stride, count in rows.astype(np.int64):
        for i in range(count):
            out.append((addr + i * stride, length))
    return np.array(out, dtype=np.int64)


class _Memory:
    """Byte access to several numpy arrays by absolute address."""

    def __init__(self, *array_lists: list[np.ndarray]) -> None:
        self.regions = [(a.ctypes.data, a.reshape(-1).view(np.uint8)) for arrays in array_lists for a in arrays]

    def view(self, addr: int, length: int) -> np.ndarray:
        for base, flat in self.regions:
            if base <= addr and addr + length <= base + flat.size:
                return flat[addr - base : addr - base + length]
        raise AssertionError(f"address {addr:#x}+{length} outside every region")


def _execute(plan, src_layout, dst_layout, memory: _Memory) -> None:
    """Copy bytes the way NIXL would for this plan (table entries by index, then explicit rows)."""
    if plan.local_indices.size:
        if plan.table == TABLE_BLOCK:
            src_entries, dst_entries = _entries(block_table_rows(src_layout)), _entries(block_table_rows(dst_layout))
        else:
            src_entries = _entries(chunk_table_rows(src_layout, plan.granule))
            dst_entries = _entries(chunk_table_rows(dst_layout, plan.granule))
        for li, ri in zip(plan.local_indices, plan.remote_indices, strict=True):
            s_addr, s_len = src_entries[li]
            d_addr, d_len = dst_entries[ri]
            assert s_len == d_len
            memory.view(d_addr, d_len)[:] = memory.view(s_addr, s_len)
    for s_addr, d_addr, length in plan.explicit:
        memory.view(int(d_addr), int(length))[:] = memory.view(int(s_addr), int(length))


def _assert_tokens_moved(src, sa, dst, da, layers, src_ids, dst_ids, start, end) -> None:
    for layer in range(src.layer_count):
        for t in range(0, max(end + dst.block_size_tokens, 1)):
            if t // dst.block_size_tokens >= len(dst_ids):
                break
            got = token_bytes(dst, da, layer, dst_ids[t // dst.block_size_tokens], t % dst.block_size_tokens)
            if layer in layers and start <= t < end:
                want = token_bytes(src, sa, layer, src_ids[t // src.block_size_tokens], t % src.block_size_tokens)
                assert got == want, f"layer {layer} token {t} differs"
            else:
                assert got == bytes(len(got)), f"layer {layer} token {t} written outside the range"


class TestPlanWrite:
    def test_scattered_whole_blocks_use_block_table_and_move_bytes(self):
        """Same block size, scattered ids, block-aligned range: block table only, bytes exact."""
        src, sa, _ = make_kv(3, 16, 16, 2, 32, "kv_first", seed=1)
        dst, da, _ = make_kv(3, 16, 16, 2, 32, "kv_first", seed=None)
        src_ids, dst_ids = [7, 2, 11, 3], [0, 9, 4, 15]
        plan = plan_write(src, dst, [0, 2], src_ids, dst_ids, 0, 64)
        assert plan.table == TABLE_BLOCK and plan.explicit.shape == (0, 3)
        assert plan.table_descriptor_count == 2 * 2 * 4  # layers x planes x blocks
        assert plan.total_bytes == 2 * 64 * src.bytes_per_token_per_layer
        _execute(plan, src, dst, _Memory(sa, da))
        _assert_tokens_moved(src, sa, dst, da, [0, 2], src_ids, dst_ids, 0, 64)

    def test_contiguous_blocks_merge_into_one_descriptor_per_plane(self):
        """Consecutive ids on both sides merge: one descriptor per (layer, plane)."""
        src, _, _ = make_kv(2, 32, 16, 2, 32, "kv_first", seed=1)
        dst, _, _ = make_kv(2, 32, 16, 2, 32, "kv_first", seed=None)
        plan = plan_write(src, dst, [0, 1], list(range(8)), list(range(10, 18)), 0, 128)
        assert plan.table_descriptor_count == 2 * 2 * 8
        assert plan.descriptor_count == 2 * 2

    def test_blocks_first_merges_k_and_v_across_consecutive_blocks(self):
        """Blocks-first layouts keep K and V of a block adjacent, so a contiguous run is one descriptor per layer."""
        src, _, _ = make_kv(1, 32, 16, 2, 32, "blocks_first", seed=1)
        dst, _, _ = make_kv(1, 32, 16, 2, 32, "blocks_first", seed=None)
        plan = plan_write(src, dst, [0], list(range(4, 12)), list(range(20, 28)), 0, 128)
        assert plan.descriptor_count == 1

    def test_partial_last_block_is_token_exact(self):
        """A range ending inside a block moves only its tokens (explicit descriptors), nothing past the end."""
        src, sa, _ = make_kv(2, 16, 16, 2, 32, "fused_kv", seed=3)
        dst, da, _ = make_kv(2, 16, 16, 2, 32, "fused_kv", seed=None)
        src_ids, dst_ids = [5, 1, 8], [2, 12, 6]
        plan = plan_write(src, dst, [0, 1], src_ids, dst_ids, 0, 37)
        assert plan.explicit.shape[0] > 0
        _execute(plan, src, dst, _Memory(sa, da))
        _assert_tokens_moved(src, sa, dst, da, [0, 1], src_ids, dst_ids, 0, 37)

    def test_unaligned_start_and_end_inside_one_block(self):
        """Tokens [5, 11) of one block move exactly, through explicit descriptors only."""
        src, sa, _ = make_kv(1, 8, 16, 2, 32, "fused_kv", seed=4)
        dst, da, _ = make_kv(1, 8, 16, 2, 32, "fused_kv", seed=None)
        plan = plan_write(src, dst, [0], [3], [6], 5, 11)
        assert plan.local_indices.size == 0
        _execute(plan, src, dst, _Memory(sa, da))
        _assert_tokens_moved(src, sa, dst, da, [0], [3], [6], 5, 11)

    @pytest.mark.parametrize("src_bs,dst_bs", [(16, 128), (128, 16), (32, 48)])
    def test_block_size_mismatch_maps_tokens(self, src_bs, dst_bs):
        """Different block sizes on the two sides use chunk tables at the gcd and land every token right."""
        tokens = 300
        src, sa, _ = make_kv(2, -(-tokens // src_bs) + 3, src_bs, 2, 32, "kv_first", seed=5)
        dst, da, _ = make_kv(2, -(-tokens // dst_bs) + 3, dst_bs, 2, 32, "kv_first", seed=None)
        rng = np.random.default_rng(0)
        src_ids = list(rng.permutation(src.block_count)[: -(-tokens // src_bs)])
        dst_ids = list(rng.permutation(dst.block_count)[: -(-tokens // dst_bs)])
        plan = plan_write(src, dst, [0, 1], src_ids, dst_ids, 0, tokens)
        assert plan.table == TABLE_CHUNK
        _execute(plan, src, dst, _Memory(sa, da))
        _assert_tokens_moved(src, sa, dst, da, [0, 1], src_ids, dst_ids, 0, tokens)

    def test_hnd_mismatch_has_one_descriptor_per_head(self):
        """HND layouts (heads outside tokens) map each head's segment separately."""
        src, sa, _ = make_kv(1, 8, 16, 4, 32, "fused_kv", seed=6)
        dst, da, _ = make_kv(1, 4, 64, 4, 32, "fused_kv", seed=None)
        assert src.planes[0].segment_count == 4
        plan = plan_write(src, dst, [0], [1, 0, 3, 2], [3], 0, 64)
        assert plan.table_descriptor_count == 4 * 4  # heads x source blocks
        _execute(plan, src, dst, _Memory(sa, da))
        _assert_tokens_moved(src, sa, dst, da, [0], [1, 0, 3, 2], [3], 0, 64)

    def test_block_atomic_layout_rounds_out_to_whole_blocks(self):
        """vLLM CPU layouts move whole blocks; partial blocks are reported as shared."""
        src, sa, _ = make_kv(2, 8, 32, 2, 32, "cpu_attn", seed=7)
        dst, da, _ = make_kv(2, 8, 32, 2, 32, "cpu_attn", seed=None)
        assert src.block_atomic
        plan = plan_write(src, dst, [1], [4, 5, 6], [1, 7, 2], 40, 70)
        assert plan.explicit.shape == (0, 3)
        assert plan.shared_blocks == frozenset({(1, 7), (1, 2)})
        _execute(plan, src, dst, _Memory(sa, da))
        assert block_bytes(dst, da, 1, 7) == block_bytes(src, sa, 1, 5)
        assert block_bytes(dst, da, 1, 2) == block_bytes(src, sa, 1, 6)
        assert block_bytes(dst, da, 1, 1) == bytes(len(block_bytes(dst, da, 1, 1)))
        assert block_bytes(dst, da, 0, 7) == bytes(len(block_bytes(dst, da, 0, 7)))

    @settings(max_examples=40, deadline=None)
    @given(
        src_bs=st.sampled_from([16, 32, 64]),
        dst_bs=st.sampled_from([16, 32, 128]),
        hint=st.sampled_from(["kv_first", "fused_kv", "blocks_first", "mla"]),
        start=st.integers(0, 150),
        length=st.integers(1, 150),
        seed=st.integers(0, 2**16),
    )
    def test_any_range_any_layout_moves_exactly_its_tokens(self, src_bs, dst_bs, hint, start, length, seed):
        """Property: for random layouts, block sizes, ids and ranges, exactly the range's tokens arrive."""
        end = start + length
        src, sa, _ = make_kv(2, -(-end // src_bs) + 2, src_bs, 2, 32, hint, seed=seed)
        dst, da, _ = make_kv(2, -(-end // dst_bs) + 2, dst_bs, 2, 32, hint, seed=None)
        rng = np.random.default_rng(seed)
        src_ids = list(rng.permutation(src.block_count)[: -(-end // src_bs)])
        dst_ids = list(rng.permutation(dst.block_count)[: -(-end // dst_bs)])
        layers = [int(rng.integers(0, 2))]
        plan = plan_write(src, dst, layers, src_ids, dst_ids, start, end)
        assert plan.total_bytes == length * len(layers) * src.bytes_per_token_per_layer
        _execute(plan, src, dst, _Memory(sa, da))
        _assert_tokens_moved(src, sa, dst, da, layers, src_ids, dst_ids, start, end)


class TestRefusals:
    @pytest.fixture
    def pair(self):
        src, _, _ = make_kv(4, 16, 16, 2, 32, "kv_first", seed=1)
        dst, _, _ = make_kv(4, 16, 16, 2, 32, "kv_first", seed=None)
        return src, dst

    @pytest.mark.parametrize(
        "kwargs,message",
        [
            ({"layers": [4]}, "layer 4 out of range"),
            ({"layers": [-1]}, "layer -1 out of range"),
            ({"layers": []}, "layers is empty"),
            ({"src_block_ids": [0, 16]}, "src_block_ids block id 16 out of range"),
            ({"dst_block_ids": [-3, 1]}, "dst_block_ids block id -3 out of range"),
            ({"src_block_ids": [1]}, "src_block_ids has 1 block ids but the token range needs 2"),
            ({"dst_block_ids": [1]}, "dst_block_ids has 1 block ids but the token range needs 2"),
            ({"dst_block_ids": [5, 5]}, "repeats a block id"),
            ({"token_start": 20, "token_end": 20}, "is empty"),
        ],
    )
    def test_bad_write_is_refused_with_a_precise_error(self, pair, kwargs, message):
        """Out-of-range layers/blocks, short lists, duplicates and empty ranges raise WriteRequestError."""
        src, dst = pair
        args = {"layers": [0], "src_block_ids": [1, 2], "dst_block_ids": [3, 4], "token_start": 0, "token_end": 20}
        args.update(kwargs)
        with pytest.raises(WriteRequestError, match=message):
            plan_write(src, dst, **args)

    def test_blocks_before_the_written_range_may_repeat(self, pair):
        """A sliding-window group's blocks behind its window are all the null block: only the written blocks
        [token_start's, token_end's] must be distinct; a repeat among those is still refused."""
        src, dst = pair
        plan = plan_write(src, dst, [0], [1, 1, 2, 3], [0, 0, 4, 5], 32, 64)
        assert plan.total_bytes == 32 * src.bytes_per_token_per_layer
        with pytest.raises(WriteRequestError, match="dst_block_ids repeats a block id"):
            plan_write(src, dst, [0], [1, 1, 2, 3], [0, 0, 4, 4], 32, 64)

    def test_incompatible_layouts_are_refused(self):
        """NHD on one side and HND on the other cannot exchange tokens."""
        src, _, _ = make_kv(1, 8, 16, 2, 32, "kv_first", seed=1)
        dst, _, _ = make_kv(1, 8, 16, 2, 32, "fused_kv", seed=None)
        with pytest.raises(WriteRequestError, match="cannot exchange KV"):
            plan_write(src, dst, [0], [0], [0], 0, 16)

    def test_block_atomic_needs_equal_block_sizes(self):
        """vLLM CPU layouts of different block sizes are refused."""
        src, _, _ = make_kv(1, 8, 32, 2, 32, "cpu_attn", seed=1)
        dst, _, _ = make_kv(1, 8, 64, 2, 32, "cpu_attn", seed=None)
        with pytest.raises(WriteRequestError, match="equal block sizes"):
            plan_write(src, dst, [0], [0, 1], [0], 0, 64)

    def test_chunk_table_needs_a_dividing_granule(self):
        """A chunk table at a granule that does not divide the block size is refused."""
        src, _, _ = make_kv(1, 8, 32, 2, 32, "kv_first", seed=1)
        with pytest.raises(LayoutError, match="does not divide"):
            chunk_table_rows(src, 12)


class TestLayerMoves:
    @settings(max_examples=40, deadline=None)
    @given(
        src_bs=st.sampled_from([16, 32, 64]),
        dst_bs=st.sampled_from([16, 32, 128]),
        hint=st.sampled_from(["kv_first", "fused_kv", "blocks_first", "mla", "cpu_attn"]),
        start=st.integers(0, 150),
        length=st.integers(1, 150),
        seed=st.integers(0, 2**16),
    )
    def test_a_plan_moved_to_another_layer_equals_planning_that_layer(self, src_bs, dst_bs, hint, start, length,
                                                                      seed):
        """Property: every field of move_to_layer(plan of layer a, b) equals plan_write for layer b."""
        if hint == "cpu_attn":
            dst_bs = src_bs  # block-atomic layouts exchange equal block sizes only
        end = start + length
        src, _, _ = make_kv(3, -(-end // src_bs) + 2, src_bs, 2, 32, hint, seed=seed)
        dst, _, _ = make_kv(3, -(-end // dst_bs) + 2, dst_bs, 2, 32, hint, seed=None)
        rng = np.random.default_rng(seed)
        src_ids = list(rng.permutation(src.block_count)[: -(-end // src_bs)])
        dst_ids = list(rng.permutation(dst.block_count)[: -(-end // dst_bs)])
        first = int(rng.integers(0, 3))
        planned = plan_write(src, dst, [first], src_ids, dst_ids, start, end)
        for layer in range(3):
            want = plan_write(src, dst, [layer], src_ids, dst_ids, start, end)
            got = move_to_layer(planned, src, dst, first, layer)
            assert (got.table, got.granule, got.total_bytes, got.descriptor_count, got.shared_blocks) == (
                want.table, want.granule, want.total_bytes, want.descriptor_count, want.shared_blocks)
            for name in ("local_indices", "remote_indices", "explicit"):
                np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
                assert getattr(got, name).dtype == getattr(want, name).dtype, name

    def test_cache_moves_known_writes_and_plans_new_ones(self):
        """Same blocks and range on another layer come from the cache; other blocks, peers or layouts re-plan."""
        src, sa, _ = make_kv(3, 8, 16, 2, 32, "kv_first", seed=3)
        dst, da, _ = make_kv(3, 8, 16, 2, 32, "kv_first", seed=None)
        cache = LayerPlanCache(capacity=2)
        first = cache.plan(src, dst, "peer", [0], [1, 2], [5, 6], 0, 20)
        moved = cache.plan(src, dst, "peer", [2], [1, 2], [5, 6], 0, 20)
        np.testing.assert_array_equal(moved.explicit, plan_write(src, dst, [2], [1, 2], [5, 6], 0, 20).explicit)
        _execute(moved, src, dst, _Memory(sa, da))
        _assert_tokens_moved(src, sa, dst, da, [2], [1, 2], [5, 6], 0, 20)
        assert cache.plan(src, dst, "peer", [0], [1, 2], [5, 6], 0, 20) is first  # the layer it was planned for
        with pytest.raises(WriteRequestError, match="layer 3 out of range"):
            cache.plan(src, dst, "peer", [3], [1, 2], [5, 6], 0, 20)
        other_dst, _, _ = make_kv(3, 8, 16, 2, 32, "kv_first", seed=None)
        assert cache.plan(src, other_dst, "peer", [0], [1, 2], [5, 6], 0, 20) is not first
        cache.plan(src, dst, "peer", [0], [3], [7], 0, 16)
        cache.plan(src, dst, "peer", [0], [4], [7], 0, 16)
        assert len(cache._plans) == 2  # bounded: the oldest went
