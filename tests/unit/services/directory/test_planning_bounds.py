"""Planning's bounds (state.py, no gRPC): a client's share of an engine's cap, engines renewing late, and what
an engine counts as active while a transfer of its previous registration waits for its fence."""

from __future__ import annotations

import pytest

from kvpush.directory import validation as check
from kvpush.directory.errors import InvalidArgument, ResourceExhausted
from kvpush.directory.records import TransferObserver
from kvpush.directory.state import DirectoryState, Limits
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import DECODE, PREFILL, ManualClock, allocation, make_layout, ready, register_request


class SkipLog(TransferObserver):
    """Records every engine a plan left out, with why."""

    def __init__(self) -> None:
        self.skipped: list[str] = []

    def on_engine_skipped(self, reason: str) -> None:
        self.skipped.append(reason)


def new_state(**limits) -> tuple[DirectoryState, ManualClock, SkipLog, dict[str, str]]:
    """A state with prefill p1 and decode d1, d2; returns it, its clock, its skip log and the leases by engine."""
    clock, skips = ManualClock(), SkipLog()
    state = DirectoryState(Limits(**{"lease_ttl_s": 10, **limits}), clock.clock(), skips)
    leases = {engine: state.register(register_request(engine, role))[0].lease_id
              for engine, role in (("p1", PREFILL), ("d1", DECODE), ("d2", DECODE))}
    return state, clock, skips, leases


def plan(state: DirectoryState, **fields):
    return state.plan(dpb.PlanTransferRequest(**fields), None)[0]


def test_a_client_holds_at_most_its_share_of_each_engines_cap():
    """Share 0.25 of a cap of 8: two live transfers per engine for one client; then the plan goes elsewhere or is
    refused, naming the client and the share; other clients and plans without a client are not bound."""
    state, _, skips, _ = new_state(max_active_transfers_per_engine=8, max_client_share=0.25)
    first = [plan(state, client_id="key-a") for _ in range(2)]
    # p1 is the only prefill engine: the client holds 2 of its 8 slots, its share.
    with pytest.raises(ResourceExhausted, match=r"client 'key-a' holds 2 live transfers on every candidate "
                                                r"prefill engine .*share is 0.25 of the 8-transfer cap") as refusal:
        plan(state, client_id="key-a")
    assert refusal.value.limit == "client_share"
    assert skips.skipped == ["client_share"]
    others = [plan(state, client_id="key-b"), plan(state, client_id="key-b"), plan(state)]
    assert len(others) == 3 and state.active_transfer_count("p1") == 5
    assert state.check_invariants() == []
    state.cancel(first[0].transfer_id, "client went away")  # nothing dispatched: it ends at once
    assert plan(state, client_id="key-a").prefill_engine_id == "p1"
    assert state.check_invariants() == []


def test_the_share_moves_a_client_to_other_engines_before_refusing():
    """One transfer per engine for client c (share 0.125 of 8): its second plan goes to the engines it does not
    fill yet, though d1 is preferred; its third is refused; share 1.0 (the default) bounds nothing."""
    state, _, _, leases = new_state(max_active_transfers_per_engine=8, max_client_share=0.125)
    state.register(register_request("p2", PREFILL))
    state.renew(leases["d2"], tpb.EngineLoad(free_block_count=10))  # d1 (64 free blocks) is preferred
    first = plan(state, client_id="c", prompt_token_count=16)
    second = plan(state, client_id="c", prompt_token_count=16)
    assert {(first.prefill_engine_id, first.decode_engine_id), (second.prefill_engine_id, second.decode_engine_id)} \
        == {("p1", "d1"), ("p2", "d2")}
    with pytest.raises(ResourceExhausted, match="client 'c' holds 1 live transfers"):
        plan(state, client_id="c")
    assert plan(state, prompt_token_count=16).decode_engine_id == "d1"
    unbounded, _, _, _ = new_state(max_active_transfers_per_engine=4)
    assert len([plan(unbounded, client_id="c") for _ in range(4)]) == 4
    assert state.check_invariants() == [] and unbounded.check_invariants() == []


