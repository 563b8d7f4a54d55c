"""Unit tests of `kvpush.directory.state`: the directory's state machine, no gRPC."""

from __future__ import annotations

import pytest

from kvpush.directory.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
)
from kvpush.directory.state import DirectoryState, Limits
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import (
    DECODE,
    PREFILL,
    ManualClock,
    allocation,
    make_layout,
    ready,
    register_request,
    result,
)

DONE = dpb.WRITE_RESULT_STATUS_DONE
FAILED = dpb.WRITE_RESULT_STATUS_FAILED
CANCELLED = dpb.WRITE_RESULT_STATUS_CANCELLED
PROGRESS = dpb.WRITE_RESULT_STATUS_PROGRESS
S = tpb


class Directory:
    """A state with one prefill engine p1 and one decode engine d1, plus shortcuts."""

    def __init__(self, limits: Limits | None = None, tp_size: int = 1) -> None:
        self.time = ManualClock()
        self.state = DirectoryState(limits or Limits(lease_ttl_s=10, transfer_ttl_s=60), self.time.clock())
        self.leases = {}
        for rank in range(tp_size):
            for engine, role in (("p1", PREFILL), ("d1", DECODE)):
                worker, _ = self.state.register(register_request(engine, role, rank, tp_size))
                self.leases[(engine, rank)] = worker.lease_id
        self.sessions = {rank: self.state.open_session("p1", rank, self.leases[("p1", rank)])[0]
                         for rank in range(tp_size)}
        # Each session opens with d1's announcement (test_peer_announcements.py); the tests here read transfers.
        self.announced = {rank: self.outbox(rank) for rank in range(tp_size)}

    def plan(self, **fields) -> str:
        return self.state.plan(dpb.PlanTransferRequest(**fields), None)[0].transfer_id

    def allocated(self) -> str:
        """A planned transfer whose decode allocation (blocks 1, 2, 3) has been reported."""
        transfer_id = self.plan()
        self.state.report_allocation(allocation(transfer_id))
        return transfer_id

    def outbox(self, rank: int = 0) -> list[dpb.StreamPrefillResponse]:
        return self.state.drain_outbox("p1", rank, self.sessions[rank])

    def events(self, after: int = 0) -> list[dpb.TransferEvent]:
        return self.state.watch_events("d1", after)

    def ready(self, transfer_id: str, layer_start: int, layer_end: int, rank: int = 0, **kw):
        effects, refused = self.state.report_ready("p1", rank, [ready(transfer_id, layer_start, layer_end, **kw)])
        return effects, refused

    def transfer(self, transfer_id: str):
        return self.state.get_transfer(transfer_id)


def test_allocation_then_readiness_dispatches_one_instruction():
    """Allocation first, then readiness: STREAMING and exactly one instruction covering the transfer."""
    d = Directory()
    tid = d.plan()
    record, effects = d.state.report_allocation(allocation(tid))
    assert record.state == S.TRANSFER_STATE_ALLOCATED and not effects.prefill_outboxes
    effects, refused = d.ready(tid, 0, 1)
    assert not refused and effects.prefill_outboxes == {("p1", 0)}
    messages = d.outbox()
    assert [m.WhichOneof("message") for m in messages] == ["instruction"]
    instruction = messages[0].instruction
    assert instruction.transfer_id == tid and list(instruction.decode_block_ids) == [1, 2, 3]
    assert instruction.notification == tid.encode() and instruction.decode_agent_metadata == b"nixl-md-d1-0"
    assert instruction.decode_layout.layer_count == 4 and instruction.prompt_token_count == 40
    assert d.transfer(tid).state == S.TRANSFER_STATE_STREAMING
    d.ready(tid, 1, 4)
    assert d.outbox() == []


