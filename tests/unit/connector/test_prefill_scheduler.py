"""The prefill scheduler half with vLLM's own Request / SchedulerOutput objects: chunks and their block ids
over a chunked prefill, the hold at request_finished, worker timelines reaching the response's params, and
the release."""

from __future__ import annotations

import dataclasses
import json

from vllm import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvpush.connector.config import ConnectorConfig
from kvpush.connector.metadata import KVPushWorkerMetadata, TimelineReport
from kvpush.connector.scheduler.prefill import PrefillScheduler
from kvpush.connector.worker.push_state import PushTimeline

BS = 16


def _scheduler() -> PrefillScheduler:
    config = ConnectorConfig.from_extra_config({"directory_address": "127.0.0.1:1"}, role="prefill", engine_id="p")
    return PrefillScheduler(config, BS)


def _request(prompt: int = 40) -> Request:
    params = {"transfer_id": "t1", "do_remote_decode": True}
    return Request(request_id="r1", prompt_token_ids=list(range(prompt)), pooling_params=None,
                   sampling_params=SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}))


def _output(tokens: int, new: Request | None = None, new_blocks: list[int] | None = None,
            cached_blocks: list[int] | None = None) -> SchedulerOutput:
    output = SchedulerOutput.make_empty()
    scheduled_new = [NewRequestData.from_request(new, (new_blocks,))] if new is not None else []
    cached = CachedRequestData.make_empty()
    if cached_blocks is not None:
        cached = dataclasses.replace(cached, req_ids=["r1"], new_block_ids=[(cached_blocks,)],
                                     new_token_ids=[[]], all_token_ids={}, num_computed_tokens=[32],
                                     num_output_tokens=[0])
    return dataclasses.replace(output, scheduled_new_reqs=scheduled_new, scheduled_cached_reqs=cached,
                               num_scheduled_tokens={"r1": tokens}, total_num_scheduled_tokens=tokens)


def test_chunked_prefill_is_held_then_released_with_the_workers_timeline():
    """Two chunks (32 + 8 tokens) name the blocks holding tokens [0, token_end); the finished request is held and
    announced to the workers; a timeline reported in the finishing step lands in the response's params, combined
    over ranks; finished_sending releases the hold."""
    scheduler, request = _scheduler(), _request()
    scheduler.on_new_request(request)
    first = scheduler.build_connector_meta(_output(32, new=request, new_blocks=[7, 3]))
    ((chunk,),) = [first.prefill_chunks]
    assert (chunk.token_start, chunk.token_end, chunk.block_ids, chunk.cached_token_count) == (0, 32, (7, 3), 0)
    request.num_computed_tokens = 32
    second = scheduler.build_connector_meta(_output(8, cached_blocks=[9]))
    ((chunk,),) = [second.prefill_chunks]
    assert (chunk.token_start, chunk.token_end, chunk.block_ids, chunk.is_last) == (32, 40, (7, 3, 9), True)
    held, params = scheduler.request_finished(request, [7, 3, 9])
    assert held and params["transfer_id"] == "t1" and params["push_timeline"]["chunk_count"] == 2
    timelines = {"r1": {0: TimelineReport(PushTimeline(write_count=3, bytes_written=30, prefill_end_time=5.0,
                                                       state="done")),
                        1: TimelineReport(PushTimeline(write_count=3, bytes_written=30, prefill_end_time=6.0,
                                                       state="done"))}}
    scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=KVPushWorkerMetadata(timelines)))
    assert (params["push_timeline"]["write_count"], params["push_timeline"]["bytes_written"],
            params["push_timeline"]["prefill_end_time"]) == (6, 60, 6.0)
    assert scheduler.has_pending_push_work()
    assert scheduler.build_connector_meta(_output(0)).held_prefills == ["r1"]
    scheduler.update_connector_output(KVConnectorOutput(finished_sending={"r1"}))
    assert not scheduler.has_pending_push_work() and scheduler.held_request_count() == 0


def test_a_request_that_never_reached_the_workers_is_not_held():
    """Finished before any chunk was scheduled: nothing can read its blocks, so they are not held."""
    scheduler, request = _scheduler(), _request()
    scheduler.on_new_request(request)
    held, params = scheduler.request_finished(request, [])
    assert not held and params["transfer_id"] == "t1" and not scheduler.has_pending_push_work()


def test_a_first_token_leg_hands_its_sampled_token_to_the_workers_with_the_hold():
    """first_token_from_prefill: chunks say the transfer reports the token; the hold carries the token vLLM
    appended before finishing the request; a plain leg's hold carries none."""
    scheduler, request = _scheduler(), _request()
    request.kv_transfer_params["first_token_from_prefill"] = True
    scheduler.on_new_request(request)
    (chunk,) = scheduler.build_connector_meta(_output(40, new=request, new_blocks=[7, 3, 9])).prefill_chunks
    assert chunk.sends_first_token
    request.append_output_token_ids(1234)
    held, _ = scheduler.request_finished(request, [7, 3, 9])
    meta = scheduler.build_connector_meta(_output(0))
    assert held and meta.held_prefills == ["r1"] and meta.first_tokens == {"r1": 1234}
    assert scheduler.build_connector_meta(_output(0)).first_tokens == {}

    plain_scheduler, plain = _scheduler(), _request()
    plain_scheduler.on_new_request(plain)
    (chunk,) = plain_scheduler.build_connector_meta(_output(40, new=plain, new_blocks=[7, 3, 9])).prefill_chunks
    assert not chunk.sends_first_token
    plain.append_output_token_ids(1234)
    plain_scheduler.request_finished(plain, [7, 3, 9])
    assert plain_scheduler.build_connector_meta(_output(0)).first_tokens == {}


def test_the_response_push_timeline_keeps_its_json_shape_with_unknown_counts_null():
    """The CPU hook saw prefill end before any push owner published a timeline: the response's push timeline says
    when prefill ended and leaves every count null (not zero writes); its keys keep their order, the push's first,
    then this half's own."""
    scheduler, request = _scheduler(), _request()
    scheduler.on_new_request(request)
    scheduler.build_connector_meta(_output(40, new=request, new_blocks=[7, 3, 9]))
    report = KVPushWorkerMetadata({"r1": {0: TimelineReport(hook_prefill_end_time=5.0)}})
    scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=report))
    held, params = scheduler.request_finished(request, [7, 3, 9])
    timeline = params["push_timeline"]
    assert held and list(timeline) == [
        "first_write_start_time", "last_write_end_time", "prefill_end_time", "post_duration_s", "write_count",
        "descriptor_count", "bytes_written", "writes_before_prefill_end_count",
        "layers_written_before_prefill_end_count", "state", "reason", "settled", "prefill_start_time",
        "cached_token_count", "chunk_count", "request_finished_time"]
    assert timeline["prefill_end_time"] == 5.0 and timeline["chunk_count"] == 1 and timeline["cached_token_count"] == 0
    assert [timeline[key] for key in ("write_count", "bytes_written", "state", "settled")] == [None] * 4
    json.dumps(params)  # vLLM serializes it as it is