def test_an_engine_renewing_late_is_not_planned():
    """d2 (more free blocks, so preferred) stops renewing: past half the lease TTL it is skipped and counted;
    pinned to it, the plan is refused naming the bound; its next renewal brings it back."""
    state, clock, skips, leases = new_state()
    assert plan(state, prompt_token_count=16).decode_engine_id == "d1"  # a tie: engine id decides
    state.renew(leases["d1"], tpb.EngineLoad(free_block_count=10))
    assert plan(state, prompt_token_count=16).decode_engine_id == "d2"
    for _ in range(2):  # 6 s: p1 and d1 renew every 3 s, d2 is silent (frozen)
        clock.advance(3)
        state.renew(leases["p1"], None)
        state.renew(leases["d1"], tpb.EngineLoad(free_block_count=10))
    assert skips.skipped == []
    assert {plan(state, prompt_token_count=16).decode_engine_id for _ in range(3)} == {"d1"}
    assert skips.skipped == ["late_renewal"] * 3
    with pytest.raises(ResourceExhausted, match=r"'d2' last renewed 6.0s ago, over the 5s bound") as refusal:
        plan(state, decode_engine_id="d2")
    assert refusal.value.limit == "late_renewal"
    state.renew(leases["d2"], None)
    assert plan(state, prompt_token_count=16).decode_engine_id == "d2"
    assert state.check_invariants() == []


def test_a_directory_stall_does_not_make_every_engine_late():
    """After the directory itself stalled (no renewals could be taken) leases and last renewals move on together."""
    state, clock, skips, _ = new_state()
    state.reap()
    clock.advance(7)
    state.reap()  # a 7 s gap: the directory's own stall
    assert plan(state).decode_engine_id in ("d1", "d2") and skips.skipped == []


def test_a_fenced_transfer_of_a_previous_registration_counts_for_the_new_one():
    """p1 loses its lease while writing; it registers again before the fence passes: GetEngine's active count and
    the per-engine cap both count the fenced transfer until it ends."""
    state, clock, _, leases = new_state(max_active_transfers_per_engine=1, max_write_s=10)
    session = state.open_session("p1", 0, leases["p1"])[0]
    record = plan(state, decode_engine_id="d1")
    state.report_allocation(allocation(record.transfer_id))
    state.report_ready("p1", 0, [ready(record.transfer_id, 0, 1)])
    assert record.dispatched and session
    for second in range(1, 13):  # 12 s, reaped every second: d1 and d2 renew, p1 does not (lease ends at 10)
        clock.advance(1)
        if second % 3 == 0:
            state.renew(leases["d1"], None)
            state.renew(leases["d2"], None)
        state.reap()
    assert not record.terminal and "p1" not in state.engines.groups
    state.register(register_request("p1", PREFILL))
    assert state.active_transfer_count("p1") == 1
    assert state.check_invariants() == []
    with pytest.raises(ResourceExhausted, match="at its transfer cap"):
        plan(state, prefill_engine_id="p1", decode_engine_id="d2")
    for _ in range(9):  # 21: past the old registration's fence (10 + max_write_s)
        clock.advance(1)
        state.reap()
    assert record.terminal and state.active_transfer_count("p1") == 0
    assert state.check_invariants() == []


@pytest.mark.parametrize("addresses, region, message", [
    ([-1, 0x20000, 0x30000, 0x40000], 4096, r"layer_base_addresses\[0\] is negative"),
    ([0x10000, 0x20000, 0x30000, -(2**63)], 2**63 - 1, r"layer_base_addresses\[3\] is negative"),
    ([0x10000, 2**63 - 1, 0x30000, 0x40000], 2**63 - 1, None),
])
def test_layer_addresses_must_fit_64_bits(addresses, region, message):
    """Negative addresses are refused naming the field; address + region size may reach 2^64 but not pass it."""
    layout = make_layout()
    del layout.layer_base_addresses[:]
    layout.layer_base_addresses.extend(addresses)
    layout.layer_region_bytes = region
    if message is None:
        check.check_layout(layout)  # (2^63 - 1) * 2 < 2^64
        return
    with pytest.raises(InvalidArgument, match=message):
        check.check_layout(layout)


def test_sanitized_text_has_no_control_characters_and_is_bounded():
    """A multi-line engine error becomes one line; an over-long one is cut to the bound."""
    assert check.sanitize_text("write failed:\n  at layer 3\r\n\x00") == "write failed:   at layer 3   "
    long = check.sanitize_text("x" * 5000)
    assert len(long) == check.MAX_TEXT_LENGTH and long.endswith("...")
