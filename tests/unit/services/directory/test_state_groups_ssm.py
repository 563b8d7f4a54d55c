"""The directory with hybrid SSM engines (a STATE KV-cache group beside attention): the layout's state group is
validated, a state group's allocation owns only the block holding the state after the prompt, and engines whose
state groups, TP or block sizes differ are not paired (refusals name both engines and the field)."""

from __future__ import annotations

import pytest

from kvpush.directory.errors import FailedPrecondition, InvalidArgument
from kvpush.directory.state import DirectoryState, Limits
from kvpush.directory.validation import check_allocation, check_layout
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import DECODE, PREFILL, ManualClock, make_layout, ready, register_request

BS = 16
PROMPT = 100  # 7 attention blocks of 16; one state block of 4096 tokens
STATE_BS = 4096


def _hybrid_layout(ranges=((0, 256), (256, 1024)), state_bs: int = STATE_BS) -> tpb.KVLayout:
    """Layers 0 and 2 Mamba (group 0, as vLLM orders them), 1 and 3 attention (group 1)."""
    layout = make_layout(layer_count=4, block_count=64, block_size_tokens=BS)
    stride = layout.planes[0].block_stride_bytes
    state = layout.kv_cache_groups.add(group_index=0, layers=[0, 2], kind=tpb.KV_CACHE_GROUP_KIND_STATE,
                                       block_size_tokens=state_bs, state_block_stride_bytes=stride)
    state.state_ranges.extend(tpb.ByteRange(offset_bytes=o, length_bytes=n) for o, n in ranges)
    layout.kv_cache_groups.add(group_index=1, layers=[1, 3])
    return layout


def _state(**layouts: tpb.KVLayout) -> DirectoryState:
    state = DirectoryState(Limits(lease_ttl_s=10, transfer_ttl_s=60), ManualClock().clock())
    for engine, role in (("p1", PREFILL), ("d1", DECODE)):
        state.register(register_request(engine, role, layout=layouts.get(engine) or _hybrid_layout()))
    return state


def _report(transfer_id: str, state_blocks: list[int], attention: list[int], prefix: int = 0,
            prompt: int = PROMPT) -> dpb.ReportAllocationRequest:
    return dpb.ReportAllocationRequest(
        transfer_id=transfer_id, engine_id="d1", block_ids=state_blocks, prompt_token_count=prompt,
        prefix_hit_token_count=prefix,
        block_groups=[tpb.BlockGroup(group_index=0, block_ids=state_blocks),
                      tpb.BlockGroup(group_index=1, block_ids=attention)])


ATTENTION = [20, 21, 22, 23, 24, 25, 26]


def test_a_state_group_allocation_owns_its_state_block_and_reaches_prefill_whole():
    state = _state()
    session = state.open_session("p1", 0, state.engines.groups["p1"].workers[0].lease_id)[0]
    state.drain_outbox("p1", 0, session)
    tid = state.plan(dpb.PlanTransferRequest(), None)[0].transfer_id
    check_allocation(_report(tid, [40], ATTENTION), Limits())
    record, _ = state.report_allocation(_report(tid, [40], ATTENTION))
    assert record.owned_blocks == (40, *ATTENTION)
    state.report_ready("p1", 0, [ready(tid, 0, 4, prompt=PROMPT)])
    (message,) = state.drain_outbox("p1", 0, session)
    assert [(g.group_index, list(g.block_ids)) for g in message.instruction.decode_block_groups] \
        == [(0, [40]), (1, ATTENTION)]


def test_a_decode_hit_of_the_whole_prompt_owns_no_state_block():
    state = _state()
    tid = state.plan(dpb.PlanTransferRequest(), None)[0].transfer_id
    record, _ = state.report_allocation(_report(tid, [40], ATTENTION[:6], prefix=6 * BS, prompt=6 * BS))
    assert record.owned_blocks == ()


