"""The GPU post policy's decisions on plain values: which saved layers go to the owner now and behind which event,
which are held, when the GPU's progress is probed, and which steps wait for their output (and until when)."""

from __future__ import annotations

import itertools

from kvpush.connector.metadata import PrefillChunk
from kvpush.connector.worker.post_policy import DeferredSteps, PostPolicy
from kvpush.connector.worker.push_machine import LayerSaved


class _Gpu:
    """Numbered events, and the probes asked of them: the GPU is caught up unless told otherwise."""

    def __init__(self) -> None:
        self._numbers = itertools.count()
        self.recorded: list[str] = []
        self.probed: list[str | None] = []
        self.caught_up = True

    def record(self) -> str:
        event = f"e{next(self._numbers)}"
        self.recorded.append(event)
        return event

    def is_computed(self, event: object) -> bool:
        assert isinstance(event, str)
        self.probed.append(event)
        return self.caught_up


def _policy(layers: int, batch: bool = True) -> tuple[PostPolicy, _Gpu]:
    gpu = _Gpu()
    return PostPolicy(layers, batch, gpu.record, gpu.is_computed), gpu


def _layers(messages: list[LayerSaved]) -> list[tuple[int, object]]:
    return [(message.layer, message.event) for message in messages]


def test_without_batching_every_layer_goes_at_once_behind_its_own_event():
    policy, gpu = _policy(3, batch=False)
    policy.begin_step(1)
    posted = [policy.layer_saved(layer, 10.0 + layer) for layer in range(3)]
    assert [_layers(p) for p in posted] == [[(0, "e0")], [(1, "e1")], [(2, "e2")]]
    assert gpu.probed == []
    end = policy.step_saved(20.0)
    assert end.layers == [] and end.deferred_step_seq is None
    assert not policy.defer_to_output(), "a worker that never holds a layer never defers a step"


def test_while_the_gpu_keeps_up_layers_after_the_first_are_held_and_probed_at_strides_growing_4x():
    policy, gpu = _policy(32)
    policy.begin_step(1)
    posted = [policy.layer_saved(layer, float(layer)) for layer in range(32)]
    assert _layers(posted[0]) == [(0, "e0")] and not any(posted[1:])
    # Probes at layers 1, 5, 21, each querying an event recorded one layer earlier (layers 0, 4, 20).
    assert gpu.probed == ["e0", "e1", "e2"] and gpu.recorded == ["e0", "e1", "e2"]
    assert policy.held_layer_count == 31
    end = policy.step_saved(40.0)
    assert _layers(end.layers) == [(layer, "e3") for layer in range(1, 32)], "one event after the whole forward"
    assert [message.saved_at for message in end.layers[:2]] == [1.0, 2.0] and end.deferred_step_seq is None
    assert policy.held_layer_count == 0 and policy.saved_layer_count == 0


def test_a_layer_saved_while_the_gpu_is_behind_goes_at_once_with_the_held_ones_behind_its_event():
    policy, gpu = _policy(8)
    policy.begin_step(1)
    policy.layer_saved(0, 0.0)
    assert policy.layer_saved(1, 1.0) == []                  # probe at 1: caught up, next probe at 5
    assert [policy.layer_saved(layer, float(layer)) for layer in (2, 3, 4)] == [[], [], []]
    gpu.caught_up = False
    posted = policy.layer_saved(5, 5.0)                       # probe at 5: behind
    assert _layers(posted) == [(layer, "e2") for layer in range(1, 6)]
    assert _layers(policy.layer_saved(6, 6.0)) == [(6, "e3")], "behind: each layer probes and goes on its own"
    assert policy.step_saved(8.0).layers[0].layer == 7, "the layer whose hook never ran is saved at the step's end"


def test_layers_held_by_a_step_without_wait_for_save_go_first_in_the_next_step():
    policy, gpu = _policy(3)
    policy.begin_step(1)
    policy.layer_saved(0, 0.0)
    policy.layer_saved(1, 1.0)
    leftover = policy.begin_step(2)
    assert _layers(leftover) == [(1, "e1")], "behind an event recorded as the next step begins; layer 2 never saved"
    assert gpu.recorded == ["e0", "e1"]
    assert policy.held_layer_count == 0 and policy.saved_layer_count == 0


def test_a_deferring_step_that_posted_nothing_waits_for_its_output_and_is_signalled_once():
    policy, gpu = _policy(3)
    assert policy.defer_to_output()
    policy.begin_step(7)
    assert [policy.layer_saved(layer, float(layer)) for layer in range(3)] == [[], [], []], "the first is held too"
    assert gpu.probed == ["e0"], "the first layer's event is the first probe"
    end = policy.step_saved(3.0)
    assert end.deferred_step_seq == 7 and _layers(end.layers) == [(0, "e1"), (1, "e1"), (2, "e1")]
    assert not policy.output_left(6), "an earlier step's output leaves this one waiting"
    assert policy.output_left(7)
    assert not policy.output_left(7), "each step is signalled once"


def test_a_deferring_step_whose_gpu_fell_behind_streams_and_is_not_deferred():
    policy, gpu = _policy(3)
    policy.defer_to_output()
    policy.begin_step(1)
    assert policy.layer_saved(0, 0.0) == []
    gpu.caught_up = False
    assert _layers(policy.layer_saved(1, 1.0)) == [(0, "e1"), (1, "e1")]
    end = policy.step_saved(3.0)
    assert end.deferred_step_seq is None and [message.layer for message in end.layers] == [2]
    assert not policy.output_left(1)


def _chunk(request_id: str) -> PrefillChunk:
    return PrefillChunk(request_id, "t-" + request_id, 0, 16, 16, (1,))


def test_deferred_steps_are_due_after_their_output_left_plus_the_grace_or_at_the_latest_bound():
    steps = DeferredSteps(output_grace_s=0.001, max_output_wait_s=0.05)
    steps.defer(1, [_chunk("a")], [LayerSaved(0, None, 0.0)], now=100.0)
    steps.defer(2, [_chunk("b")], [], now=100.01)
    assert steps.take_due(100.04) == []
    steps.output_left(1, left_at=100.02)
    assert steps.take_due(100.0205) == []
    (first,) = steps.take_due(100.021)
    assert (first.step_seq, first.chunks[0].request_id) == (1, "a") and len(steps) == 1
    assert steps.take_due(100.059) == []
    assert [step.step_seq for step in steps.take_due(100.06)] == [2], "max_output_wait_s after it was deferred"


def test_deferred_steps_go_oldest_first_and_all_at_once_when_asked():
    steps = DeferredSteps(output_grace_s=0.0, max_output_wait_s=1.0)
    steps.defer(1, [], [], now=0.0)
    steps.defer(2, [], [], now=0.0)
    steps.output_left(2, left_at=0.5)
    assert [step.step_seq for step in steps.take_due(0.5)] == [1, 2]
    steps.defer(3, [], [], now=1.0)
    assert [step.step_seq for step in steps.take_due(1.0, every=True)] == [3] and len(steps) == 0
