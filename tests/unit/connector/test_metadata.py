"""Worker metadata between the halves: timelines travel by rank and combine by explicit rules."""

from __future__ import annotations

from kvpush.connector.config import ConnectorConfig
from kvpush.connector.halves import SchedulerHalf
from kvpush.connector.metadata import KVPushWorkerMetadata, combine_rank_timelines
from kvpush.connector.scheduler.prefill import PrefillScheduler
from kvpush.connector.worker.push_state import PushTimeline


def test_ranks_combine_earliest_start_latest_end_summed_counts_fewest_layers_worst_state():
    """Two TP ranks of one transfer: each wrote its own heads, so counts and bytes add up; a layer is written
    before prefill end only where both ranks wrote it; one failed rank fails the push."""
    rank0 = PushTimeline(first_write_start_time=2.0, last_write_end_time=9.0, prefill_end_time=8.0,
                         post_duration_s=0.5, write_count=4, descriptor_count=40, bytes_written=400,
                         writes_before_prefill_end_count=3, layers_written_before_prefill_end_count=3, state="done")
    rank1 = PushTimeline(first_write_start_time=1.0, last_write_end_time=7.0, prefill_end_time=8.5,
                         post_duration_s=0.25, write_count=4, descriptor_count=40, bytes_written=400,
                         writes_before_prefill_end_count=4, layers_written_before_prefill_end_count=2,
                         state="failed", reason="post failed")
    mine, other = KVPushWorkerMetadata({"r": {0: rank0.as_dict()}}), KVPushWorkerMetadata({"r": {1: rank1.as_dict()}})
    combined = combine_rank_timelines(mine.aggregate(other).timelines["r"])
    assert combined == {"first_write_start_time": 1.0, "last_write_end_time": 9.0, "prefill_end_time": 8.5,
                        "post_duration_s": 0.75, "write_count": 8, "descriptor_count": 80, "bytes_written": 800,
                        "writes_before_prefill_end_count": 7, "layers_written_before_prefill_end_count": 2,
                        "settled": False, "state": "failed", "reason": "post failed"}


def test_a_newer_snapshot_of_a_rank_replaces_known_values_only():
    """A later partial snapshot (only prefill_end_time known) keeps the rank's earlier counts."""
    meta = KVPushWorkerMetadata({"r": {0: PushTimeline(write_count=2, bytes_written=20).as_dict()}})
    meta.aggregate(KVPushWorkerMetadata({"r": {0: {"prefill_end_time": 5.0, "write_count": None}}}))
    rank = meta.timelines["r"][0]
    assert (rank["write_count"], rank["bytes_written"], rank["prefill_end_time"]) == (2, 20, 5.0)


def test_the_prefill_scheduler_is_a_scheduler_half():
    """The facade's contract holds for the prefill scheduler too."""
    config = ConnectorConfig.from_extra_config({"directory_address": "127.0.0.1:1"}, role="prefill", engine_id="p")
    assert isinstance(PrefillScheduler(config, 16), SchedulerHalf)
