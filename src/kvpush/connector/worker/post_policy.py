"""When a prefill worker's saved layers reach its push owner: the GPU post policy, in two parts, one per thread.

Every post to the owner wakes the NIXL I/O thread, and every CUDA call in a hook lets the connector's other threads
take the GIL; while the GPU keeps up with the host, the forward is bound by its kernel launches and both slow it
(on the H200 a 512-token forward of 32 layers took 9 ms longer with an event per layer). So:

- `PostPolicy` (engine/forward thread; `PrefillWorker`'s hooks ask it): with `batch_layer_posts` a step's first
  layer is posted at once (its readiness goes out, and the instruction comes back while later layers compute); a
  later layer is held while the GPU keeps up, probed at strides growing 4x, and the held layers go in one post
  behind one event, either with the next layer that goes at once (the GPU fell behind: the host has time to spare)
  or at wait_for_save. With `post_after_output` (the scheduler half shares this process, output_signal) the first
  layer is held too, and a step that posted nothing while it ran is deferred until its sampled token left: the
  owner's Python around each post takes the GIL from the thread that sends it.
- `DeferredSteps` (the owner thread; `PushOwner` asks it): the deferred steps, oldest first, each due
  output_grace_s after its output left, or max_output_wait_s after it was deferred at the latest.

Neither posts, nor reads a clock, nor touches CUDA itself: the worker passes in the times, how to record a ready
event and whether one is complete (cudaEventQuery never blocks), so the unit tests drive both with plain values.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvpush.connector.metadata import PrefillChunk
from kvpush.connector.worker.ports import ReadyEvent
from kvpush.connector.worker.push_machine import LayerSaved

# How much further the next probe of the GPU's progress goes after one that found it caught up.
_PROBE_STRIDE_GROWTH = 4


@dataclass(frozen=True, slots=True)
class StepEnd:
    """What wait_for_save hands the owner: the step's held layers, in order, behind one event recorded after the
    whole forward was enqueued, and (post_after_output) the step whose output they wait for."""

    layers: list[LayerSaved]
    deferred_step_seq: int | None  # None: apply now


class PostPolicy:
    """Which saved layers a prefill worker posts now, which it holds, and which steps wait for their output.

    Engine thread only (module docstring). `record_event()` records a ready event on the forward's stream (None on
    CPU, where the KV is written before save_kv_layer); `is_computed(event)` says whether the GPU passed it.
    """

    def __init__(self, layer_count: int, batch_layer_posts: bool, record_event: Callable[[], ReadyEvent | None],
                 is_computed: Callable[[ReadyEvent | None], bool]) -> None:
        self._last_layer = layer_count - 1
        self._batch = batch_layer_posts
        self._record_event = record_event
        self._is_computed = is_computed
        self._defers_to_output = False
        self._step_seq = 0
        self._saved: set[int] = set()  # layers saved in the current step
        self._posted_this_step = False
        # Layers held, (layer, saved at), with no event of their own, until a layer goes at once or the step ends.
        self._held: list[tuple[int, float]] = []
        # The GPU's progress: the latest event recorded in this step, and the layer whose save queries it next; the
        # stride between probes grows while the GPU keeps up. A step's first recorded event sets all three.
        self._probe_event: ReadyEvent | None = None
        self._next_probe_layer = 0
        self._probe_stride = 1
        # Steps deferred to their output (post_after_output), oldest first, until output_left names them.
        self._deferred_seqs: deque[int] = deque()

    @property
    def held_layer_count(self) -> int:
        """Layers saved and not yet handed to the owner."""
        return len(self._held)

    @property
    def saved_layer_count(self) -> int:
        """Layers saved in the current step."""
        return len(self._saved)

    def defer_to_output(self) -> bool:
        """From now on a step that posted nothing while it ran waits for its output (post_after_output); True if
        this worker batches its posts, without which no step is ever launch-bound here."""
        self._defers_to_output = self._batch
        return self._defers_to_output

    def begin_step(self, step_seq: int) -> list[LayerSaved]:
        """A step begins; returns the layers still held from one that ended without wait_for_save, to post first.

        They go behind an event recorded now, after that step's whole forward was enqueued, with no StepSaved (that
        would announce every layer ready, the ones it never saved too).
        """
        leftover = self._take_held(self._record_event()) if self._held else []
        self._step_seq = step_seq
        self._posted_this_step = False
        self._saved = set()
        return leftover

    def layer_saved(self, layer: int, saved_at: float) -> list[LayerSaved]:
        """`layer` of the step's chunks was saved at `saved_at`: the layers to post now, in order (none: held)."""
        self._saved.add(layer)
        if self._batch and len(self._saved) > 1 and self._holds(layer):
            self._held.append((layer, saved_at))
            return []
        event = self._record_event()
        self._probe_event, self._next_probe_layer, self._probe_stride = event, layer + 1, 1
        if self._defers_to_output and len(self._saved) == 1:
            # The first layer is held too: its event is the first probe; a layer saved while the GPU is behind
            # posts it with the others, else the whole step goes with its output (output_left).
            self._held.append((layer, saved_at))
            return []
        self._posted_this_step = True
        message = LayerSaved(layer, event, saved_at)
        if self._held:
            return [*self._take_held(event), message]  # the event recorded now covers the held layers too
        return [message]

    def step_saved(self, saved_at: float) -> StepEnd:
        """wait_for_save of a step with chunks: the layers whose save_kv_layer did not run are saved now, in order
        (vLLM skips the attention hooks when it replays a full CUDA graph), and every held layer goes behind one
        event recorded now; a deferring step that posted nothing waits for its output."""
        self._held += [(layer, saved_at) for layer in range(self._last_layer + 1) if layer not in self._saved]
        layers = self._take_held(self._record_event()) if self._held else []
        self._saved = set()
        if self._defers_to_output and not self._posted_this_step:
            # The GPU kept up throughout: a launch-bound step, whose sampled token is next on this thread.
            self._deferred_seqs.append(self._step_seq)
            return StepEnd(layers, self._step_seq)
        return StepEnd(layers, None)

    def output_left(self, step_seq: int) -> bool:
        """Step `step_seq`'s output left: True when a deferred step up to it waited (the owner must hear of it);
        each step is signalled once."""
        if not self._deferred_seqs or self._deferred_seqs[0] > step_seq:
            return False
        while self._deferred_seqs and self._deferred_seqs[0] <= step_seq:
            self._deferred_seqs.popleft()
        return True

    def _holds(self, layer: int) -> bool:
        """Whether a layer after the step's first is held: while the GPU keeps up with the host.

        The GPU is probed at strides growing 4x while it keeps up (layers 1, 5, 21), and other held layers record
        nothing. Each probe queries an event recorded one layer earlier, whatever the stride: an event 16 layers old
        is complete whenever the GPU lags less than 16 layers, and on the H200 such reads held 8,192-token prompts'
        last 10 layers to the end (an 11 ms tail). While the GPU is behind (a long forward) the layer goes at once,
        behind its own event, and its write starts as soon as its kernel is done.
        """
        if layer < self._next_probe_layer:
            if layer + 1 == self._next_probe_layer <= self._last_layer:
                self._probe_event = self._record_event()
            return True
        if not self._is_computed(self._probe_event):
            return False
        self._probe_stride *= _PROBE_STRIDE_GROWTH
        self._next_probe_layer = layer + self._probe_stride
        return True

    def _take_held(self, event: ReadyEvent | None) -> list[LayerSaved]:
        """The held layers, in order, behind `event`; none held afterwards."""
        held, self._held = sorted(self._held), []
        return [LayerSaved(layer, event, saved_at) for layer, saved_at in held]


