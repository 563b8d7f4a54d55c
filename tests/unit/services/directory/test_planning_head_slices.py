"""Planning between engines of different TP sizes: which heads of which prefill rank go to which decode rank.

Every head of every decode rank is written exactly once, from a prefill rank that holds it, with the bytes of one
head per block; pairs vLLM cannot split, or whose layouts interleave heads (NHD), are refused naming both engines
and the field.
"""

from __future__ import annotations

import pytest

from kvpush.directory.errors import FailedPrecondition
from kvpush.directory.planning import head_routes, rank_heads
from kvpush.directory.state import DirectoryState, Limits
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import DECODE, PREFILL, ManualClock, allocation, make_layout, ready, register_request

BS, HEAD_TOKEN_BYTES = 16, 64  # one KV head of one token: K and V of head size 16 in bfloat16


def cpu_layout(heads: int, model_heads: int, block_count: int = 64) -> tpb.KVLayout:
    """A vLLM CPU attention layout (block-atomic, one fused plane) of a worker holding `heads` KV heads."""
    token = heads * HEAD_TOKEN_BYTES
    block = BS * token
    return tpb.KVLayout(
        layer_count=4, block_size_tokens=BS, block_count=block_count, block_bytes_per_layer=block,
        dtype="bfloat16", memory_kind=tpb.MEMORY_KIND_DRAM, block_atomic=True,
        planes=[tpb.KVPlane(block_stride_bytes=block, block_bytes=block, segment_count=1, token_stride_bytes=token,
                            segment_bytes_per_token=token)],
        layer_base_addresses=[0x100000 * (i + 1) for i in range(4)], layer_region_bytes=block * block_count,
        kv_head_count=heads, model_kv_head_count=model_heads)


def hnd_layout(heads: int, model_heads: int) -> tpb.KVLayout:
    """A GPU HND layout (one segment per head) of a worker holding `heads` KV heads."""
    seg = BS * HEAD_TOKEN_BYTES
    block = heads * seg
    return tpb.KVLayout(
        layer_count=4, block_size_tokens=BS, block_count=64, block_bytes_per_layer=block, dtype="bfloat16",
        memory_kind=tpb.MEMORY_KIND_VRAM,
        planes=[tpb.KVPlane(block_stride_bytes=block, block_bytes=block, segment_count=heads,
                            segment_stride_bytes=seg if heads > 1 else 0, token_stride_bytes=HEAD_TOKEN_BYTES,
                            segment_bytes_per_token=HEAD_TOKEN_BYTES)],
        layer_base_addresses=[0x100000 * (i + 1) for i in range(4)], layer_region_bytes=block * 64,
        kv_head_count=heads, model_kv_head_count=model_heads)


