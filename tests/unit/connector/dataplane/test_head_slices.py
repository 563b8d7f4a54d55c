"""Head-sliced writes (prefill and decode of different TP sizes): layouts cut by KV head, exact bytes moved.

A prefill worker of TP 1 holds both KV heads of the test model; each decode worker of TP 2 holds one. A write
with a `HeadSlice` must move exactly the source heads' bytes of every written block into the destination
heads, and touch nothing else (other heads, other blocks).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvpush.api.outcome import PushOutcome
from kvpush.dataplane.layout import HeadSlice, LayoutError, head_sliceable, slice_heads
from kvpush.dataplane.plan import WriteRequestError
from kvpush.dataplane.writer import PushWriter, WriteRequest
from tests.integration.dataplane.kvbuffers import make_kv
from tests.unit.connector.inmemory_helpers import new_fabric, started_agent

LAYERS, BLOCKS, BS, HEAD = 3, 12, 16, 8
BOUND_S = 5.0


def test_cpu_attn_slice_is_a_contiguous_head_run_of_each_block():
    layout, _, _ = make_kv(LAYERS, BLOCKS, BS, 4, HEAD, "cpu_attn")
    head_bytes = BS * 2 * HEAD * 2
    cut = slice_heads(layout, 1, 2)
    plane, full = cut.planes[0], layout.planes[0]
    assert (plane.offset_bytes, plane.block_bytes, plane.block_stride_bytes) == (head_bytes, 2 * head_bytes,
                                                                                 full.block_stride_bytes)
    assert cut.block_bytes_per_layer == 2 * head_bytes and cut.kv_head_count == 2
    assert slice_heads(layout, 0, 4) is layout


def test_hnd_slice_keeps_one_segment_per_head():
    layout, _, _ = make_kv(LAYERS, BLOCKS, BS, 4, HEAD, "fused_kv")
    assert layout.planes[0].segment_count == 4
    cut = slice_heads(layout, 2, 2)
    seg = layout.planes[0].segment_stride_bytes
    assert cut.planes[0].segment_count == 2 and cut.planes[0].offset_bytes == 2 * seg
    assert cut.planes[0].block_bytes == 2 * seg


def test_nhd_and_out_of_range_slices_are_refused_with_the_field():
    nhd, _, _ = make_kv(LAYERS, BLOCKS, BS, 2, HEAD, "kv_first")
    assert "planes[0].segment_count 1" in head_sliceable(nhd)
    with pytest.raises(LayoutError, match="NHD"):
        slice_heads(nhd, 0, 1)
    layout, _, _ = make_kv(LAYERS, BLOCKS, BS, 2, HEAD, "cpu_attn")
    with pytest.raises(LayoutError, match=r"heads \[1, 3\) are not inside the worker's 2 KV heads"):
        slice_heads(layout, 1, 2)


class _Done:
    def __init__(self) -> None:
        self.transfers: list = []
        self.cv = threading.Condition()

    def on_transfer(self, outcome) -> None:
        with self.cv:
            self.transfers.append(outcome)
            self.cv.notify_all()

    def wait(self, count: int) -> bool:
        with self.cv:
            return self.cv.wait_for(lambda: len(self.transfers) >= count, BOUND_S)


def _push_all_layers(writer: PushWriter, transfer_id: str, peer: str, cut: HeadSlice, src, dst, tokens: int):
    for layer in range(LAYERS):
        writer.submit(WriteRequest(transfer_id, peer, (layer,), src, dst, 0, tokens,
                                   notify=transfer_id.encode() if layer == LAYERS - 1 else None, head_slice=cut))


@pytest.mark.parametrize("hint", ["cpu_attn", "fused_kv"])
def test_one_prefill_worker_splits_its_heads_over_two_decode_workers(hint):
    """TP 1 -> TP 2: head 0 to decode rank 0, head 1 to decode rank 1; exact bytes, nothing else touched."""
    name, _fab = new_fabric()
    _pl, p_arrays, p_caches = make_kv(LAYERS, BLOCKS, BS, 2, HEAD, hint, seed=1)
    decodes = [make_kv(LAYERS, BLOCKS, BS, 1, HEAD, hint, seed=None) for _ in range(2)]
    prefill = started_agent(name, p_caches, BS, 2, HEAD, hint)
    agents = [started_agent(name, caches, BS, 1, HEAD, hint) for _l, _a, caches in decodes]
    done = _Done()
    writer = PushWriter(prefill, on_transfer_done=done.on_transfer)
    try:
        for agent in agents:
            prefill.add_peer(agent.agent_name, agent.agent_metadata(), agent.layout).result(BOUND_S)
        src, dst, tokens = (3, 5, 9), (7, 2, 4), 2 * BS + 5  # a partial last block
        for rank, agent in enumerate(agents):
            _push_all_layers(writer, f"t{rank}", agent.agent_name, HeadSlice(rank, 0, 1), src, dst, tokens)
        assert done.wait(2)
        assert {o.outcome for o in done.transfers} == {PushOutcome.DONE}
        head_block = BS * 2 * HEAD * 2  # one head of one block (uint16 elements)
        # Block-atomic CPU tiles move whole blocks; a GPU HND layout moves exactly the tokens.
        per_layer = 3 * head_block if hint == "cpu_attn" else tokens * 2 * HEAD * 2
        assert [o.bytes for o in sorted(done.transfers, key=lambda o: o.transfer_id)] == [LAYERS * per_layer] * 2
        for rank, (_l, d_arrays, _c) in enumerate(decodes):
            for layer in range(LAYERS):
                got, want = d_arrays[layer], p_arrays[layer]
                for s, d in zip(src[:2], dst[:2], strict=True):
                    assert np.array_equal(got[d, 0], want[s, rank])
                untouched = [b for b in range(BLOCKS) if b not in dst]
                assert not got[untouched].any()
                if hint == "fused_kv":  # token-exact: tokens past the prompt stay untouched
                    assert np.array_equal(got[4, 0, :5], want[9, rank, :5]) and not got[4, 0, 5:].any()
    finally:
        for agent in (prefill, *agents):
            agent.stop()


def test_two_prefill_workers_fill_the_two_heads_of_one_decode_worker():
    """TP 2 -> TP 1: each prefill rank writes its one head into its position of the decode worker's two."""
    name, _fab = new_fabric()
    prefills = [make_kv(LAYERS, BLOCKS, BS, 1, HEAD, "cpu_attn", seed=rank + 1) for rank in range(2)]
    _dl, d_arrays, d_caches = make_kv(LAYERS, BLOCKS, BS, 2, HEAD, "cpu_attn", seed=None)
    decode = started_agent(name, d_caches, BS, 2, HEAD)
    agents = [started_agent(name, caches, BS, 1, HEAD) for _l, _a, caches in prefills]
    notes: list[bytes] = []
    decode.add_notification_callback(lambda _agent, message: notes.append(message))
    dones = [_Done() for _ in agents]
    writers = [PushWriter(agent, on_transfer_done=d.on_transfer) for agent, d in zip(agents, dones, strict=True)]
    try:
        src, dst, tokens = (1, 2), (6, 0), 2 * BS
        for rank, (agent, writer) in enumerate(zip(agents, writers, strict=True)):
            agent.add_peer(decode.agent_name, decode.agent_metadata(), decode.layout).result(BOUND_S)
            _push_all_layers(writer, f"t\n{rank}/2", decode.agent_name, HeadSlice(0, rank, 1), src, dst, tokens)
        assert all(d.wait(1) for d in dones)
        assert [d.transfers[0].bytes for d in dones] == [LAYERS * 2 * BS * 2 * HEAD * 2] * 2
        for layer in range(LAYERS):
            for s, d in zip(src, dst, strict=True):
                for rank in range(2):
                    assert np.array_equal(d_arrays[layer][d, rank], prefills[rank][1][layer][s, 0])
            assert not d_arrays[layer][[b for b in range(BLOCKS) if b not in dst]].any()
    finally:
        for agent in (decode, *agents):
            agent.stop()


def test_a_head_slice_outside_the_workers_heads_is_refused_before_anything_is_queued():
    name, _fab = new_fabric()
    _pl, _pa, p_caches = make_kv(LAYERS, BLOCKS, BS, 2, HEAD, "cpu_attn", seed=1)
    _dl, d_arrays, d_caches = make_kv(LAYERS, BLOCKS, BS, 1, HEAD, "cpu_attn", seed=None)
    prefill = started_agent(name, p_caches, BS, 2, HEAD)
    decode = started_agent(name, d_caches, BS, 1, HEAD)
    try:
        prefill.add_peer(decode.agent_name, decode.agent_metadata(), decode.layout).result(BOUND_S)
        writer = PushWriter(prefill)
        with pytest.raises(WriteRequestError, match=r"heads \[1, 3\) are not inside the worker's 2 KV heads"):
            writer.submit(WriteRequest("t", decode.agent_name, (0,), (1,), (1,), 0, BS, head_slice=HeadSlice(1, 0, 2)))
        assert not any(a.any() for a in d_arrays)
    finally:
        prefill.stop()
        decode.stop()
