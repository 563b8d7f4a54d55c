"""Early readiness: a prefill leg sent before its PlanTransfer (the gateway names the transfer and pins the
prefill engine). Readiness marked `plan_in_flight` for an id not planned yet is held, applied by the plan, and
stopped (Cancellation) when no plan comes within `Limits.early_readiness_hold_s`. No gRPC: the state machine."""

from __future__ import annotations

import pytest

from kvpush.directory.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from kvpush.directory.records import TransferObserver
from kvpush.directory.state import DirectoryState, Limits
from kvpush.directory.validation import check_plan
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import DECODE, PREFILL, ManualClock, allocation, ready, register_request, result

TID = "a" * 32
HOLD_S = 2.0


class Outcomes(TransferObserver):
    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_early_readiness(self, outcome: str) -> None:
        self.seen.append(outcome)


class Directory:
    """Prefill engines p1 and p2, decode engine d1, each with a session."""

    def __init__(self, **limits) -> None:
        self.time = ManualClock()
        self.outcomes = Outcomes()
        self.state = DirectoryState(Limits(lease_ttl_s=10, early_readiness_hold_s=HOLD_S, **limits),
                                    self.time.clock(), self.outcomes)
        self.sessions = {}
        for engine, role in (("p1", PREFILL), ("p2", PREFILL), ("d1", DECODE)):
            worker, _ = self.state.register(register_request(engine, role))
            if role == PREFILL:
                self.sessions[engine] = self.state.open_session(engine, 0, worker.lease_id)[0]
        for engine in self.sessions:  # each session opens with d1's announcement: the tests here read transfers
            self.outbox(engine)

    def early(self, transfer_id: str = TID, engine: str = "p1", layers=(0, 4)):
        return self.state.report_ready(engine, 0, [ready(transfer_id, *layers, plan_in_flight=True)])

    def plan(self, transfer_id: str = TID, engine: str = "p1", request_id: str = "r1"):
        request = dpb.PlanTransferRequest(transfer_id=transfer_id, prefill_engine_id=engine, request_id=request_id)
        check_plan(request, self.state.limits)
        return self.state.plan(request, None)

    def outbox(self, engine: str = "p1") -> list[dpb.StreamPrefillResponse]:
        return self.state.drain_outbox(engine, 0, self.sessions[engine])


def test_readiness_before_the_plan_is_applied_by_the_plan_and_dispatches_on_allocation():
    d = Directory()
    arrived = d.state.clock.wall()
    effects, refused = d.early(layers=(0, 2))
    assert not refused and not effects
    d.time.advance(0.01)
    d.early(layers=(2, 4))
    d.time.advance(0.5)
    record, effects = d.plan()
    assert record.transfer_id == TID and record.state == tpb.TRANSFER_STATE_PLANNED
    assert record.layer_ready_walls[0] == arrived and record.first_ready_wall == arrived  # when it came, not the plan
    assert sorted(record.layer_ready_walls) == [0, 1, 2, 3]
    assert d.outcomes.seen == ["planned"] and d.state.early_transfer_count() == 0
    record, effects = d.state.report_allocation(allocation(TID))
    assert record.state == tpb.TRANSFER_STATE_STREAMING and effects.prefill_outboxes == {("p1", 0)}
    (message,) = d.outbox()
    assert message.instruction.transfer_id == TID and list(message.instruction.decode_block_ids) == [1, 2, 3]
    d.state.report_result("p1", 0, result(TID, dpb.WRITE_RESULT_STATUS_DONE, layers=4))
    assert d.state.get_transfer(TID).state == tpb.TRANSFER_STATE_COMPLETE
    assert d.state.check_invariants() == []


def test_readiness_for_an_unknown_transfer_without_the_mark_is_still_not_found():
    d = Directory()
    _, refused = d.state.report_ready("p1", 0, [ready(TID, 0, 1)])
    assert [type(error) for _, error in refused] == [NotFound]
    assert d.state.early_transfer_count() == 0


def test_a_hold_that_runs_out_stops_the_engine_and_refuses_the_late_plan():
    d = Directory()
    d.early()
    d.time.advance(HOLD_S - 0.1)
    assert not d.state.reap() and d.outbox() == []
    d.time.advance(0.2)
    effects = d.state.reap()
    assert effects.prefill_outboxes == {("p1", 0)} and d.outcomes.seen == ["expired"]
    (message,) = d.outbox()
    assert message.cancellation.transfer_id == TID and "within 2.0s" in message.cancellation.reason
    _, refused = d.early()
    assert [type(error) for _, error in refused] == [FailedPrecondition]
    with pytest.raises(FailedPrecondition, match="waited over"):
        d.plan()
    assert d.state.report_result("p1", 0, result(TID, dpb.WRITE_RESULT_STATUS_CANCELLED)) is not None  # accepted
    with pytest.raises(FailedPrecondition):
        d.plan()
    d.time.advance(10)  # a lease TTL later it is forgotten: the id is new again
    d.state.reap()
    assert d.state.early_transfer_count() == 0
    assert d.plan()[0].state == tpb.TRANSFER_STATE_PLANNED
    assert d.state.check_invariants() == []