@pytest.mark.parametrize("blocks,first_token,message", [
    ([], 0, "empty"),
    ([40], BS, "a state group starts at 0"),
    ([99], 0, "out of range"),
])
def test_a_state_allocation_that_does_not_fit_is_refused(blocks, first_token, message):
    state = _state()
    tid = state.plan(dpb.PlanTransferRequest(), None)[0].transfer_id
    report = _report(tid, blocks or [1], ATTENTION)
    if not blocks:
        del report.block_groups[0].block_ids[:]
    report.block_groups[0].first_token = first_token
    with pytest.raises(InvalidArgument, match=message):
        check_allocation(report, Limits())
        state.report_allocation(report)


def test_the_state_block_of_a_long_prompt_in_small_state_blocks_must_be_there():
    """State blocks of 16 tokens (vLLM's 'align' mode keeps one per block): 100 tokens need block 6."""
    state = _state(p1=_hybrid_layout(state_bs=BS), d1=_hybrid_layout(state_bs=BS))
    tid = state.plan(dpb.PlanTransferRequest(), None)[0].transfer_id
    with pytest.raises(InvalidArgument, match="the state after 100 tokens is in block 6"):
        state.report_allocation(_report(tid, [40, 41], ATTENTION))
    record, _ = state.report_allocation(_report(tid, [0, 0, 0, 0, 0, 0, 46], ATTENTION))
    assert record.owned_blocks == (46, *ATTENTION)


@pytest.mark.parametrize("change,message", [
    (lambda g: g.ClearField("state_ranges"), "must be set"),
    (lambda g: setattr(g, "state_block_stride_bytes", 0), "must be set"),
    (lambda g: setattr(g, "sliding_window_tokens", 64), "with a sliding window"),
    (lambda g: g.state_ranges.add(offset_bytes=100, length_bytes=8), "overlaps the range before it"),
    (lambda g: g.state_ranges.add(offset_bytes=1 << 40, length_bytes=8), "past state_block_stride_bytes"),
])
def test_malformed_state_groups_are_refused_at_registration(change, message):
    layout = _hybrid_layout()
    change(layout.kv_cache_groups[0])
    with pytest.raises(InvalidArgument, match=message):
        check_layout(layout)


def test_an_attention_group_with_state_fields_is_refused():
    layout = _hybrid_layout()
    layout.kv_cache_groups[1].state_block_stride_bytes = 64
    with pytest.raises(InvalidArgument, match="attention group with state_ranges"):
        check_layout(layout)


def test_engines_whose_state_layouts_differ_are_not_paired():
    """Decode's SSM state is laid out otherwise (another ssm dtype, say): FAILED_PRECONDITION naming both engines,
    kv_cache_groups and both values."""
    state = _state(d1=_hybrid_layout(ranges=((0, 256), (256, 512))))
    with pytest.raises(FailedPrecondition) as refused:
        state.plan(dpb.PlanTransferRequest(), None)
    text = str(refused.value)
    assert "kv_cache_groups [([0, 2], 'state', 4096, " in text and "of prefill 'p1' differs from" in text
    assert "(256, 1024)" in text and "(256, 512)" in text and "of decode 'd1'" in text


def test_state_groups_with_different_tp_sizes_are_refused_naming_the_groups():
    state = DirectoryState(Limits(lease_ttl_s=10, transfer_ttl_s=60), ManualClock().clock())
    prefill = _hybrid_layout()
    prefill.kv_head_count, prefill.model_kv_head_count = 1, 1
    state.register(register_request("p1", PREFILL, 0, 1, layout=prefill))
    for rank in range(2):
        decode = _hybrid_layout()
        decode.kv_head_count, decode.model_kv_head_count = 1, 1
        state.register(register_request("d1", DECODE, rank, 2, layout=decode))
    with pytest.raises(FailedPrecondition) as refused:
        state.plan(dpb.PlanTransferRequest(), None)
    assert "kv_cache_groups" in str(refused.value) and "'state'" in str(refused.value)
    assert "different TP sizes need attention-only KV-cache groups" in str(refused.value)
