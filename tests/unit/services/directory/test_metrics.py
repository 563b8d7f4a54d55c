"""DirectoryMetrics fed by a real DirectoryState: ends are counted by state and bounded cause, lease expiries by
role."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvpush.directory.metrics import CAUSES, DirectoryMetrics, failure_cause
from kvpush.directory.state import DirectoryState, Limits
from kvpush.v1 import directory_pb2 as dpb
from tests.fixtures.directory import DECODE, PREFILL, ManualClock, register_request


def _samples(metrics: DirectoryMetrics) -> dict[tuple[str, tuple], float]:
    families = text_string_to_metric_families(metrics.exposition().decode())
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def _state() -> tuple[DirectoryState, DirectoryMetrics, ManualClock]:
    clock = ManualClock()
    metrics = DirectoryMetrics()
    state = DirectoryState(Limits(lease_ttl_s=10.0), clock.clock(), metrics)
    metrics.bind(state, None)
    state.register(register_request("p1", PREFILL))
    state.register(register_request("d1", DECODE))
    return state, metrics, clock


def test_lease_expiry_counts_the_role_and_fails_the_transfer_with_its_cause():
    """A decode lease lapsing is one decode lease expiry, and its live transfer ends failed/lease_expired."""
    state, metrics, clock = _state()
    state.plan(dpb.PlanTransferRequest(request_id="r"), None)[0]
    clock.advance(5.0)
    state.renew(state.get_engine("p1")[0].lease_id, None)
    clock.advance(6.0)
    metrics.on_reap(state.reap())
    samples = _samples(metrics)
    assert samples[("kvpush_directory_lease_expiries_total", (("role", "decode"),))] == 1
    assert samples[("kvpush_directory_transfers_ended_total", (("cause", "lease_expired"), ("state", "failed")))] == 1
    assert samples[("kvpush_directory_live_transfers", (("state", "planned"),))] == 0
    assert samples[("kvpush_directory_workers", (("role", "decode"),))] == 0


def test_cancel_and_expiry_have_their_causes_and_live_gauges_follow():
    """A cancelled transfer ends cancelled/cancelled; one past its deadline expired/deadline; gauges read live state."""
    state, metrics, clock = _state()
    cancelled = state.plan(dpb.PlanTransferRequest(request_id="a"), None)[0]
    state.plan(dpb.PlanTransferRequest(request_id="b"), 1.0)[0]
    assert _samples(metrics)[("kvpush_directory_live_transfers", (("state", "planned"),))] == 2
    state.cancel(cancelled.transfer_id, "client went away")
    clock.advance(2.0)
    state.renew(state.get_engine("p1")[0].lease_id, None)
    state.renew(state.get_engine("d1")[0].lease_id, None)
    metrics.on_reap(state.reap())
    samples = _samples(metrics)
    assert samples[("kvpush_directory_transfers_planned_total", ())] == 2
    assert samples[("kvpush_directory_transfers_ended_total", (("cause", "cancelled"), ("state", "cancelled")))] == 1
    assert samples[("kvpush_directory_transfers_ended_total", (("cause", "deadline"), ("state", "expired")))] == 1
    assert samples[("kvpush_directory_live_transfers", (("state", "planned"),))] == 0


def test_causes_are_a_closed_set():
    """Whatever the reason text, the cause label is one of CAUSES (or none for COMPLETE)."""
    state, _, _ = _state()
    record = state.plan(dpb.PlanTransferRequest(), None)[0]
    for reason in ("rank 0 write failed: NIXL_ERR_REMOTE_DISCONNECT", "prefill stream broken", "free-form text",
                   "engine p1 rank 0 deregistered", "engine d1 rank 0 lease expired"):
        record.state, record.failure_reason = 5, reason  # FAILED
        assert failure_cause(record) in CAUSES
    record.failure_reason = "rank 0 write failed: x"
    assert failure_cause(record) == "write_failed"


def test_refusals_and_queued_rejections_are_exported():
    """The servicer's rate-limited refusal log counts every refusal by kind; the queued rejections are a gauge."""
    from kvpush.directory.servicer import DirectoryServicer

    clock = ManualClock()
    metrics = DirectoryMetrics()
    state = DirectoryState(Limits(), clock.clock(), metrics)
    servicer = DirectoryServicer(state)
    metrics.bind(state, servicer)
    for _ in range(30):  # more than one window's worth of log lines: all counted
        servicer.refusals.info("event", "event rejected", transfer_id="t")
    servicer.refusals.info("plan", "plan refused")
    servicer.pending_rejection_count = 7
    samples = _samples(metrics)
    assert samples[("kvpush_directory_refusals_total", (("kind", "event"),))] == 30
    assert samples[("kvpush_directory_refusals_total", (("kind", "plan"),))] == 1
    assert samples[("kvpush_directory_queued_rejections", ())] == 7