def test_a_plan_for_another_engine_stops_the_early_one():
    d = Directory()
    d.early(engine="p2")
    record, effects = d.plan(engine="p1")
    assert record.prefill_engine_id == "p1" and not record.ready
    assert effects.prefill_outboxes == {("p2", 0)} and d.outcomes.seen == ["dropped"]
    (message,) = d.outbox("p2")
    assert message.cancellation.transfer_id == TID and "planned for engine 'p1'" in message.cancellation.reason
    _, refused = d.state.report_ready("p2", 0, [ready(TID, 0, 1, plan_in_flight=True)])
    assert [type(error) for _, error in refused] == [PermissionDenied]


def test_held_readiness_is_checked_like_any_readiness():
    d = Directory(max_early_transfers_per_engine=2)
    d.early()
    _, refused = d.state.report_ready("p2", 0, [ready(TID, 0, 1, plan_in_flight=True)])
    assert [type(error) for _, error in refused] == [PermissionDenied]
    _, refused = d.state.report_ready("p1", 0, [ready(TID, 0, 9, plan_in_flight=True)])
    assert [type(error) for _, error in refused] == [InvalidArgument]  # 4 layers
    _, refused = d.state.report_ready("p1", 0, [ready(TID, 0, 1, prompt=41, plan_in_flight=True)])
    assert [type(error) for _, error in refused] == [InvalidArgument]
    d.early("b" * 32)
    _, refused = d.early("c" * 32)
    assert [type(error) for _, error in refused] == [ResourceExhausted]
    assert d.state.early_transfer_count() == 2
    _, refused = d.early("c" * 32, engine="p2")  # the cap is per engine
    assert not refused


def test_a_named_transfer_is_unique_and_a_repeated_plan_returns_it():
    d = Directory()
    first, _ = d.plan()
    again, _ = d.plan()
    assert again is first
    with pytest.raises(AlreadyExists):
        d.plan(request_id="r2")
    with pytest.raises(InvalidArgument, match="prefill_engine_id"):
        check_plan(dpb.PlanTransferRequest(transfer_id=TID), d.state.limits)
    with pytest.raises(InvalidArgument):
        check_plan(dpb.PlanTransferRequest(transfer_id="bad id!", prefill_engine_id="p1"), d.state.limits)


def test_an_early_rank_that_stops_or_loses_its_session_is_let_go():
    d = Directory()
    d.early()
    d.state.report_result("p1", 0, result(TID, dpb.WRITE_RESULT_STATUS_CANCELLED))  # its request ended
    assert d.state.early_transfer_count() == 0 and d.outcomes.seen == ["dropped"]
    with pytest.raises(NotFound):
        d.state.report_result("p1", 0, result(TID, dpb.WRITE_RESULT_STATUS_DONE))
    d.early("b" * 32)
    with pytest.raises(FailedPrecondition):
        d.state.report_result("p1", 0, result("b" * 32, dpb.WRITE_RESULT_STATUS_DONE))
    d.state.close_session("p1", 0, d.sessions["p1"], "stream broke")
    assert d.state.early_transfer_count() == 0 and d.outcomes.seen == ["dropped", "dropped"]
    record, _ = d.plan("b" * 32)  # a plan after that gets a transfer with nothing ready
    assert not record.ready and d.state.check_invariants() == []


def test_a_stopped_hold_outlives_the_session_but_not_the_engine():
    """After the hold ran out, a broken session still leaves the late plan refused; the engine's lease lapsing
    forgets it (nothing of an unregistered engine is kept)."""
    d = Directory()
    d.early()
    d.time.advance(HOLD_S + 0.1)
    d.state.reap()
    d.state.close_session("p1", 0, d.sessions["p1"], "stream broke")
    with pytest.raises(FailedPrecondition):
        d.plan()
    assert d.state.early_transfer_count() == 1
    for _ in range(17):  # to 10.6 s: past p1's lease (no renewals here), before the hold's age limit (2 s + TTL)
        d.time.advance(0.5)  # reaped often: one long gap would read as the directory's own stall
        d.state.reap()
    assert d.state.early_transfer_count() == 0 and d.state.check_invariants() == []


def test_an_unregistered_rank_holds_nothing_and_one_late_reap_stops_and_forgets():
    """Found by the property test: readiness of a rank with no registration is NOT_FOUND (a hold of it would
    outlive its engine); the first reap after the hold's end plus a lease TTL stops it and forgets it at once."""
    d = Directory()
    _, refused = d.state.report_ready("p1", 1, [ready(TID, 0, 4, plan_in_flight=True)])
    assert [type(error) for _, error in refused] == [NotFound] and d.state.early_transfer_count() == 0
    d.early()
    d.time.advance(9)  # no reap meanwhile (the directory's first); the leases are renewed, so p1 stays
    for engine in ("p1", "p2", "d1"):
        d.state.renew(d.state.get_engine(engine)[0].lease_id, None)
    d.time.advance(HOLD_S + 10 + 1 - 9)
    effects = d.state.reap()
    assert effects.prefill_outboxes == {("p1", 0)} and d.outbox()[0].cancellation.transfer_id == TID
    assert d.state.early_transfer_count() == 0 and d.state.check_invariants() == []