def _engine(engine_id: str, role: int, tp: int, model_heads: int, make=cpu_layout) -> list[dpb.RegisterEngineRequest]:
    heads = max(1, model_heads // tp)
    return [register_request(engine_id, role, rank, tp, layout=make(heads, model_heads)) for rank in range(tp)]


def _state(prefill_tp: int, decode_tp: int, model_heads: int, make=cpu_layout) -> DirectoryState:
    state = DirectoryState(Limits(), ManualClock().clock())
    for request in _engine("p0", PREFILL, prefill_tp, model_heads, make) + _engine("d0", DECODE, decode_tp,
                                                                                     model_heads, make):
        state.register(request)
    return state


def _instructions(state: DirectoryState, prefill_tp: int, prompt: int = 40) -> dict[int, dpb.PushInstruction]:
    record, _ = state.plan(dpb.PlanTransferRequest(), None)
    tid = record.transfer_id
    for rank in range(prefill_tp):
        state.open_session("p0", rank, state.engines.worker("p0", rank).lease_id)
    state.report_allocation(allocation(tid, "d0", block_ids=(5, 6, 7), prompt=prompt))
    state.report_ready("p0", 0, [ready(tid, 0, 4, prompt=prompt)])
    out = {}
    for rank in range(prefill_tp):
        messages = state.drain_outbox("p0", rank, state.engines.worker("p0", rank).session_id)
        (instruction,) = [m.instruction for m in messages if m.WhichOneof("message") == "instruction"]
        out[rank] = instruction
    assert state.check_invariants() == []
    return out


def _writes(instruction: dpb.PushInstruction) -> list[tuple[int, int, int, int, bytes]]:
    """(decode rank, source head start, destination head start, count, notification) of every destination."""
    if instruction.skip_token_count == instruction.prompt_token_count:
        return []
    first = (instruction.decode_tp_rank, instruction.head_slice.source_head_start,
             instruction.head_slice.destination_head_start, instruction.head_slice.head_count,
             instruction.notification)
    return [first] + [(d.decode_tp_rank, d.head_slice.source_head_start, d.head_slice.destination_head_start,
                       d.head_slice.head_count, d.notification) for d in instruction.more_destinations]


CASES = [(1, 2, 2), (2, 1, 2), (2, 4, 4), (4, 2, 4), (1, 4, 4), (2, 4, 2), (4, 2, 2), (4, 1, 2), (1, 4, 1),
         (2, 8, 8), (8, 2, 16)]


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "model_heads"), CASES)
def test_every_destination_head_is_written_exactly_once_from_a_rank_that_holds_it(prefill_tp, decode_tp,
                                                                                  model_heads):
    state = _state(prefill_tp, decode_tp, model_heads)
    instructions = _instructions(state, prefill_tp)
    written: dict[tuple[int, int], int] = {}
    notes: dict[int, list[bytes]] = {}
    for rank, instruction in instructions.items():
        held = rank_heads(model_heads, prefill_tp, rank)
        for decode_rank, src, dst, count, note in _writes(instruction):
            wanted = rank_heads(model_heads, decode_tp, decode_rank)
            assert count > 0 and src + count <= len(held) and dst + count <= len(wanted)
            for k in range(count):
                assert held[src + k] == wanted[dst + k]  # the same model head on both sides
                key = (decode_rank, dst + k)
                written[key] = written.get(key, 0) + 1
            notes.setdefault(decode_rank, []).append(note)
    expected = {(r, h) for r in range(decode_tp) for h in range(len(rank_heads(model_heads, decode_tp, r)))}
    assert written == dict.fromkeys(expected, 1)
    tid = instructions[0].transfer_id
    for decode_rank, got in notes.items():
        n = len(got)
        want = [tid.encode()] if n == 1 else [f"{tid}\n{i}/{n}".encode() for i in range(n)]
        assert sorted(got) == sorted(want), decode_rank
    # Bytes per slice: a head's share of one block, the same on both sides.
    p_layout = state.engines.worker("p0", 0).layout
    d_layout = state.engines.worker("d0", 0).layout
    assert p_layout.block_bytes_per_layer // p_layout.kv_head_count == \
        d_layout.block_bytes_per_layer // d_layout.kv_head_count == BS * HEAD_TOKEN_BYTES


def test_one_to_two_splits_both_heads_and_two_to_one_merges_them():
    one_to_two = _instructions(_state(1, 2, 2), 1)
    assert _writes(one_to_two[0])[0][:4] == (0, 0, 0, 1) and _writes(one_to_two[0])[1][:4] == (1, 1, 0, 1)
    two_to_one = _instructions(_state(2, 1, 2), 2)
    assert [w[:4] for w in _writes(two_to_one[0])] == [(0, 0, 0, 1)]
    assert [w[:4] for w in _writes(two_to_one[1])] == [(0, 0, 1, 1)]


def test_a_prefill_rank_whose_head_another_rank_writes_is_told_there_is_nothing_to_write_and_completes():
    state = _state(4, 2, 2)  # prefill ranks 0,1 hold head 0; 2,3 head 1
    instructions = _instructions(state, 4)
    idle = [rank for rank, i in instructions.items() if not _writes(i)]
    assert len(idle) == 2 and all(instructions[r].notification == b"" for r in idle)
    tid = instructions[0].transfer_id
    for rank in range(4):
        state.report_result("p0", rank, dpb.WriteResult(transfer_id=tid, status=dpb.WRITE_RESULT_STATUS_DONE))
    assert state.get_transfer(tid).state == tpb.TRANSFER_STATE_COMPLETE


def test_equal_tp_instructions_carry_no_head_slice():
    state = DirectoryState(Limits(), ManualClock().clock())
    for request in _engine("p0", PREFILL, 2, 2) + _engine("d0", DECODE, 2, 2):
        state.register(request)
    for instruction in _instructions(state, 2).values():
        assert not instruction.HasField("head_slice") and not instruction.more_destinations


