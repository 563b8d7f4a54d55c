"""The directory's block accounting when prefill and decode have different block sizes: a transfer needs
ceil(prompt / decode's block size) decode blocks, decode's capacity decides planning, the owned blocks are decode's
(after its prefix hit, in its size), and the instruction carries decode's blocks and decode's layout."""

from __future__ import annotations

import pytest

from kvpush.directory.errors import InvalidArgument, ResourceExhausted
from kvpush.directory.state import DirectoryState, Limits
from kvpush.v1 import directory_pb2 as dpb
from tests.fixtures.directory import DECODE, PREFILL, ManualClock, allocation, make_layout, ready, register_request


def _state(prefill_size: int, decode_size: int, decode_blocks: int) -> tuple[DirectoryState, int]:
    """p1 (prefill_size tokens per block) and d1 (decode_size, decode_blocks blocks), p1's session open; the directory
    pairs different block sizes (--pair-block-sizes)."""
    state = DirectoryState(Limits(lease_ttl_s=10, transfer_ttl_s=60, pair_block_sizes=True), ManualClock().clock())
    worker, _ = state.register(register_request("p1", PREFILL, layout=make_layout(block_size_tokens=prefill_size)))
    state.register(register_request("d1", DECODE, layout=make_layout(block_size_tokens=decode_size,
                                                                      block_count=decode_blocks)))
    session, _ = state.open_session("p1", 0, worker.lease_id)
    state.drain_outbox("p1", 0, session)  # d1's announcement
    return state, session


@pytest.mark.parametrize(("prefill_size", "decode_size", "needed"), [(128, 16, 19), (16, 128, 3)])
def test_a_transfer_needs_decode_blocks_of_decode_size(prefill_size: int, decode_size: int, needed: int):
    """300 tokens: 19 blocks of 16 or 3 of 128 on decode, whatever prefill's size; one fewer is refused."""
    state, session = _state(prefill_size, decode_size, 64)
    transfer_id = state.plan(dpb.PlanTransferRequest(prompt_token_count=300), None)[0].transfer_id
    with pytest.raises(InvalidArgument, match=f"{needed - 1} block ids cannot hold 300 tokens of {decode_size} per "
                                              f"block \\(need {needed}\\)"):
        state.report_allocation(allocation(transfer_id, block_ids=range(needed - 1), prompt=300))
    record, _ = state.report_allocation(allocation(transfer_id, block_ids=range(needed), prompt=300))
    assert record.owned_blocks == tuple(range(needed))
    state.report_ready("p1", 0, [ready(transfer_id, 0, 4, prompt=300)])
    (message,) = state.drain_outbox("p1", 0, session)
    instruction = message.instruction
    assert list(instruction.decode_block_ids) == list(range(needed))
    assert instruction.decode_layout.block_size_tokens == decode_size
    assert state.check_invariants() == []


def test_a_decode_prefix_hit_owns_only_the_blocks_after_it_in_decode_size():
    """Prefill 128, decode 16, decode holds 48 tokens: blocks 0-2 are its own (shareable), 3-18 are owned."""
    state, _ = _state(128, 16, 64)
    transfer_id = state.plan(dpb.PlanTransferRequest(prompt_token_count=300), None)[0].transfer_id
    record, _ = state.report_allocation(allocation(transfer_id, block_ids=range(40, 59), prompt=300, prefix=48))
    assert record.owned_blocks == tuple(range(43, 59))


def test_decode_capacity_in_its_own_block_size_decides_planning():
    """Decode holds 8 blocks of 16 = 128 tokens: 129 tokens do not fit, whatever prefill's block size."""
    state, _ = _state(128, 16, 8)
    state.plan(dpb.PlanTransferRequest(prompt_token_count=128), None)
    with pytest.raises(ResourceExhausted, match="no decode engine has room for 129 tokens \\(the largest holds 128\\)"):
        state.plan(dpb.PlanTransferRequest(prompt_token_count=129), None)