def test_readiness_then_allocation_dispatches_on_allocation():
    """Readiness first stays PLANNED; the allocation then dispatches the instruction."""
    d = Directory()
    tid = d.plan()
    effects, refused = d.ready(tid, 0, 2)
    assert not refused and not effects and d.transfer(tid).state == S.TRANSFER_STATE_PLANNED
    assert d.transfer(tid).first_ready_wall is not None
    record, effects = d.state.report_allocation(allocation(tid, prefix=16))
    assert record.state == S.TRANSFER_STATE_STREAMING and effects.prefill_outboxes == {("p1", 0)}
    (message,) = d.outbox()
    assert message.instruction.skip_token_count == 16


def test_completion_tells_decode_with_sequence_numbers():
    """DONE from the only rank completes the transfer and appends a numbered event to decode's log."""
    d = Directory()
    first, second = d.plan(), d.plan()
    for tid, blocks in ((first, (1, 2, 3)), (second, (4, 5, 6))):
        d.state.report_allocation(allocation(tid, block_ids=blocks))
        d.ready(tid, 0, 4)
    d.state.report_result("p1", 0, result(first, PROGRESS, layers=2, bytes_written=10))
    assert d.transfer(first).state == S.TRANSFER_STATE_STREAMING
    effects = d.state.report_result("p1", 0, result(first, DONE, layers=4, bytes_written=99))
    d.state.report_result("p1", 0, result(second, FAILED, error="nixl post failed"))
    assert effects.watch_engines == {"d1"}
    events = d.events()
    assert [(e.sequence_number, e.transfer_id, e.state) for e in events] == [
        (1, first, S.TRANSFER_STATE_COMPLETE), (2, second, S.TRANSFER_STATE_FAILED)]
    assert events[0].bytes_written == 99 and "nixl post failed" in events[1].reason
    assert [e.transfer_id for e in d.events(after=1)] == [second]
    proto = d.transfer(first).to_proto()
    assert proto.layers_written_count == 4 and proto.bytes_written == 99 and proto.HasField("end_time")


def test_duplicate_events_are_idempotent():
    """Repeated allocation, readiness and DONE change nothing and produce nothing."""
    d = Directory()
    tid = d.allocated()
    d.ready(tid, 0, 4)
    d.outbox()
    record, effects = d.state.report_allocation(allocation(tid))
    assert not effects and record.state == S.TRANSFER_STATE_STREAMING
    effects, refused = d.ready(tid, 1, 3)
    assert not effects and not refused and d.outbox() == []
    d.state.report_result("p1", 0, result(tid, DONE))
    assert not d.state.report_result("p1", 0, result(tid, DONE))
    assert len(d.events()) == 1


def test_readiness_after_terminal_is_rejected_failed_precondition():
    """Readiness for a finished transfer is refused with FAILED_PRECONDITION, state unchanged."""
    d = Directory()
    tid = d.plan()
    d.state.cancel(tid, "gateway timeout")
    _, refused = d.ready(tid, 0, 1)
    assert isinstance(refused[0][1], FailedPrecondition)
    assert d.transfer(tid).state == S.TRANSFER_STATE_CANCELLED


def test_bad_events_are_refused_precisely_and_change_nothing():
    """Unknown transfer, wrong engine, layer out of range, mismatched prompt: each refused, state intact."""
    d = Directory()
    d.state.register(register_request("p2", PREFILL))
    tid = d.plan(prefill_engine_id="p1")
    d.ready(tid, 0, 1, prompt=40)
    before = d.transfer(tid).to_proto()
    _, refused = d.state.report_ready("p1", 0, [
        ready("nope", 0, 1), ready(tid, 0, 5), ready(tid, 1, 2, prompt=41)])
    assert [type(e) for _, e in refused] == [NotFound, InvalidArgument, InvalidArgument]
    _, refused = d.state.report_ready("p2", 0, [ready(tid, 1, 2)])
    assert isinstance(refused[0][1], PermissionDenied)
    with pytest.raises(FailedPrecondition):  # no instruction yet
        d.state.report_result("p1", 0, result(tid, DONE))
    with pytest.raises(InvalidArgument):
        d.state.report_result("p1", 0, result(tid, dpb.WRITE_RESULT_STATUS_UNSPECIFIED))
    assert d.transfer(tid).to_proto() == before


