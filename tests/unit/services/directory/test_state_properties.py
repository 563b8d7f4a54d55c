"""Property-based tests (hypothesis) of the directory state machine over random event orders.

Invariants checked after every step: no block owned twice, indexes agree with transfers,
terminal states never change (so nothing is both complete and failed), counters never
negative, and every transfer is terminal once its deadline (or an engine's lease) passed.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpush.directory.errors import DirectoryError
from kvpush.directory.state import DirectoryState, Limits
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import DECODE, PREFILL, ManualClock, allocation, ready, register_request, result

ENGINES = (("p1", PREFILL), ("p2", PREFILL), ("d1", DECODE), ("d2", DECODE))
STATUSES = (dpb.WRITE_RESULT_STATUS_PROGRESS, dpb.WRITE_RESULT_STATUS_DONE, dpb.WRITE_RESULT_STATUS_FAILED,
            dpb.WRITE_RESULT_STATUS_CANCELLED)
LEASE_TTL = 10.0
TRANSFER_TTL = 30.0
# Caller-named transfers (the gateway's prefill before plan): readiness may come before their plan.
NAMED = tuple(c * 32 for c in "abcd")
EARLY_HOLD = 2.0


class DirectoryMachine(RuleBasedStateMachine):
    """Drives one DirectoryState with random operations in random orders (every engine has TP ranks)."""

    TP = 1

    @initialize()
    def start(self) -> None:
        self.time = ManualClock()
        self.state = DirectoryState(
            # Time jumps model time passing while the directory reaps regularly, not a directory stall.
            Limits(lease_ttl_s=LEASE_TTL, transfer_ttl_s=TRANSFER_TTL, max_active_transfers_per_engine=8,
                   reap_stall_threshold_s=1e9, early_readiness_hold_s=EARLY_HOLD, max_early_transfers_per_engine=3),
            self.time.clock())
        self.transfers: list[str] = []
        self.terminal_seen: dict[str, int] = {}
        self.sessions: dict[tuple[str, int], int] = {}
        for engine_id, role in ENGINES:
            for rank in range(self.TP):
                self._register(engine_id, role, rank)

    def _register(self, engine_id: str, role: int, rank: int) -> None:
        try:
            worker, _ = self.state.register(register_request(engine_id, role, rank, self.TP))
        except DirectoryError:
            return
        if role == PREFILL:
            self.sessions[(engine_id, rank)] = self.state.open_session(engine_id, rank, worker.lease_id)[0]

    def _rank(self, data) -> int:
        return data.draw(st.integers(0, self.TP - 1))

    def _pick(self, data) -> str:
        return self.transfers[data.draw(st.integers(0, len(self.transfers) - 1))]

    @rule()
    def plan(self) -> None:
        try:
            self.transfers.append(self.state.plan(dpb.PlanTransferRequest(), None)[0].transfer_id)
        except DirectoryError:
            pass

    @rule(data=st.data(), name=st.sampled_from(NAMED), engine=st.sampled_from(["p1", "p2"]), first=st.integers(0, 3))
    def early_ready(self, data, name, engine, first) -> None:
        """Readiness of a leg sent before its plan (plan_in_flight), for a named id planned or not."""
        self.state.report_ready(engine, self._rank(data), [ready(name, first, 4, plan_in_flight=True)])

    @rule(name=st.sampled_from(NAMED), engine=st.sampled_from(["p1", "p2"]))
    def plan_named(self, name, engine) -> None:
        try:
            record, _ = self.state.plan(dpb.PlanTransferRequest(transfer_id=name, prefill_engine_id=engine,
                                                                request_id=f"r-{name[0]}"), None)
        except DirectoryError:
            return
        if record.transfer_id not in self.transfers:
            self.transfers.append(record.transfer_id)

    @rule(data=st.data(), name=st.sampled_from(NAMED), engine=st.sampled_from(["p1", "p2"]),
          status=st.sampled_from(STATUSES))
    def early_result(self, data, name, engine, status) -> None:
        try:
            self.state.report_result(engine, self._rank(data), result(name, status))
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
        self.state.report_ready(engine, self._rank(data), [ready(self._pick(data), first, min(4, first + span + 1))])

    @precondition(lambda self: self.transfers)
    @rule(data=st.data(), engine=st.sampled_from(["p1", "p2"]), status=st.sampled_from(STATUSES),
          written=st.integers(0, 4))
    def write_result(self, data, engine, status, written) -> None:
        try:
            self.state.report_result(engine, self._rank(data), result(self._pick(data), status, layers=written,
                                                                      bytes_written=written * 100))
        except DirectoryError:
            pass

    # The rules below address a transfer's own engines, so that random runs also reach dispatch,
    # per-rank results and completion often, not only refusals.

    @precondition(lambda self: self.transfers)
    @rule(data=st.data(), prefix=st.sampled_from([0, 16]))
    def allocate_own(self, data, prefix) -> None:
        record = self.state.get_transfer(self._pick(data))
        start = data.draw(st.integers(0, 60))
        try:
            self.state.report_allocation(allocation(record.transfer_id, engine_id=record.decode_engine_id,
                                                    block_ids=[start, start + 1, start + 2], prefix=prefix))
        except DirectoryError:
            pass

    @precondition(lambda self: self.transfers)
    @rule(data=st.data(), first=st.integers(0, 3))
    def ready_own(self, data, first) -> None:
        record = self.state.get_transfer(self._pick(data))
        self.state.report_ready(record.prefill_engine_id, self._rank(data), [ready(record.transfer_id, first, 4)])

    @precondition(lambda self: self.transfers)
    @rule(data=st.data(), status=st.sampled_from(STATUSES + (dpb.WRITE_RESULT_STATUS_DONE,) * 3))
    def result_own(self, data, status) -> None:
        record = self.state.get_transfer(self._pick(data))
        try:
            self.state.report_result(record.prefill_engine_id, self._rank(data),
                                     result(record.transfer_id, status, layers=4, bytes_written=400))
        except DirectoryError:
            pass

    @precondition(lambda self: self.transfers)
    @rule(data=st.data())
    def drive_to_completion(self, data) -> None:
        """Allocation, readiness of every rank and DONE of every rank for one transfer, in a random order."""
        record = self.state.get_transfer(self._pick(data))
        start = data.draw(st.integers(0, 60))
        steps = [("alloc", 0)] + [("ready", r) for r in range(self.TP)] + [("done", r) for r in range(self.TP)]
        for kind, rank in data.draw(st.permutations(steps)):
            try:
                if kind == "alloc":
                    self.state.report_allocation(allocation(record.transfer_id, engine_id=record.decode_engine_id,
                                                            block_ids=[start, start + 1, start + 2]))
                elif kind == "ready":
                    self.state.report_ready(record.prefill_engine_id, rank, [ready(record.transfer_id, 0, 4)])
                else:
                    self.state.report_result(record.prefill_engine_id, rank, result(
                        record.transfer_id, dpb.WRITE_RESULT_STATUS_DONE, layers=4, bytes_written=400))
            except DirectoryError:
                pass

    @precondition(lambda self: self.transfers)
    @rule(data=st.data())
    def cancel(self, data) -> None:
        self.state.cancel(self._pick(data), "random cancel")

    @rule(data=st.data(), engine=st.sampled_from(["p1", "p2"]))
    def break_stream(self, data, engine) -> None:
        key = (engine, self._rank(data))
        if key in self.sessions:
            self.state.close_session(*key, self.sessions[key], "broken")

    @rule(data=st.data(), engine=st.sampled_from(ENGINES))
    def renew_or_register(self, data, engine) -> None:
        engine_id, role = engine
        rank = self._rank(data)
        try:
            self.state.renew(self.state.engines.worker(engine_id, rank).lease_id, None)
        except DirectoryError:
            self._register(engine_id, role, rank)

    @rule(seconds=st.sampled_from([0.5, 0.5, 1.0, 3.0, 11.0, 31.0]))
    def advance_and_reap(self, seconds) -> None:
        self.time.advance(seconds)
        self.state.reap()
        now = self.time.now
        for early in self.state._early.values():  # a hold past its bound was stopped by this reap
            assert early.stopped or now - early.since <= EARLY_HOLD
            assert now - early.since <= EARLY_HOLD + LEASE_TTL
        for record in self.state.live_transfers():
            self._live_within_bounds(record, now)
        for engine_id, _ in ENGINES:
            try:
                for worker in self.state.get_engine(engine_id):
                    assert worker.lease_deadline >= now
            except DirectoryError:
                pass

    @rule()
    def time_passes_with_renewals(self) -> None:
        """Engines keep renewing while 35 s pass: transfers outlive their deadline and expire."""
        for _ in range(7):
            for engine_id, _role in ENGINES:
                try:
                    for worker in self.state.get_engine(engine_id):
                        self.state.renew(worker.lease_id, None)
                except DirectoryError:
                    pass
            self.time.advance(5.0)
            self.state.reap()
        for record in self.state.live_transfers():
            self._live_within_bounds(record, self.time.now)

    def _live_within_bounds(self, record, now: float) -> None:
        """Live past its deadline only with a decided end that waits for a write that may still land, bounded."""
        if record.deadline >= now:
            return
        limits = self.state.limits
        assert record.ending is not None, f"{record.transfer_id} is live past its deadline with no end decided"
        writing = self.state.writing_ranks(record, now)
        assert writing, f"{record.transfer_id} is live with nothing that can still write"
        if now > record.ending.confirm_by:  # the silent ranks were revoked: each is fenced, within a lease + a write
            for rank in writing:
                assert record.rank_fences[rank] <= now + limits.lease_ttl_s + limits.max_write_s

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
    def early_holds_bounded(self) -> None:
        assert self.state.early_transfer_count() <= len(NAMED)

    @invariant()
    def counters_never_negative(self) -> None:
        for engine_id, _ in ENGINES:
            assert self.state.active_transfer_count(engine_id) >= 0


DirectoryMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestDirectoryMachine = DirectoryMachine.TestCase


class DirectoryMachineTP2(DirectoryMachine):
    """The same machine with two TP ranks per engine: per-rank results, one rank failing, partial engines."""

    TP = 2


DirectoryMachineTP2.TestCase.settings = DirectoryMachine.TestCase.settings
TestDirectoryMachineTP2 = DirectoryMachineTP2.TestCase


@settings(max_examples=200, deadline=None)
@given(order=st.permutations(["alloc", "alloc", "r0", "r1", "r2", "r3", "r1"]))
def test_any_order_of_allocation_and_readiness_dispatches_exactly_once(order):
    """Whatever the order (with duplicates) of allocation and readiness, one instruction goes out, then DONE
    completes."""
    time = ManualClock()
    state = DirectoryState(Limits(), time.clock())
    for engine_id, role in (("p1", PREFILL), ("d1", DECODE)):
        _worker, _ = state.register(register_request(engine_id, role))
    session, _ = state.open_session("p1", 0, state.get_engine("p1")[0].lease_id)
    tid = state.plan(dpb.PlanTransferRequest(), None)[0].transfer_id
    instructions = 0
    for step in order:
        if step == "alloc":
            state.report_allocation(allocation(tid))
        else:
            layer = int(step[1])
            _, refused = state.report_ready("p1", 0, [ready(tid, layer, layer + 1)])
            assert refused == []
        instructions += sum(m.WhichOneof("message") == "instruction" for m in state.drain_outbox("p1", 0, session))
    assert instructions == 1
    assert state.get_transfer(tid).state == tpb.TRANSFER_STATE_STREAMING
    state.report_result("p1", 0, result(tid, dpb.WRITE_RESULT_STATUS_DONE))
    assert [e.state for e in state.watch_events("d1", 0)] == [tpb.TRANSFER_STATE_COMPLETE]
