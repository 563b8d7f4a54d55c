"""Unit tests of what directory replicas add to the state machine and the shard helpers (no etcd, no gRPC server).

`DirectoryState` hooks: `mirror_register`/`mirror_remove` (registrations from etcd), `report_allocation(
hold_dispatch=True)` + `release_dispatch`, `adopt` (a shard taken over), `forget` (a shard lost);
`StoredTransfer` JSON; `shards` hashing and the ErrorInfo redirect.
"""

from __future__ import annotations

import grpc
import pytest

from kvpush.api.shards import (
    SHARD_NOT_OWNED,
    STATUS_DETAILS_KEY,
    ShardRedirect,
    redirect_of_status,
    shard_of,
    status_trailer,
)
from kvpush.directory.errors import FailedPrecondition, NotFound
from kvpush.directory.records import Allocation, StoredTransfer
from kvpush.directory.state import DirectoryState, Limits
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import DECODE, PREFILL, ManualClock, allocation, ready, register_request, result

REASON = "directory shard 3 moved to replica b while the transfer was in flight"


def mirrored() -> tuple[DirectoryState, ManualClock]:
    clock = ManualClock()
    state = DirectoryState(Limits(lease_ttl_s=10, transfer_ttl_s=60), clock.clock())
    state.mirror_register(register_request("p1", PREFILL), "key-p1")
    state.mirror_register(register_request("d1", DECODE), "key-d1")
    return state, clock


def outbox(state: DirectoryState, engine_id: str = "p1") -> list[dpb.StreamPrefillResponse]:
    worker = state.engines.groups[engine_id].workers[0]
    messages = list(worker.outbox)
    worker.outbox.clear()
    return messages


def test_mirrored_registrations_never_lapse_in_the_reaper():
    state, clock = mirrored()
    clock.advance(3600)
    state.reap()
    assert state.lease_holder("key-p1").engine_id == "p1"  # only etcd ends it
    assert state.is_decode_engine("d1")


def test_mirror_register_is_idempotent_and_a_new_agent_replaces_the_worker():
    state, _ = mirrored()
    transfer_id = state.plan(dpb.PlanTransferRequest(), None)[0].transfer_id
    assert not state.mirror_register(register_request("d1", DECODE), "key-d1")  # the watch echo: nothing
    assert state.get_transfer(transfer_id).state == tpb.TRANSFER_STATE_PLANNED
    effects = state.mirror_register(register_request("d1", DECODE, agent_name="d1-new"), "key-d1b")
    assert "d1" in effects.watch_engines
    assert state.get_transfer(transfer_id).state == tpb.TRANSFER_STATE_FAILED
    assert state.lease_holder("key-d1b").agent_name == "d1-new"
    assert state.check_invariants() == []


def test_mirror_remove_fails_the_engines_transfers():
    state, _ = mirrored()
    transfer_id = state.plan(dpb.PlanTransferRequest(), None)[0].transfer_id
    state.mirror_remove("d1", 0, "engine d1 rank 0 lease expired or revoked")
    record = state.get_transfer(transfer_id)
    assert record.state == tpb.TRANSFER_STATE_FAILED and "lease expired" in record.failure_reason
    with pytest.raises(NotFound):
        state.lease_holder("key-d1")


def test_held_dispatch_goes_out_only_when_released():
    state, _ = mirrored()
    transfer_id = state.plan(dpb.PlanTransferRequest(), None)[0].transfer_id
    state.report_ready("p1", 0, [ready(transfer_id, 0, 2)])
    record, effects = state.report_allocation(allocation(transfer_id), hold_dispatch=True)
    assert record.dispatch_held and not record.dispatched and not effects.prefill_outboxes
    state.report_ready("p1", 0, [ready(transfer_id, 2, 4)])  # readiness does not bypass the hold
    assert not record.dispatched and outbox(state) == []
    effects = state.release_dispatch(record)
    assert record.dispatched and ("p1", 0) in effects.prefill_outboxes
    assert [m.WhichOneof("message") for m in outbox(state)] == ["instruction"]
    assert not state.release_dispatch(record)  # once


def stored(transfer_id: str = "t-1", with_blocks: bool = True, deadline_wall: float = 1_700_001_060.0):
    return StoredTransfer(
        transfer_id=transfer_id, request_id="r", prefill_engine_id="p1", decode_engine_id="d1", tp_size=1,
        layer_count=4, trace_context="", create_wall=1_700_001_000.0, deadline_wall=deadline_wall,
        plan_prompt_token_count=40,
        allocation=Allocation((1, 2, 3), 40, 0) if with_blocks else None,
        owned_blocks=(1, 2, 3) if with_blocks else ())


def test_stored_transfer_round_trips_through_json():
    for value in (stored(), stored(with_blocks=False)):
        assert StoredTransfer.from_json(value.to_json()) == value