@dataclass(slots=True)
class DeferredStep:
    """A launch-bound step's layers and chunks, applied once its output left (+ output_grace_s) or at `due`."""

    step_seq: int
    chunks: list[PrefillChunk]
    layers: list[LayerSaved]
    due: float  # monotonic seconds


class DeferredSteps:
    """The steps deferred to their output (post_after_output), oldest first. Owner thread only."""

    def __init__(self, output_grace_s: float, max_output_wait_s: float) -> None:
        self._output_grace_s = output_grace_s
        self._max_output_wait_s = max_output_wait_s
        self._steps: deque[DeferredStep] = deque()

    def __len__(self) -> int:
        return len(self._steps)

    def defer(self, step_seq: int, chunks: list[PrefillChunk], layers: list[LayerSaved], now: float) -> None:
        """Keep a step's layers until its output left, max_output_wait_s from `now` at the latest."""
        self._steps.append(DeferredStep(step_seq, chunks, layers, due=now + self._max_output_wait_s))

    def output_left(self, step_seq: int, left_at: float) -> None:
        """Steps up to `step_seq` had their output processed at `left_at`: due output_grace_s later."""
        for step in self._steps:
            if step.step_seq <= step_seq:
                step.due = min(step.due, left_at + self._output_grace_s)

    def take_due(self, now: float, every: bool = False) -> list[DeferredStep]:
        """The steps to apply now, oldest first: those due by `now` (up to the first that is not), or all."""
        due: list[DeferredStep] = []
        while self._steps and (every or self._steps[0].due <= now):
            due.append(self._steps.popleft())
        return due