def test_peer_announcements_name_every_decode_worker_a_prefill_rank_writes():
    state = _state(1, 2, 2)
    messages = state.drain_outbox("p0", 0, state.open_session("p0", 0, state.engines.worker("p0", 0).lease_id)[0])
    assert sorted(m.peer.decode_tp_rank for m in messages if m.WhichOneof("message") == "peer") == [0, 1]
    state = _state(2, 1, 2)
    for rank in (0, 1):
        sid, _ = state.open_session("p0", rank, state.engines.worker("p0", rank).lease_id)
        assert [m.peer.decode_tp_rank for m in state.drain_outbox("p0", rank, sid)] == [0]


def _refusal(prefill, decode) -> str:
    state = DirectoryState(Limits(), ManualClock().clock())
    for request in (*prefill, *decode):
        state.register(request)
    with pytest.raises(FailedPrecondition) as refused:
        state.plan(dpb.PlanTransferRequest(), None)
    return str(refused.value)


def test_heads_that_do_not_split_over_a_tp_size_are_refused_naming_both_engines():
    prefill = [register_request("p0", PREFILL, r, 2, layout=cpu_layout(3, 6)) for r in range(2)]
    decode = [register_request("d0", DECODE, r, 4, layout=cpu_layout(1, 6)) for r in range(4)]
    message = _refusal(prefill, decode)
    assert ("tp_size 2 of prefill 'p0' and 4 of decode 'd0': tp_size 4 of decode 'd0' cannot hold the model's KV "
            "heads: 6 KV heads do not split over 4 ranks") in message


def test_engines_without_head_counts_keep_the_equal_tp_rule():
    prefill = [register_request("p0", PREFILL)]
    decode = [register_request("d0", DECODE, r, 2) for r in range(2)]
    message = _refusal(prefill, decode)
    assert "tp_size 1 of prefill 'p0' and 2 of decode 'd0' differ and prefill 'p0' registered no " \
           "layout.kv_head_count" in message


def test_nhd_layouts_are_refused_naming_the_segment_count():
    def nhd(heads: int, model_heads: int) -> tpb.KVLayout:
        layout = make_layout()
        layout.planes[0].segment_bytes_per_token = layout.planes[0].token_stride_bytes = 64 * heads
        layout.planes[0].block_bytes = layout.planes[0].block_stride_bytes = BS * 64 * heads
        layout.block_bytes_per_layer = BS * 64 * heads
        layout.layer_region_bytes = BS * 64 * heads * layout.block_count
        layout.kv_head_count, layout.model_kv_head_count = heads, model_heads
        return layout
    message = _refusal(_engine("p0", PREFILL, 1, 2, nhd), _engine("d0", DECODE, 2, 2, nhd))
    assert "planes[0].segment_count 1 of prefill 'p0' holds 2 KV heads in every token's segment (NHD)" in message


def test_a_different_head_size_is_refused_per_head():
    prefill = _engine("p0", PREFILL, 1, 2)
    decode = [register_request("d0", DECODE, r, 2, layout=hnd_layout(1, 2)) for r in range(2)]
    message = _refusal(prefill, decode)
    assert "'p0'" in message and "'d0'" in message and "block_atomic" in message


def test_hnd_layouts_pair_across_tp_sizes():
    state = _state(2, 4, 4, hnd_layout)
    instructions = _instructions(state, 2)
    assert [w[:4] for w in _writes(instructions[0])] == [(0, 0, 0, 1), (1, 1, 0, 1)]
    assert [w[:4] for w in _writes(instructions[1])] == [(2, 0, 0, 1), (3, 1, 0, 1)]


def test_head_routes_spread_a_replicated_head_over_its_holders():
    routes = head_routes(1, 2, 2)  # one KV head on every rank of both engines
    assert [(r.prefill_rank, r.decode_rank) for r in routes] == [(0, 0), (1, 1)]


def test_different_tp_sizes_with_different_block_sizes_are_refused_naming_the_block_size():
    """Head slices and block-size mapping each pair engines; the two together are refused until built."""
    def hnd_bs(block_size: int):
        def make(heads: int, model_heads: int) -> tpb.KVLayout:
            layout = hnd_layout(heads, model_heads)
            layout.block_size_tokens = block_size
            return layout
        return make
    message = _refusal(_engine("p0", PREFILL, 1, 2, hnd_bs(16)), _engine("d0", DECODE, 2, 2, hnd_bs(32)))
    assert "block_size_tokens 16 of prefill 'p0' differs from 32 of decode 'd0'" in message
    assert "different TP sizes need one block size" in message
