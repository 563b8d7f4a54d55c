"""The connector's metrics read typed push timelines: only the one settled timeline of a push counts it."""

from __future__ import annotations

from kvpush.connector import metrics
from kvpush.connector.metadata import TimelineReport
from kvpush.connector.worker.push_state import PushTimeline


def _sample(name: str, engine_id: str, **labels: str) -> float | None:
    return metrics.registry().get_sample_value(name, {"engine_id": engine_id, "role": "prefill", "tp_rank": "0",
                                                      **labels})


def test_a_settled_done_timeline_counts_the_push_its_duration_and_its_exposed_tail():
    worker = metrics.WorkerMetrics("metrics-engine-a", "prefill", 0)
    settled = PushTimeline(first_write_start_time=10.0, last_write_end_time=10.5, state="done", settled=True)
    worker.on_timelines({
        "snapshot": TimelineReport(PushTimeline(state="active")),        # still going: not counted
        "hook-only": TimelineReport(hook_prefill_end_time=9.0),          # no timeline yet: not counted
        "done": TimelineReport(settled, hook_prefill_end_time=10.25),    # prefill end from the hook
        "failed": TimelineReport(PushTimeline(state="failed", settled=True)),
    })
    assert _sample("kvpush_connector_pushes_total", "metrics-engine-a", state="done") == 1.0
    assert _sample("kvpush_connector_pushes_total", "metrics-engine-a", state="failed") == 1.0
    assert _sample("kvpush_connector_push_duration_seconds_sum", "metrics-engine-a") == 0.5
    assert _sample("kvpush_connector_exposed_tail_seconds_sum", "metrics-engine-a") == 0.25
    assert _sample("kvpush_connector_exposed_tail_seconds_count", "metrics-engine-a") == 1.0