def test_allocation_errors_change_nothing():
    """Allocation refusals: unknown, wrong engine, too few blocks, out-of-range, conflict, changed repeat."""
    d = Directory()
    d.state.register(register_request("d2", DECODE))
    first = d.plan(decode_engine_id="d1")
    second = d.plan(decode_engine_id="d1")
    with pytest.raises(NotFound):
        d.state.report_allocation(allocation("nope"))
    with pytest.raises(NotFound):
        d.state.report_allocation(allocation(first, engine_id="ghost"))
    with pytest.raises(PermissionDenied):
        d.state.report_allocation(allocation(first, engine_id="d2"))
    with pytest.raises(InvalidArgument):
        d.state.report_allocation(allocation(first, block_ids=(1, 2)))  # 40 tokens need 3 blocks of 16
    with pytest.raises(InvalidArgument):
        d.state.report_allocation(allocation(first, block_ids=(1, 2, 64)))
    with pytest.raises(InvalidArgument):
        d.state.report_allocation(allocation(first, block_ids=(1, 2, 2)))
    assert d.transfer(first).allocation is None
    d.state.report_allocation(allocation(first, block_ids=(1, 2, 3)))
    with pytest.raises(FailedPrecondition):
        d.state.report_allocation(allocation(second, block_ids=(3, 4, 5)))
    with pytest.raises(FailedPrecondition):
        d.state.report_allocation(allocation(first, block_ids=(7, 8, 9)))
    assert d.transfer(second).allocation is None and d.state.check_invariants() == []


def test_prefix_hit_blocks_may_be_shared():
    """Blocks wholly inside decode's prefix hit are not owned, so two transfers may share them."""
    d = Directory()
    first, second = d.plan(), d.plan()
    d.state.report_allocation(allocation(first, block_ids=(0, 1, 2), prefix=16))
    d.state.report_allocation(allocation(second, block_ids=(0, 3, 4), prefix=16))
    assert d.state.check_invariants() == []


def test_blocks_are_released_when_a_transfer_ends():
    """After a transfer ends its decode blocks may be allocated to another transfer."""
    d = Directory()
    first, second = d.plan(), d.plan()
    d.state.report_allocation(allocation(first))
    d.state.cancel(first, "")
    d.state.report_allocation(allocation(second))
    assert d.transfer(second).state == S.TRANSFER_STATE_ALLOCATED


def test_cancel_before_dispatch_is_immediate():
    """Cancelling a transfer with no instruction out ends it CANCELLED at once and tells decode."""
    d = Directory()
    tid = d.allocated()
    record, effects = d.state.cancel(tid, "client went away")
    assert record.state == S.TRANSFER_STATE_CANCELLED and effects.watch_engines == {"d1"}
    assert d.events()[0].reason == "client went away"
    assert d.state.cancel(tid, "again")[0].failure_reason == "client went away"


def test_cancel_after_dispatch_waits_for_prefill():
    """After dispatch, cancel tells prefill and CANCELLED reaches decode only once prefill confirms."""
    d = Directory()
    tid = d.allocated()
    d.ready(tid, 0, 1)
    d.outbox()
    record, effects = d.state.cancel(tid, "abort")
    assert record.state == S.TRANSFER_STATE_STREAMING and not effects.watch_engines
    (message,) = d.outbox()
    assert message.cancellation.transfer_id == tid
    assert d.events() == []
    effects = d.state.report_result("p1", 0, result(tid, CANCELLED))
    assert d.transfer(tid).state == S.TRANSFER_STATE_CANCELLED
    assert [e.state for e in d.events()] == [S.TRANSFER_STATE_CANCELLED]


