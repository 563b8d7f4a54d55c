"""Planning admits a prompt by a decode engine's KV capacity, not by the free blocks it last reported.

An idle decode engine reports the blocks it freed only at its next step or renewal: right after a long request
ended, its last report could say 0 free blocks while every block was free again, and planning refused the next
request with 503. Free blocks still order the choice between engines.
"""

from __future__ import annotations

import pytest

from kvpush.directory.errors import ResourceExhausted
from kvpush.directory.state import DirectoryState, Limits
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import DECODE, PREFILL, ManualClock, make_layout, register_request


def _state() -> tuple[DirectoryState, dict[str, str]]:
    """Prefill p1, decode d1 (64 blocks of 16 tokens) and d2 (16 blocks); the leases by engine."""
    state = DirectoryState(Limits(lease_ttl_s=10), ManualClock().clock())
    leases = {engine: state.register(register_request(engine, role, layout=make_layout(block_count=blocks)))[0].lease_id
              for engine, role, blocks in (("p1", PREFILL, 64), ("d1", DECODE, 64), ("d2", DECODE, 16))}
    return state, leases


def _plan(state: DirectoryState, tokens: int) -> dpb.PlanTransferResponse:
    return state.plan(dpb.PlanTransferRequest(prompt_token_count=tokens), None)[0]


def test_a_stale_report_of_no_free_blocks_does_not_refuse_a_prompt_the_engine_can_hold():
    state, leases = _state()
    state.renew(leases["d1"], tpb.EngineLoad(free_block_count=0))
    state.renew(leases["d2"], tpb.EngineLoad(free_block_count=0))
    # 1,000 tokens need 63 blocks: only d1 holds them, whatever it last reported free.
    assert _plan(state, 1000).decode_engine_id == "d1"
    assert state.check_invariants() == []


def test_free_blocks_order_the_engines_that_can_hold_the_prompt():
    state, leases = _state()
    state.renew(leases["d1"], tpb.EngineLoad(free_block_count=2))
    state.renew(leases["d2"], tpb.EngineLoad(free_block_count=16))
    assert _plan(state, 100).decode_engine_id == "d2"  # both hold 7 blocks; d2 reported more free
    assert _plan(state, 300).decode_engine_id == "d1"  # 19 blocks: more than d2 has at all


def test_a_prompt_larger_than_every_decode_cache_is_refused_naming_the_largest():
    state, _ = _state()
    refusal = r"no decode engine has room for 1025 tokens \(the largest holds 1024\)"
    with pytest.raises(ResourceExhausted, match=refusal):
        _plan(state, 1025)
    assert state.check_invariants() == []
