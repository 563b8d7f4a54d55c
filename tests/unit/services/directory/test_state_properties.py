"""Property-based tests (hypothesis) of the directory state machine over random event orders.

Invariants checked after every step: no block owned twice, indexes agree with transfers,
terminal states never change (so nothing is both complete and failed), counters never
negative, and every transfer is terminal once its deadline (or an engine's lease) passed.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpush.services.directory.errors import DirectoryError
from kvpush.services.directory.state import DirectoryState, Limits
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import DECODE, PREFILL, ManualClock, allocation, ready, register_request, result

ENGINES = (("p1", PREFILL), ("p2", PREFILL), ("d1", DECODE), ("d2", DECODE))
STATUSES = (dpb.WRITE_RESULT_STATUS_PROGRESS, dpb.WRITE_RESULT_STATUS_DONE, dpb.WRITE_RESULT_STATUS_FAILED,
            dpb.WRITE_RESULT_STATUS_CANCELLED)
LEASE_TTL = 10.0
TRANSFER_TTL = 30.0


class DirectoryMachine(RuleBasedStateMachine):
    """Drives one DirectoryState with random operations in random orders."""

    @initialize()
    def start(self) -> None:
        self.time = ManualClock()
        self.state = DirectoryState(
            # Time jumps model time passing while the directory reaps regularly, not a directory stall.
            Limits(lease_ttl_s=LEASE_TTL, transfer_ttl_s=TRANSFER_TTL, max_active_transfers_per_engine=8,
                   reap_stall_threshold_s=1e9),
            self.time.clock())
        self.transfers: list[str] = []
        self.terminal_seen: dict[str, int] = {}
        self.sessions: dict[str, int] = {}
        for engine_id, role in ENGINES:
            self._register(engine_id, role)

    def _register(self, engine_id: str, role: int) -> None:
        try:
            worker, _ = self.state.register(register_request(engine_id, role))
        except DirectoryError:
            return
        if role == PREFILL:
            self.sessions[engine_id] = self.state.open_session(engine_id, 0, worker.lease_id)[0]

    def _pick(self, data) -> str:
        return self.transfers[data.draw(st.integers(0, len(self.transfers) - 1))]

    @rule()
    def plan(self) -> None:
        try:
            self.transfers.append(self.state.plan(dpb.PlanTransferRequest(), None).transfer_id)
        except DirectoryError:
            pass

    @precondition(lambda self: self.transfers)
    @rule(data=st.data(), blocks=st.lists(st.integers(0, 20), min_size=3, max_size=4),
          engine=st.sampled_from(["d1", "d2"]), prefix=st.sampled_from([0, 16]))
    def allocate(self, data, blocks, engine, prefix) -> None:
        tid = self._pick(data)
        try:
            self.state.report_allocation(allocation(tid, engine_id=engine, block_ids=blocks, prefix=prefix))
        except DirectoryError:
            pass

    @precondition(lambda self: self.transfers)
    @rule(data=st.data(), engine=st.sampled_from(["p1", "p2"]), first=st.integers(0, 3), span=st.integers(0, 3))
    def layer_ready(self, data, engine, first, span) -> None:
        self.state.report_ready(engine, 0, [ready(self._pick(data), first, min(3, first + span))])

    @precondition(lambda self: self.transfers)
    @rule(data=st.data(), engine=st.sampled_from(["p1", "p2"]), status=st.sampled_from(STATUSES),
          written=st.integers(0, 4))
    def write_result(self, data, engine, status, written) -> None:
        try:
            self.state.report_result(engine, 0, result(self._pick(data), status, layers=written,
                                                       bytes_written=written * 100))
        except DirectoryError:
            pass

    @precondition(lambda self: self.transfers)
    @rule(data=st.data())
    def cancel(self, data) -> None:
        self.state.cancel(self._pick(data), "random cancel")

    @rule(engine=st.sampled_from(["p1", "p2"]))
    def break_stream(self, engine) -> None:
        if engine in self.sessions:
            self.state.close_session(engine, 0, self.sessions[engine], "broken")

    @rule(engine=st.sampled_from(ENGINES))
    def renew_or_register(self, engine) -> None:
        engine_id, role = engine
        try:
            self.state.renew(self.state.get_engine(engine_id)[0].lease_id, None)
        except DirectoryError:
            self._register(engine_id, role)

    @rule(seconds=st.sampled_from([0.5, 3.0, 11.0, 31.0]))
    def advance_and_reap(self, seconds) -> None:
        self.time.advance(seconds)
        self.state.reap()
        now = self.time.now
        for record in self.state.live_transfers():
            assert record.deadline >= now, f"{record.transfer_id} is live past its deadline"
        for engine_id, _ in ENGINES:
            try:
                for worker in self.state.get_engine(engine_id):
                    assert worker.lease_deadline >= now
            except DirectoryError:
                pass

    @invariant()
    def sound(self) -> None:
        assert self.state.check_invariants() == []

    @invariant()
    def terminal_states_never_change(self) -> None:
        for tid in self.transfers:
            try:
                record = self.state.get_transfer(tid)
            except DirectoryError:
                continue  # dropped from retention
            if tid in self.terminal_seen:
                assert record.state == self.terminal_seen[tid]
            elif record.terminal:
                self.terminal_seen[tid] = record.state
            assert record.state != tpb.TRANSFER_STATE_UNSPECIFIED

    @invariant()
    def counters_never_negative(self) -> None:
        for engine_id, _ in ENGINES:
            assert self.state.active_transfer_count(engine_id) >= 0


DirectoryMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestDirectoryMachine = DirectoryMachine.TestCase


@settings(max_examples=200, deadline=None)
@given(order=st.permutations(["alloc", "alloc", "r0", "r1", "r2", "r3", "r1"]))
def test_any_order_of_allocation_and_readiness_dispatches_exactly_once(order):
    """Whatever the order (with duplicates) of allocation and readiness, one instruction goes out, then DONE completes."""
    time = ManualClock()
    state = DirectoryState(Limits(), time.clock())
    for engine_id, role in (("p1", PREFILL), ("d1", DECODE)):
        worker, _ = state.register(register_request(engine_id, role))
    session, _ = state.open_session("p1", 0, state.get_engine("p1")[0].lease_id)
    tid = state.plan(dpb.PlanTransferRequest(), None).transfer_id
    instructions = 0
    for step in order:
        if step == "alloc":
            state.report_allocation(allocation(tid))
        else:
            layer = int(step[1])
            _, refused = state.report_ready("p1", 0, [ready(tid, layer, layer)])
            assert refused == []
        instructions += sum(m.WhichOneof("message") == "instruction" for m in state.drain_outbox("p1", 0, session))
    assert instructions == 1
    assert state.get_transfer(tid).state == tpb.TRANSFER_STATE_STREAMING
    state.report_result("p1", 0, result(tid, dpb.WRITE_RESULT_STATUS_DONE))
    assert [e.state for e in state.watch_events("d1", 0)] == [tpb.TRANSFER_STATE_COMPLETE]