def test_cancel_pending_becomes_cancelled_when_prefill_lease_lapses():
    """A pending cancellation ends CANCELLED once the prefill engine's lease lapsed and its fence passed."""
    d = Directory(Limits(lease_ttl_s=10, transfer_ttl_s=60, max_write_s=3))
    tid = d.allocated()
    d.ready(tid, 0, 1)
    d.state.cancel(tid, "abort")
    d.time.advance(5)
    d.state.renew(d.leases[("d1", 0)], None)
    d.time.advance(6)  # p1's lease (deadline 10) lapsed: its writes may land until 10 + 3
    d.state.reap()
    assert d.transfer(tid).state == S.TRANSFER_STATE_STREAMING and not d.events()
    d.state.renew(d.leases[("d1", 0)], None)
    d.time.advance(1.9)  # 12.9
    d.state.reap()
    assert d.transfer(tid).state == S.TRANSFER_STATE_STREAMING
    d.time.advance(0.2)  # 13.1: past the fence
    d.state.reap()
    assert d.transfer(tid).state == S.TRANSFER_STATE_CANCELLED
    assert d.events()[0].state == S.TRANSFER_STATE_CANCELLED
    assert d.state.check_invariants() == []


def test_failed_prefill_stream_holds_decode_blocks_until_prefill_confirms():
    """A broken prefill session decides FAILED but decode is told only when prefill confirms it stopped."""
    d = Directory()
    tid = d.allocated()
    d.ready(tid, 0, 1)
    d.outbox()
    effects = d.state.close_session("p1", 0, d.sessions[0], "prefill stream broken")
    assert not effects.watch_engines and d.transfer(tid).state == S.TRANSFER_STATE_STREAMING
    with pytest.raises(FailedPrecondition):  # the blocks are still owned: no other transfer may get them
        other = d.plan()
        d.state.report_allocation(allocation(other))
    d.sessions[0], _ = d.state.open_session("p1", 0, d.leases[("p1", 0)])
    assert d.outbox()[0].cancellation.transfer_id == tid
    effects = d.state.report_result("p1", 0, result(tid, FAILED, error="session reset"))
    record = d.transfer(tid)
    assert effects.watch_engines == {"d1"} and record.state == S.TRANSFER_STATE_FAILED
    assert record.failure_reason == "prefill stream broken"
    assert d.events()[0].state == S.TRANSFER_STATE_FAILED


def test_expired_transfer_waits_for_prefill_then_revokes_a_silent_lease():
    """EXPIRED with a write in flight: decode waits; a prefill that never confirms loses its lease, then the fence."""
    d = Directory(Limits(lease_ttl_s=10, transfer_ttl_s=5, max_write_s=2))
    tid = d.allocated()
    d.ready(tid, 0, 1)
    d.outbox()

    def renew_and_reap(seconds: float) -> None:
        d.time.advance(seconds)
        for key in (("p1", 0), ("d1", 0)):
            try:
                d.state.renew(d.leases[key], None)
            except NotFound:
                pass
        d.state.reap()

    renew_and_reap(6)  # 1006: EXPIRED decided, prefill must confirm by 1006 + 10 + 2
    assert d.outbox()[0].cancellation.transfer_id == tid
    for _ in range(6):  # up to 1018: prefill renews but never confirms
        renew_and_reap(2)
        assert d.transfer(tid).state == S.TRANSFER_STATE_STREAMING and not d.events()
    renew_and_reap(2)  # 1020: p1 renewed (lease deadline 1030) and is revoked; its writes end by 1030 + 2
    with pytest.raises(NotFound):
        d.state.get_engine("p1")
    renew_and_reap(11.9)  # 1031.9
    assert d.transfer(tid).state == S.TRANSFER_STATE_STREAMING
    renew_and_reap(0.2)  # 1032.1
    assert d.transfer(tid).state == S.TRANSFER_STATE_EXPIRED
    assert d.events()[0].state == S.TRANSFER_STATE_EXPIRED
    assert d.state.check_invariants() == []


def test_tp2_completes_only_when_every_rank_is_done():
    """With TP=2 each rank gets its own instruction (decode rank = prefill rank); COMPLETE needs both DONE."""
    d = Directory(tp_size=2)
    tid = d.allocated()
    effects, _ = d.ready(tid, 0, 1, rank=1)
    assert effects.prefill_outboxes == {("p1", 0), ("p1", 1)}
    assert [m.instruction.decode_tp_rank for m in d.outbox(0) + d.outbox(1)] == [0, 1]
    assert d.outbox(1) == []
    d.state.report_result("p1", 0, result(tid, DONE))
    assert d.transfer(tid).state == S.TRANSFER_STATE_STREAMING
    d.state.report_result("p1", 1, result(tid, DONE))
    assert d.transfer(tid).state == S.TRANSFER_STATE_COMPLETE


