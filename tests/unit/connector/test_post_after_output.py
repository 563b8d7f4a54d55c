"""post_after_output: where the prefill scheduler and its one worker share a process, a launch-bound step posts
nothing while it runs and pushes once its output left; a step whose GPU fell behind streams as before.

The worker is the GPU worker of test_prefill_worker (numbered objects for CUDA events, the owner loop run by
hand); the scheduler half's step FIFO and the offer/claim hand-over are the real ones.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from kvpush.connector.config import ConnectorConfig
from kvpush.connector.metadata import KVPushMetadata
from kvpush.connector.output_signal import claim_prefill_worker, offer_prefill_worker
from kvpush.connector.scheduler.prefill import PrefillScheduler
from tests.unit.connector.test_prefill_worker import LAYERS, _instruction, _step, _worker


def _deferring(**extra):
    worker, transport, directory, loop = _worker(**extra)
    assert worker.defers_to_output()
    return worker, transport, directory, loop


def _launch_bound_step(worker, seq: int) -> None:
    meta = _step(40)
    meta.step_seq = seq
    worker.begin_step(meta)
    worker.on_instruction(_instruction(40))
    for name in LAYERS:
        worker.save_kv_layer(name)
    worker.wait_for_save()


def test_a_launch_bound_step_posts_nothing_until_its_output_left_then_pushes_every_layer():
    worker, transport, directory, loop = _deferring()
    _launch_bound_step(worker, seq=1)
    assert len(loop.posted) == 3, "StepStarted, the instruction, the deferred step at wait_for_save: no layer post"
    assert len(worker.recorded_events) == 2, "the first layer's event (the probe) and wait_for_save's"
    loop.run()
    assert transport.writes == [] and directory.session.ready == []
    worker.output_left(1)
    assert len(loop.posted) == 1, "the owner hears of the output once"
    loop.run(now=time.monotonic())  # the owner applies it output_grace_s after the output left
    loop.run(now=time.monotonic() + 0.001)
    assert [(layer, start, end) for layer, start, end, *_ in transport.writes] == [(0, 0, 40), (1, 0, 40), (2, 0, 40)]
    events = {event for *_, event, _ in transport.writes}
    assert events == {worker.recorded_events[1]}, "every layer waits for the event recorded after the forward"
    assert [(e.layer_start, e.layer_end) for e in directory.session.ready] == [(0, 1), (0, 3)]
    worker.output_left(1)
    assert loop.posted == [], "a step's output is signalled once"


def test_output_left_of_an_earlier_step_leaves_a_later_deferred_step_waiting():
    worker, transport, _directory, loop = _deferring(output_grace_s=0.0)
    _launch_bound_step(worker, seq=7)
    loop.run()
    worker.output_left(6)
    assert loop.posted == []
    worker.output_left(7)
    loop.run()
    assert len(transport.writes) == 3


def test_a_deferred_step_whose_output_never_leaves_is_pushed_after_max_output_wait_s():
    worker, transport, _directory, loop = _deferring(max_output_wait_s=0.05)
    _launch_bound_step(worker, seq=1)
    loop.run(now=time.monotonic() + 0.04)
    assert transport.writes == []
    loop.run(now=time.monotonic() + 0.06)
    assert len(transport.writes) == 3


def test_a_step_whose_gpu_fell_behind_streams_from_layer_one_with_layer_zero_in_its_post():
    worker, transport, directory, loop = _deferring()
    worker.gpu_caught_up = False
    meta = _step(40)
    meta.step_seq = 1
    worker.begin_step(meta)
    worker.on_instruction(_instruction(40))
    worker.save_kv_layer(LAYERS[0])
    loop.run()
    assert transport.writes == [], "layer 0 is held: its event is the probe"
    worker.save_kv_layer(LAYERS[1])
    loop.run()
    assert [layer for layer, *_ in transport.writes] == [0, 1]
    assert [(e.layer_start, e.layer_end) for e in directory.session.ready] == [(0, 1)]
    worker.save_kv_layer(LAYERS[2])
    worker.wait_for_save()
    loop.run()
    assert [layer for layer, *_ in transport.writes] == [0, 1, 2], "a step that posted is not deferred"
    worker.output_left(1)
    assert loop.posted == []


def test_a_hold_for_a_deferred_prompt_applies_the_deferred_step_first():
    """The hold can come before the owner applied the step (the grace not yet over): the step goes first, so the
    held transfer is fully computed and pushes, rather than failing as a prompt that finished uncomputed."""
    worker, transport, directory, loop = _deferring(output_grace_s=0.1)
    _launch_bound_step(worker, seq=1)
    worker.output_left(1)
    worker.begin_step(KVPushMetadata(held_prefills=["r1"], step_seq=2))
    loop.run()
    assert [layer for layer, *_ in transport.writes] == [0, 1, 2]
    assert directory.session.results == []  # nothing failed; DONE comes with the writes' outcomes


def test_engines_not_deferring_keep_the_step_streamed():
    worker, transport, _directory, loop = _worker(post_after_output=False)  # defers_to_output never asked
    _launch_bound_step(worker, seq=1)
    loop.run()
    assert len(transport.writes) == 3


def test_the_scheduler_signals_each_steps_output_once_in_step_order():
    config = ConnectorConfig.from_extra_config({"directory_address": "127.0.0.1:1"}, role="prefill", engine_id="p")
    scheduler = PrefillScheduler(config, 16)
    left: list[int] = []
    scheduler.on_output_leaving = left.append
    empty = SimpleNamespace(total_num_scheduled_tokens=0, preempted_req_ids=None, scheduled_new_reqs=[],
                            scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[]),
                            num_scheduled_tokens={}, finished_req_ids=set())
    seqs = [scheduler.build_connector_meta(empty).step_seq for _ in range(2)]
    scheduler.step_output_processed()
    seqs.append(scheduler.build_connector_meta(empty).step_seq)
    scheduler.step_output_processed()
    scheduler.step_output_processed()
    scheduler.step_output_processed()  # nothing left unprocessed: no signal
    assert seqs == [1, 2, 3] and left == [1, 2, 3]


def test_a_worker_offered_once_is_claimed_once_and_two_offers_are_ambiguous():
    first, second = object(), object()
    offer_prefill_worker("engine-a", first)
    assert claim_prefill_worker("engine-a") is first
    assert claim_prefill_worker("engine-a") is None
    offer_prefill_worker("engine-b", first)
    offer_prefill_worker("engine-b", second)
    assert claim_prefill_worker("engine-b") is None
