"""The directory with engines of several KV-cache groups (hybrid KV-cache manager): per-group allocations are
checked against decode's layout, forwarded whole in the push instruction, and own only the blocks that are written."""

from __future__ import annotations

import re

import pytest

from kvpush.directory.errors import FailedPrecondition, InvalidArgument
from kvpush.directory.records import StoredTransfer
from kvpush.directory.state import DirectoryState, Limits
from kvpush.directory.validation import check_allocation, check_layer_ready, check_layout
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import DECODE, PREFILL, ManualClock, make_layout, ready, register_request

BS = 16
PROMPT = 100  # 7 blocks of 16


def _grouped_layout() -> tpb.KVLayout:
    layout = make_layout(layer_count=4, block_count=64, block_size_tokens=BS)
    layout.kv_cache_groups.add(group_index=0, layers=[0, 2], sliding_window_tokens=32)
    layout.kv_cache_groups.add(group_index=1, layers=[1, 3])
    return layout


class Directory:
    def __init__(self) -> None:
        self.state = DirectoryState(Limits(lease_ttl_s=10, transfer_ttl_s=60), ManualClock().clock())
        leases = {}
        for engine, role in (("p1", PREFILL), ("d1", DECODE)):
            worker, _ = self.state.register(register_request(engine, role, layout=_grouped_layout()))
            leases[engine] = worker.lease_id
        self.session = self.state.open_session("p1", 0, leases["p1"])[0]
        self.state.drain_outbox("p1", 0, self.session)

    def plan(self) -> str:
        return self.state.plan(dpb.PlanTransferRequest(), None)[0].transfer_id


def _report(transfer_id: str, sliding: list[int], full: list[int], sliding_first: int,
            prefix: int = 0) -> dpb.ReportAllocationRequest:
    return dpb.ReportAllocationRequest(
        transfer_id=transfer_id, engine_id="d1", block_ids=sliding, prompt_token_count=PROMPT,
        prefix_hit_token_count=prefix,
        block_groups=[tpb.BlockGroup(group_index=0, block_ids=sliding, first_token=sliding_first),
                      tpb.BlockGroup(group_index=1, block_ids=full)])


SLIDING = [0, 0, 0, 0, 0, 10, 11]  # null blocks behind the window, blocks 5 and 6 kept
FULL = [20, 21, 22, 23, 24, 25, 26]


def test_the_instruction_carries_every_groups_blocks_and_the_transfer_shows_them():
    d = Directory()
    tid = d.plan()
    check_allocation(_report(tid, SLIDING, FULL, 5 * BS), Limits())
    record, _ = d.state.report_allocation(_report(tid, SLIDING, FULL, 5 * BS))
    assert record.owned_blocks == (10, 11, *FULL)  # the null block is never owned: nothing lands there
    d.state.report_ready("p1", 0, [ready(tid, 0, 4, prompt=PROMPT)])
    (message,) = d.state.drain_outbox("p1", 0, d.session)
    instruction = message.instruction
    assert list(instruction.decode_block_ids) == SLIDING
    assert [(g.group_index, list(g.block_ids), g.first_token) for g in instruction.decode_block_groups] \
        == [(0, SLIDING, 80), (1, FULL, 0)]
    shown = d.state.get_transfer(tid).to_proto()
    assert [list(g.block_ids) for g in shown.decode_block_groups] == [SLIDING, FULL]


def test_the_groups_survive_the_stored_record():
    d = Directory()
    tid = d.plan()
    record, _ = d.state.report_allocation(_report(tid, SLIDING, FULL, 5 * BS))
    stored = StoredTransfer.from_json(StoredTransfer.of(record).to_json())
    assert stored.allocation is not None and stored.allocation == record.allocation
    assert stored.allocation.groups == ((tuple(SLIDING), 80), (tuple(FULL), 0))
    assert stored.owned_blocks == (10, 11, *FULL)


@pytest.mark.parametrize("report, message", [
    (lambda tid: _report(tid, SLIDING, FULL[:6], 5 * BS), "block_groups[1] has 6 block ids"),
    (lambda tid: _report(tid, SLIDING, FULL, 5 * BS + 3), "first_token 83 is not a multiple of 16"),
    (lambda tid: _report(tid, SLIDING, [20, 21, 22, 23, 24, 25, 10], 5 * BS), "written twice"),
    (lambda tid: dpb.ReportAllocationRequest(transfer_id=tid, engine_id="d1", block_ids=FULL,
                                             prompt_token_count=PROMPT), "declares 2 KV-cache groups"),
    (lambda tid: _report(tid, [0, 0, 0, 0, 0, 10, 99], FULL, 5 * BS), "out of range"),
])
def test_an_allocation_that_does_not_fit_decodes_groups_is_refused_and_changes_nothing(report, message):
    d = Directory()
    tid = d.plan()
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        d.state.report_allocation(report(tid))
    assert d.state.get_transfer(tid).state == tpb.TRANSFER_STATE_PLANNED
    # The same transfer then takes a valid report (the refused one left nothing behind).
    record, _ = d.state.report_allocation(_report(tid, SLIDING, FULL, 5 * BS))
    assert record.allocation is not None