def test_tp2_failure_waits_for_the_other_rank_to_stop():
    """One rank FAILED: the other is told to stop; FAILED reaches decode when it confirms."""
    d = Directory(tp_size=2)
    tid = d.allocated()
    d.ready(tid, 0, 1)
    d.outbox(0), d.outbox(1)
    d.state.report_result("p1", 0, result(tid, FAILED, error="post failed"))
    assert [m.cancellation.transfer_id for m in d.outbox(1)] == [tid] and d.outbox(0) == []
    assert d.events() == []
    d.state.report_result("p1", 1, result(tid, CANCELLED))
    assert d.transfer(tid).state == S.TRANSFER_STATE_FAILED and "post failed" in d.events()[0].reason


def test_lease_lapse_fails_transfers_and_tells_both_sides():
    """A decode engine whose lease lapses is removed; its transfers fail; prefill gets a cancellation."""
    d = Directory()
    tid = d.allocated()
    d.ready(tid, 0, 1)
    d.outbox()
    d.time.advance(6)
    d.state.renew(d.leases[("p1", 0)], tpb.EngineLoad(free_block_count=3))
    d.time.advance(5)
    effects = d.state.reap()
    assert effects.prefill_outboxes == {("p1", 0)} and not effects.watch_engines
    assert d.outbox()[0].cancellation.transfer_id == tid
    effects = d.state.report_result("p1", 0, result(tid, CANCELLED))  # prefill confirms it stopped
    assert effects.watch_engines == {"d1"}
    record = d.transfer(tid)
    assert record.state == S.TRANSFER_STATE_FAILED and "lease expired" in record.failure_reason
    with pytest.raises(NotFound):
        d.state.get_engine("d1")
    with pytest.raises(NotFound):
        d.state.renew(d.leases[("d1", 0)], None)
    assert d.state.get_engine("p1")[0].load.free_block_count == 3


def test_transfer_deadline_expires_and_tells_both_sides():
    """A transfer past its deadline becomes EXPIRED; decode gets the event, prefill a cancellation."""
    d = Directory(Limits(lease_ttl_s=100, transfer_ttl_s=5))
    tid = d.allocated()
    d.ready(tid, 0, 1)
    d.outbox()
    d.time.advance(4)
    assert not d.state.reap()
    d.time.advance(2)
    d.state.reap()
    assert d.transfer(tid).state == S.TRANSFER_STATE_STREAMING and not d.events()  # a write may be in flight
    assert d.outbox()[0].cancellation.transfer_id == tid
    d.state.report_result("p1", 0, result(tid, CANCELLED))
    assert d.transfer(tid).state == S.TRANSFER_STATE_EXPIRED
    assert d.events()[0].state == S.TRANSFER_STATE_EXPIRED
    assert d.state.check_invariants() == []


def test_stream_close_fails_begun_transfers_only():
    """Closing the current prefill session fails the transfers it began; untouched plans survive."""
    d = Directory()
    begun, untouched = d.plan(), d.plan()
    d.ready(begun, 0, 1)
    d.state.close_session("p1", 0, d.sessions[0], "prefill stream broken")
    assert d.transfer(begun).state == S.TRANSFER_STATE_FAILED  # never dispatched: no write, ends at once
    assert d.transfer(untouched).state == S.TRANSFER_STATE_PLANNED
    assert not d.state.close_session("p1", 0, d.sessions[0], "again")


def test_stale_session_close_changes_nothing():
    """A replaced session's end does not fail the worker's transfers."""
    d = Directory()
    tid = d.plan()
    d.ready(tid, 0, 1)
    _new_session, _ = d.state.open_session("p1", 0, d.leases[("p1", 0)])
    assert not d.state.close_session("p1", 0, d.sessions[0], "old stream")
    assert d.transfer(tid).state == S.TRANSFER_STATE_PLANNED