def test_adopted_planned_transfer_goes_on_here():
    state, _ = mirrored()
    state.adopt(stored(with_blocks=False), in_flight_bound_s=10, reason=REASON)
    state.report_allocation(allocation("t-1"))
    state.report_ready("p1", 0, [ready("t-1", 0, 4)])
    assert [m.WhichOneof("message") for m in outbox(state)] == ["instruction"]
    state.report_result("p1", 0, result("t-1", dpb.WRITE_RESULT_STATUS_DONE, layers=4))
    assert state.get_transfer("t-1").state == tpb.TRANSFER_STATE_COMPLETE
    assert state.check_invariants() == []


def test_adopted_in_flight_transfer_fails_only_after_prefill_confirmed():
    state, _ = mirrored()
    effects = state.adopt(stored(), in_flight_bound_s=10, reason=REASON)
    assert ("p1", 0) in effects.prefill_outboxes
    assert [m.cancellation.transfer_id for m in outbox(state)] == ["t-1"]
    record = state.get_transfer("t-1")
    assert not record.terminal  # decode keeps its blocks while a write may land
    other = state.plan(dpb.PlanTransferRequest(), None)[0].transfer_id
    with pytest.raises(FailedPrecondition, match="block 3 is already allocated"):  # adopted blocks stay owned
        state.report_allocation(allocation(other, block_ids=(3, 4, 5)))
    state.report_result("p1", 0, result("t-1", dpb.WRITE_RESULT_STATUS_CANCELLED))
    assert record.state == tpb.TRANSFER_STATE_FAILED and record.failure_reason == REASON
    assert state.check_invariants() == []


def test_adopted_in_flight_transfer_is_bounded():
    """A prefill that never confirms: its lease is revoked after lease TTL + max_write_s, the transfer ends
    once that revoked lease's write fence passed (no block released while a write could land)."""
    state, clock = mirrored()
    state.adopt(stored(), in_flight_bound_s=10, reason=REASON)
    bound = state.limits.lease_ttl_s + state.limits.max_write_s
    clock.advance(bound + 0.5)
    state.reap()
    assert not state.get_transfer("t-1").terminal  # revoked now; its writes may still land until the fence
    clock.advance(bound + 0.5)
    state.reap()
    record = state.get_transfer("t-1")
    assert record.state == tpb.TRANSFER_STATE_FAILED and record.failure_reason == REASON


def test_adopting_a_transfer_of_a_gone_prefill_ends_it_once_no_write_can_land():
    state, clock = mirrored()
    state.mirror_remove("p1", 0, "gone")
    state.adopt(stored(), in_flight_bound_s=10, reason=REASON)
    assert not state.get_transfer("t-1").terminal  # its last posted WRITE may land for max_write_s
    clock.advance(state.limits.max_write_s + 0.5)
    state.reap()
    assert state.get_transfer("t-1").state == tpb.TRANSFER_STATE_FAILED
    state.adopt(stored("t-2", with_blocks=False), in_flight_bound_s=10, reason=REASON)
    assert state.get_transfer("t-2").state == tpb.TRANSFER_STATE_FAILED  # nothing dispatched: at once


def test_forget_drops_without_telling_anyone():
    state, _ = mirrored()
    transfer_id = state.plan(dpb.PlanTransferRequest(), None)[0].transfer_id
    state.report_allocation(allocation(transfer_id))
    state.report_ready("p1", 0, [ready(transfer_id, 0, 4)])
    assert state.forget([transfer_id]) == 1
    assert outbox(state) == []  # the queued instruction is withdrawn too
    assert state.watch_events("d1", 0) == []
    with pytest.raises(NotFound):
        state.get_transfer(transfer_id)
    assert state.active_transfer_count("d1") == 0 and state.check_invariants() == []


def test_new_transfer_id_is_the_minting_hook():
    state, _ = mirrored()
    state.new_transfer_id = lambda: "minted-here"
    assert state.plan(dpb.PlanTransferRequest(), None)[0].transfer_id == "minted-here"


def test_shard_of_is_stable_and_spread():
    assert shard_of("abc", 16) == shard_of("abc", 16)
    import uuid

    counts = [0] * 8
    for _ in range(8000):
        counts[shard_of(uuid.uuid4().hex, 8)] += 1
    assert min(counts) > 800


def test_redirect_round_trips_through_the_status_trailer():
    redirect = ShardRedirect(SHARD_NOT_OWNED, 5, 16, "r2", "10.0.0.2:50051")
    (key, value), = status_trailer(grpc.StatusCode.FAILED_PRECONDITION, "not here", redirect)
    assert key == STATUS_DETAILS_KEY
    from google.rpc import status_pb2

    status = status_pb2.Status.FromString(value)
    assert status.code == grpc.StatusCode.FAILED_PRECONDITION.value[0] and status.message == "not here"
    assert redirect_of_status(status) == redirect
    assert redirect_of_status(status_pb2.Status(code=9, message="plain")) is None
