"""Worker metadata between the halves: timelines travel by rank and combine by explicit rules."""

from __future__ import annotations

import pickle

from kvpush.connector.config import ConnectorConfig
from kvpush.connector.halves import SchedulerHalf
from kvpush.connector.metadata import KVPushWorkerMetadata, TimelineReport, combine_rank_timelines
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
    mine = KVPushWorkerMetadata({"r": {0: TimelineReport(rank0)}})
    other = KVPushWorkerMetadata({"r": {1: TimelineReport(rank1)}})
    combined = combine_rank_timelines(mine.aggregate(other).timelines["r"])
    assert combined == {"first_write_start_time": 1.0, "last_write_end_time": 9.0, "prefill_end_time": 8.5,
                        "post_duration_s": 0.75, "write_count": 8, "descriptor_count": 80, "bytes_written": 800,
                        "writes_before_prefill_end_count": 7, "layers_written_before_prefill_end_count": 2,
                        "settled": False, "state": "failed", "reason": "post failed"}
    assert list(combined) == ["first_write_start_time", "last_write_end_time", "prefill_end_time", "post_duration_s",
                              "write_count", "descriptor_count", "bytes_written", "writes_before_prefill_end_count",
                              "layers_written_before_prefill_end_count", "settled", "state", "reason"]


def test_a_newer_snapshot_of_a_rank_replaces_known_values_only():
    """A later report with only the hook's prefill end keeps the rank's earlier counts; a later timeline that does
    not know a time yet keeps the earlier time, and replaces every count."""
    meta = KVPushWorkerMetadata({"r": {0: TimelineReport(PushTimeline(write_count=2, bytes_written=20,
                                                                      first_write_start_time=1.0))}})
    meta.aggregate(KVPushWorkerMetadata({"r": {0: TimelineReport(hook_prefill_end_time=5.0)}}))
    rank = meta.timelines["r"][0]
    assert rank.timeline is not None
    assert (rank.timeline.write_count, rank.timeline.bytes_written, rank.prefill_end_time) == (2, 20, 5.0)
    meta.aggregate(KVPushWorkerMetadata({"r": {0: TimelineReport(PushTimeline(write_count=3, prefill_end_time=6.0))}}))
    assert (rank.timeline.write_count, rank.timeline.bytes_written, rank.timeline.first_write_start_time,
            rank.prefill_end_time) == (3, 0, 1.0, 6.0), "the owner's prefill end takes precedence over the hook's"


def test_ranks_without_a_timeline_yet_add_only_their_prefill_end():
    """Before any push owner published a timeline, the combined timeline knows only when prefill ended: the
    response's counts stay null rather than read as zero writes."""
    by_rank = {0: TimelineReport(hook_prefill_end_time=4.0), 1: TimelineReport(hook_prefill_end_time=4.5)}
    assert combine_rank_timelines(by_rank) == {"prefill_end_time": 4.5}
    by_rank[1] = TimelineReport(PushTimeline(write_count=1, state="active"), hook_prefill_end_time=4.5)
    assert combine_rank_timelines(by_rank)["write_count"] == 1


def test_worker_metadata_survives_pickling():
    """vLLM pickles worker metadata between processes in some executors: the typed timelines come back equal."""
    meta = KVPushWorkerMetadata({"r": {0: TimelineReport(PushTimeline(write_count=2, state="done", settled=True),
                                                         hook_prefill_end_time=3.0)}}, first_tokens={"d": 7})
    back = pickle.loads(pickle.dumps(meta))
    assert back.timelines == meta.timelines and back.first_tokens == {"d": 7}
    assert back.timelines["r"][0].timeline.settled


def test_the_prefill_scheduler_is_a_scheduler_half():
    """The facade's contract holds for the prefill scheduler too."""
    config = ConnectorConfig.from_extra_config({"directory_address": "127.0.0.1:1"}, role="prefill", engine_id="p")
    assert isinstance(PrefillScheduler(config, 16), SchedulerHalf)