def test_registration_rules():
    """Same agent re-registers to a FRESH lease (the old one stops); another agent is ALREADY_EXISTS; roles agree."""
    d = Directory()
    old_lease = d.leases[("p1", 0)]
    again, _ = d.state.register(register_request("p1", PREFILL))
    assert again.lease_id != old_lease and again.lease_id
    with pytest.raises(NotFound):
        d.state.renew(old_lease, None)
    d.leases[("p1", 0)] = again.lease_id
    with pytest.raises(AlreadyExists):
        d.state.register(register_request("p1", PREFILL, agent_name="other"))
    with pytest.raises(InvalidArgument):
        d.state.register(register_request("p1", DECODE, tp_rank=0))
    d.time.advance(11)  # lapsed: a new agent may take the rank
    worker, _ = d.state.register(register_request("p1", PREFILL, agent_name="other"))
    assert worker.lease_id != d.leases[("p1", 0)]


def test_deregister_needs_the_lease():
    """Deregistration with a wrong lease is NOT_FOUND and changes nothing; with the lease it removes."""
    d = Directory()
    with pytest.raises(NotFound):
        d.state.deregister("p1", 0, "wrong")
    assert d.state.get_engine("p1")
    d.state.deregister("p1", 0, d.leases[("p1", 0)])
    with pytest.raises(NotFound):
        d.state.get_engine("p1")


def test_planning_prefers_free_blocks_then_fewest_transfers():
    """Decode with the most free blocks wins; prefill with the fewest active transfers wins."""
    d = Directory()
    d.state.register(register_request("p2", PREFILL))
    lease, _ = d.state.register(register_request("d2", DECODE))
    d.state.renew(lease.lease_id, tpb.EngineLoad(free_block_count=60))
    d.state.renew(d.leases[("d1", 0)], tpb.EngineLoad(free_block_count=10))
    first = d.state.plan(dpb.PlanTransferRequest(), None)[0]
    second = d.state.plan(dpb.PlanTransferRequest(), None)[0]
    assert first.decode_engine_id == "d2" and second.decode_engine_id == "d2"
    assert {first.prefill_engine_id, second.prefill_engine_id} == {"p1", "p2"}
    with pytest.raises(ResourceExhausted):  # 1040 tokens need 65 blocks; no decode engine holds more than 64
        d.state.plan(dpb.PlanTransferRequest(prompt_token_count=1040), None)[0]


def test_planning_refuses_incompatible_and_missing_engines():
    """Pinned unknown engine: NOT_FOUND; layouts or TP sizes that differ: FAILED_PRECONDITION;
    none: RESOURCE_EXHAUSTED."""
    d = Directory()
    with pytest.raises(NotFound):
        d.state.plan(dpb.PlanTransferRequest(prefill_engine_id="ghost"), None)[0]
    d.state.register(register_request("d8", DECODE, layout=make_layout(layer_count=8)))
    with pytest.raises(FailedPrecondition):
        d.state.plan(dpb.PlanTransferRequest(decode_engine_id="d8"), None)[0]
    d.state.register(register_request("dtp", DECODE, tp_size=2))
    with pytest.raises(FailedPrecondition):  # only rank 0 of 2 registered
        d.state.plan(dpb.PlanTransferRequest(decode_engine_id="dtp"), None)[0]
    empty = DirectoryState(Limits(), ManualClock().clock())
    with pytest.raises(ResourceExhausted):
        empty.plan(dpb.PlanTransferRequest(), None)
    with pytest.raises(InvalidArgument):
        d.state.plan(dpb.PlanTransferRequest(), 10_000.0)[0]


def test_transfer_cap_per_engine():
    """The per-engine active transfer cap refuses further plans with RESOURCE_EXHAUSTED until one ends."""
    d = Directory(Limits(max_active_transfers_per_engine=2))
    first, _ = d.plan(), d.plan()
    with pytest.raises(ResourceExhausted):
        d.plan()
    d.state.cancel(first, "")
    d.plan()