def test_blocks_owned_by_one_group_clash_with_another_transfer():
    d = Directory()
    first, second = d.plan(), d.plan()
    d.state.report_allocation(_report(first, SLIDING, FULL, 5 * BS))
    with pytest.raises(FailedPrecondition, match="block 10 is already allocated"):
        d.state.report_allocation(_report(second, [0, 0, 0, 0, 0, 10, 12], [30 + i for i in range(7)], 5 * BS))


def test_request_and_layout_checks():
    with pytest.raises(InvalidArgument, match="group_index 1; groups must come in group order"):
        check_allocation(dpb.ReportAllocationRequest(
            transfer_id="t", engine_id="d1", block_ids=[1], prompt_token_count=1,
            block_groups=[tpb.BlockGroup(group_index=1, block_ids=[1])]), Limits())
    bad_ready = ready("t", 0, 1, prompt=PROMPT)
    bad_ready.source_block_groups.add(group_index=0, block_ids=[3, -1])
    with pytest.raises(InvalidArgument, match="source_block_groups contain a negative id"):
        check_layer_ready(bad_ready, Limits())
    layout = _grouped_layout()
    check_layout(layout)
    layout.kv_cache_groups[1].layers[:] = [1]  # layer 3 in no group
    with pytest.raises(InvalidArgument, match="every layer in \\[0, 4\\) exactly once"):
        check_layout(layout)


def test_engines_whose_groups_differ_are_not_paired():
    """Prefill with the hybrid manager (two groups), decode without (one): FAILED_PRECONDITION naming the field and
    both values."""
    state = DirectoryState(Limits(lease_ttl_s=10, transfer_ttl_s=60), ManualClock().clock())
    state.register(register_request("p1", PREFILL, layout=_grouped_layout()))
    state.register(register_request("d1", DECODE, layout=make_layout(layer_count=4, block_count=64,
                                                                       block_size_tokens=BS)))
    with pytest.raises(FailedPrecondition) as refused:
        state.plan(dpb.PlanTransferRequest(), None)
    assert ("kv_cache_groups [([0, 2], 32), ([1, 3], 0)] of prefill 'p1' differs from (one group) of decode 'd1'"
            in str(refused.value))


def test_several_groups_with_different_block_sizes_are_refused_even_with_the_switch():
    """Per-group blocks and block-size mapping each pair engines; together they are refused, naming the block size."""
    state = DirectoryState(Limits(lease_ttl_s=10, transfer_ttl_s=60, pair_block_sizes=True), ManualClock().clock())
    decode_layout = _grouped_layout()
    decode_layout.block_size_tokens = 2 * BS
    decode_layout.block_bytes_per_layer *= 2
    decode_layout.layer_region_bytes *= 2
    for plane in decode_layout.planes:
        plane.block_bytes *= 2
        plane.block_stride_bytes *= 2
    state.register(register_request("p1", PREFILL, layout=_grouped_layout()))
    state.register(register_request("d1", DECODE, layout=decode_layout))
    with pytest.raises(FailedPrecondition) as refused:
        state.plan(dpb.PlanTransferRequest(), None)
    assert "block_size_tokens 16 of prefill 'p1' differs from 32 of decode 'd1'" in str(refused.value)
    assert "several KV-cache groups" in str(refused.value)


def _prefill_tp1_decode_tp2(decode_window_extra: int = 0) -> DirectoryState:
    """A TP 1 prefill and a TP 2 decode engine of one KV head (replicated on decode), both with two groups."""
    state = DirectoryState(Limits(lease_ttl_s=10, transfer_ttl_s=60), ManualClock().clock())
    prefill = _grouped_layout()
    prefill.kv_head_count, prefill.model_kv_head_count = 1, 1
    state.register(register_request("p1", PREFILL, 0, 1, layout=prefill))
    for rank in range(2):
        decode = _grouped_layout()
        decode.kv_head_count, decode.model_kv_head_count = 1, 1
        decode.kv_cache_groups[0].sliding_window_tokens += decode_window_extra
        state.register(register_request("d1", DECODE, rank, 2, layout=decode))
    return state


def test_several_attention_groups_with_different_tp_sizes_pair():
    """Head slices and per-group blocks together: engines whose sliding and full groups agree pair at TP 1 and 2
    (run on vLLM CPU engines by tests/integration/tp/test_tp_mixed_engines.py)."""
    planned, _ = _prefill_tp1_decode_tp2().plan(dpb.PlanTransferRequest(), None)
    assert (planned.prefill_engine_id, planned.decode_engine_id) == ("p1", "d1")


def test_groups_that_differ_with_different_tp_sizes_are_refused_naming_the_groups():
    """Different TP sizes compare each side's groups as equal TP sizes do."""
    with pytest.raises(FailedPrecondition) as refused:
        _prefill_tp1_decode_tp2(decode_window_extra=64).plan(dpb.PlanTransferRequest(), None)
    assert "kv_cache_groups" in str(refused.value), str(refused.value)