def test_retention_and_listing():
    """Terminal transfers beyond the retention cap are forgotten; listing pages newest first with filters."""
    d = Directory(Limits(retained_terminal_transfers=3))
    ids = [d.plan() for _ in range(6)]
    for tid in ids[:5]:
        d.state.cancel(tid, "")
    with pytest.raises(NotFound):
        d.state.get_transfer(ids[0])
    page, token = d.state.list_transfers(2, "", 0, "")
    assert [r.transfer_id for r in page] == [ids[5], ids[4]]
    page, token = d.state.list_transfers(2, token, 0, "")
    assert [r.transfer_id for r in page] == [ids[3], ids[2]] and token == ""
    live, _ = d.state.list_transfers(10, "", S.TRANSFER_STATE_PLANNED, "d1")
    assert [r.transfer_id for r in live] == [ids[5]]
    with pytest.raises(InvalidArgument):
        d.state.list_transfers(2, "garbage", 0, "")


def test_watch_log_is_bounded_and_reports_gaps():
    """The watch log keeps the newest events; resuming from a dropped or future number is OUT_OF_RANGE."""
    d = Directory(Limits(retained_watch_events_per_engine=2))
    for _ in range(4):
        d.state.cancel(d.plan(), "")
    assert [e.sequence_number for e in d.events()] == [3, 4]
    assert [e.sequence_number for e in d.events(3)] == [4]
    with pytest.raises(OutOfRange):
        d.events(1)
    with pytest.raises(OutOfRange):
        d.events(99)
    with pytest.raises(NotFound):
        d.state.watch_events("p1", 0)


def test_worker_listing_pages():
    """Workers list by (engine, rank) across pages and filter by role."""
    d = Directory(tp_size=2)
    page, token = d.state.list_workers(3, "", 0)
    assert [(w.engine_id, w.tp_rank) for w in page] == [("d1", 0), ("d1", 1), ("p1", 0)]
    page, token = d.state.list_workers(3, token, 0)
    assert [(w.engine_id, w.tp_rank) for w in page] == [("p1", 1)] and token == ""
    page, _ = d.state.list_workers(10, "", PREFILL)
    assert {w.engine_id for w in page} == {"p1"}


def test_watch_log_of_a_gone_engine_is_kept_for_a_while_then_dropped():
    """A lapsed decode engine's events stay replayable for the retention period, then the log is freed."""
    d = Directory(Limits(lease_ttl_s=10, gone_engine_log_retention_s=60))
    d.state.cancel(d.plan(), "")
    d.time.advance(11)
    d.state.reap()
    assert [e.sequence_number for e in d.events()] == [1]
    worker, _ = d.state.register(register_request("d1", DECODE))  # back in time: history kept
    assert [e.sequence_number for e in d.events()] == [1]
    d.state.deregister("d1", 0, worker.lease_id)
    d.time.advance(61)
    d.state.reap()
    with pytest.raises(NotFound):
        d.events()


def test_a_directory_stall_extends_leases_but_not_transfer_deadlines():
    """After a 30 s gap between reaps, leases are extended by the gap; transfer deadlines still expire."""
    d = Directory(Limits(lease_ttl_s=10, transfer_ttl_s=20, reap_stall_threshold_s=2))
    tid = d.plan()
    d.state.reap()
    d.time.advance(30)
    effects = d.state.reap()
    assert effects.stall_s == 30
    assert d.state.get_engine("p1") and d.state.get_engine("d1")
    assert d.transfer(tid).state == S.TRANSFER_STATE_EXPIRED
    for _ in range(25):  # regular reaps, no renewals: the extended leases lapse 10 s later
        d.time.advance(0.5)
        assert d.state.reap().stall_s == 0
    with pytest.raises(NotFound):
        d.state.get_engine("p1")


def test_an_unreachable_engine_is_not_planned_until_it_renews():
    """A reported engine is left out of plans (another is chosen) until its next renewal; when every
    candidate is reported, a reported one is planned rather than none; pinned plans still get it."""
    d = Directory()
    d2, _ = d.state.register(register_request("d2", DECODE))
    tid = d.plan()
    first = d.transfer(tid).decode_engine_id
    other = "d2" if first == "d1" else "d1"
    assert d.state.report_unreachable(first, tid, "connection refused") is True
    assert d.state.unreachable_report(first).reason == "connection refused"
    assert {d.transfer(d.plan()).decode_engine_id for _ in range(5)} == {other}
    assert d.transfer(d.plan(decode_engine_id=first)).decode_engine_id == first
    d.state.report_unreachable(other, "", "probe failed")
    assert {d.transfer(d.plan()).decode_engine_id for _ in range(3)} <= {"d1", "d2"}
    lease = d.leases[("d1", 0)] if first == "d1" else d2.lease_id
    d.state.renew(lease, None)
    assert d.state.unreachable_report(first) is None
    assert {d.transfer(d.plan()).decode_engine_id for _ in range(3)} == {first}


def test_unreachable_reports_are_checked_and_stale_ones_ignored():
    """Unknown engines and transfers are NOT_FOUND, a transfer that does not name the engine is
    FAILED_PRECONDITION (nothing marked), and a report about a registration older than the engine's
    current one (it restarted after the plan) changes nothing."""
    d = Directory()
    tid = d.plan()
    with pytest.raises(NotFound):
        d.state.report_unreachable("ghost", "", "x")
    with pytest.raises(NotFound):
        d.state.report_unreachable("d1", "f" * 32, "x")
    d.state.register(register_request("d2", DECODE))
    with pytest.raises(FailedPrecondition):
        d.state.report_unreachable("d2", tid, "x")
    assert d.state.unreachable_report("d2") is None
    d.time.advance(6)
    d.state.renew(d.leases[("p1", 0)], None)
    d.time.advance(6)  # d1 (the transfer's decode engine) lapses, then registers again: a restart
    d.state.reap()
    assert d.transfer(tid).state == S.TRANSFER_STATE_FAILED
    d.state.register(register_request("d1", DECODE))
    assert d.state.report_unreachable("d1", tid, "refused") is False
    assert d.state.unreachable_report("d1") is None


def test_first_token_from_prefill_travels_with_complete():
    """A DONE carrying prefill's first token: the record and the COMPLETE event carry it to decode; a failed
    transfer's event never does; a token on a non-DONE result or a rank disagreeing is refused, changing nothing."""
    d = Directory(tp_size=2)
    tid = d.allocated()
    d.ready(tid, 0, 4)
    d.ready(tid, 0, 4, rank=1)
    with pytest.raises(InvalidArgument, match="only with"):
        d.state.report_result("p1", 0, result(tid, PROGRESS, first_token_id=7))
    d.state.report_result("p1", 0, result(tid, DONE, first_token_id=7))
    with pytest.raises(InvalidArgument, match="another rank reported 7"):
        d.state.report_result("p1", 1, result(tid, DONE, first_token_id=8))
    assert d.transfer(tid).state == S.TRANSFER_STATE_STREAMING and d.events() == []
    d.state.report_result("p1", 1, result(tid, DONE, first_token_id=7))
    (event,) = d.events()
    assert event.state == S.TRANSFER_STATE_COMPLETE and event.HasField("first_token_id") and event.first_token_id == 7
    assert d.transfer(tid).to_proto().first_token_id == 7


def test_complete_without_first_token_has_none_and_failure_drops_it():
    """A plain DONE leaves first_token_id unset (token 0 is a real token, so presence is what counts)."""
    d = Directory()
    plain = d.allocated()
    d.ready(plain, 0, 4)
    d.state.report_result("p1", 0, result(plain, DONE))
    failed = d.plan()
    d.state.report_allocation(allocation(failed, block_ids=(4, 5, 6)))
    d.ready(failed, 0, 4)
    d.state.report_result("p1", 0, result(failed, FAILED, error="post failed"))
    events = d.events()
    assert [e.HasField("first_token_id") for e in events] == [False, False]
    assert not d.transfer(plain).to_proto().HasField("first_token_id")
