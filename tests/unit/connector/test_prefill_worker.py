"""The prefill worker half: hooks only post, the owner applies; when an instruction is applied, which CUDA
event each write waits for, how a transfer is settled and released.

The worker runs with a recording transport and directory session (the data plane and the directory have
their own tests); its owner loop is run by hand, or is a real TransferAgent's I/O thread on the in-memory
NIXL; events are plain objects standing in for CUDA events, one per save_kv_layer.
"""

from __future__ import annotations

import itertools
import threading
import time

import structlog.testing

from kvpush.api.outcome import PushOutcome
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.metadata import KVPushMetadata, PrefillChunk
from kvpush.connector.worker.prefill import PrefillWorker
from kvpush.connector.worker.transport import WriteDone, WriterQuiet
from kvpush.dataplane.agent import TransferAgent
from kvpush.v1 import directory_pb2 as dpb
from tests.unit.connector.inmemory_helpers import new_fabric, nixl_config

LAYERS = ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"]
BLOCK = 16


class _Session:
    def __init__(self) -> None:
        self.ready: list[dpb.LayerReady] = []
        self.results: list[dpb.WriteResult] = []

    def send_ready(self, events) -> None:
        self.ready.extend(events)

    def send_result(self, result) -> None:
        self.results.append(result)


class _Directory:
    registration = None

    def __init__(self) -> None:
        self.session = _Session()


class _Transport:
    """Records submitted writes with the event each waits for, and the thread that submitted it."""

    def __init__(self) -> None:
        self.writes: list[tuple[int, int, int, object, str]] = []
        self.watched: list[tuple[object, object]] = []
        self.cancelled: list[str] = []
        self.guards: list = []
        self.peers: list[tuple[str, bytes]] = []
        self.refuse_peers = False
        self.block_sizes: dict[str, int] = {}

    def ensure_peer(self, agent_name, metadata, layout) -> None:
        if self.refuse_peers:
            raise ValueError("layouts cannot exchange KV")
        self.peers.append((agent_name, bytes(metadata)))
        if layout is not None:
            self.block_sizes[agent_name] = layout.block_size_tokens

    def peer_block_size_tokens(self, agent_name) -> int:
        return self.block_sizes.get(agent_name, 0)  # 0: the worker's own

    def has_peer(self, agent_name) -> bool:
        return any(name == agent_name for name, _ in self.peers)

    def submit(self, transfer_id, peer_agent, write, notification, ready_event, trace_context, post_guard=None) -> None:
        self.writes.append((write.layer, write.token_start, write.token_end, ready_event,
                            threading.current_thread().name))
        self.guards.append(post_guard)

    def when_computed(self, event, callback) -> None:
        self.watched.append((event, callback))

    def cancel(self, transfer_id) -> None:
        self.cancelled.append(transfer_id)


class _ManualLoop:
    """The owner thread, run by hand: posts queue up until `run()` (which also polls the participants)."""

    def __init__(self) -> None:
        self.posted: list = []
        self.participants: list = []

    def post(self, fn) -> None:
        self.posted.append(fn)

    def attach(self, participant) -> None:
        self.participants.append(participant)

    def run(self, now: float | None = None) -> None:
        while self.posted:
            self.posted.pop(0)()
        for participant in self.participants:
            participant.poll(time.monotonic() if now is None else now)


class _GpuWorker(PrefillWorker):
    """A GPU prefill worker whose CUDA events are numbered objects (the one seam replaced)."""

    _numbers = itertools.count()
    gpu_caught_up = True  # what _is_computed says of the previous layer's event

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.recorded_events: list[str] = []

    def _record_ready_event(self):
        event = f"event-{next(self._numbers)}"
        self.recorded_events.append(event)
        return event

    def _is_computed(self, event):
        assert isinstance(event, str) and event.startswith("event-")
        return self.gpu_caught_up


def _worker(loop=None, **extra) -> tuple[_GpuWorker, _Transport, _Directory, _ManualLoop]:
    config = ConnectorConfig.from_extra_config({"directory_address": "127.0.0.1:1", **extra}, role="prefill",
                                               engine_id="p")
    directory = _Directory()
    transport = _Transport()
    loop = loop or _ManualLoop()
    worker = _GpuWorker(config, directory, LAYERS, BLOCK, loop, transport, on_gpu=True)
    return worker, transport, directory, loop


def _instruction(prompt: int) -> dpb.PushInstruction:
    return dpb.PushInstruction(transfer_id="t1", decode_engine_id="d", decode_agent_name="decode-agent",
                               decode_block_ids=list(range(50, 50 + -(-prompt // BLOCK))),
                               prompt_token_count=prompt, notification=b"t1")


def _step(prompt: int, cached: int = 0) -> KVPushMetadata:
    chunk = PrefillChunk(request_id="r1", transfer_id="t1", token_start=cached, token_end=prompt,
                         prompt_token_count=prompt, block_ids=tuple(range(10, 10 + -(-prompt // BLOCK))),
                         cached_token_count=cached)
    return KVPushMetadata(prefill_chunks=[chunk])


def _on_other_thread(fn) -> None:
    thread = threading.Thread(target=fn, name="directory-client")
    thread.start()
    thread.join(5)


def test_instruction_between_hooks_is_applied_at_once_each_write_behind_its_own_layer():
    """The host enqueued the whole forward; an instruction arriving before the next hook wakes the owner (the
    NIXL I/O thread), which writes every layer at once, each write waiting for its own layer's event."""
    name, _ = new_fabric()
    agent = TransferAgent("prefill-owner", nixl_config(name)).start()
    try:
        worker, transport, _, _ = _worker(loop=agent)
        worker.gpu_caught_up = False  # the host runs ahead: each layer is posted behind its own event
        worker.begin_step(_step(40))
        for layer in LAYERS:
            worker.save_kv_layer(layer)
        worker.wait_for_save()
        agent.call_soon(lambda: None).result(5)  # the owner has seen every hook's message
        assert transport.writes == []  # no instruction yet
        _on_other_thread(lambda: worker.on_instruction(_instruction(40)))
        agent.call_soon(lambda: None).result(5)
        assert [(layer, start, end) for layer, start, end, _, _ in transport.writes] == [
            (0, 0, 40), (1, 0, 40), (2, 0, 40)]
        events = [event for _, _, _, event, _ in transport.writes]
        assert len(set(events)) == 3, f"each layer waits for its own event, got {events}"
        assert {thread for *_, thread in transport.writes} == {"kvpush-nixl-io"}
    finally:
        agent.stop()


def test_hooks_only_post_the_owner_applies():
    """No hook and no directory callback touches push state: until the owner runs, nothing is planned or sent."""
    worker, transport, directory, loop = _worker()
    worker.begin_step(_step(40))
    worker.save_kv_layer(LAYERS[0])
    _on_other_thread(lambda: worker.on_instruction(_instruction(40)))
    assert transport.writes == [] and directory.session.ready == []
    assert worker.get_finished_sending({"r1"}) == set() and worker.build_worker_meta() is None
    loop.run()
    assert [(layer, start, end) for layer, start, end, *_ in transport.writes] == [(0, 0, 40)]
    assert [(e.layer_start, e.layer_end) for e in directory.session.ready] == [(0, 1)]


def test_a_transfer_is_settled_once_and_released_once_after_vllm_finished_it():
    """Every write landed: one DONE WriteResult with the timeline; the held request is reported finished once,
    and only once vLLM passed it in finished_req_ids."""
    worker, transport, directory, loop = _worker()
    worker.begin_step(_step(40))
    for layer in LAYERS:
        worker.save_kv_layer(layer)
    worker.wait_for_save()
    worker.on_instruction(_instruction(40))
    loop.run()
    for layer, *_ in transport.writes:
        worker.on_write_done(WriteDone("t1", PushOutcome.DONE, "", layer, 10.0, 11.0 + layer, 0.001, 2, 100))
    worker.on_writer_quiet(WriterQuiet("t1", PushOutcome.DONE, ""))
    worker.begin_step(KVPushMetadata(held_prefills=["r1"]))
    loop.run()
    assert [r.status for r in directory.session.results] == [dpb.WRITE_RESULT_STATUS_DONE]
    (result,) = directory.session.results
    assert (result.timing.write_count, result.timing.bytes_written, result.bytes_written) == (3, 300, 300)
    assert worker.get_finished_sending(set()) == set()
    assert worker.get_finished_sending({"r1"}) == {"r1"}
    assert worker.get_finished_sending({"r1"}) == set()
    meta = worker.build_worker_meta()
    assert meta is not None and meta.timelines["r1"][0].timeline.state == "done"
    assert not worker.has_live_transfers()


def test_a_held_push_past_its_bound_is_cancelled_failed_and_released():
    """A held push that does not finish within push_timeout_s: writes cancelled, FAILED sent, blocks released."""
    worker, transport, directory, loop = _worker(push_timeout_s=1.0)
    worker.begin_step(_step(40))
    for layer in LAYERS:
        worker.save_kv_layer(layer)
    worker.wait_for_save()
    worker.on_instruction(_instruction(40))
    worker.begin_step(KVPushMetadata(held_prefills=["r1"]))
    loop.run()
    assert len(transport.writes) == 3 and transport.cancelled == []
    loop.run(now=time.monotonic() + 1.5)
    assert transport.cancelled == ["t1"] and directory.session.results == []  # writes still in flight
    for layer, *_ in transport.writes:
        worker.on_write_done(WriteDone("t1", PushOutcome.CANCELLED, "cancelled", layer, None, 12.0, 0.0, 0, 0))
    worker.on_writer_quiet(WriterQuiet("t1", PushOutcome.CANCELLED, "cancelled"))
    loop.run()
    (result,) = directory.session.results
    assert result.status == dpb.WRITE_RESULT_STATUS_FAILED and "push_timeout_s" in result.error_message
    assert worker.get_finished_sending({"r1"}) == {"r1"}


def _computed_and_instructed(worker, prompt: int = 40) -> None:
    """Hooks of one step computing every layer of `prompt` tokens of t1, then t1's instruction (posted, not run)."""
    worker.begin_step(_step(prompt))
    for layer in LAYERS:
        worker.save_kv_layer(layer)
    worker.wait_for_save()
    worker.on_instruction(_instruction(prompt))


def test_a_failed_push_says_whether_the_data_plane_still_holds_its_decode_agent():
    """A write aborted, after which the data plane dropped the decode agent: the FAILED result names the agent, so
    the directory resends its metadata. A write failure that left the agent loaded names none."""
    for dropped in (True, False):
        worker, transport, directory, loop = _worker()
        _computed_and_instructed(worker)
        loop.run()
        if dropped:
            transport.peers.clear()  # what the data plane does to a peer a write to it was aborted on
        error = "transfer not done within 10.0s"
        for layer, *_ in transport.writes:
            worker.on_write_done(WriteDone("t1", PushOutcome.FAILED, error, layer, None, 12.0, 0.0, 0, 0))
        worker.on_writer_quiet(WriterQuiet("t1", PushOutcome.FAILED, error))
        loop.run()
        (result,) = directory.session.results
        assert result.status == dpb.WRITE_RESULT_STATUS_FAILED and error in result.error_message
        assert result.dropped_decode_agent_name == ("decode-agent" if dropped else "")


def test_an_instruction_the_worker_cannot_apply_fails_its_transfer_at_once_naming_the_agent():
    """Refused before any write (here: the peer cannot be loaded): the FAILED result goes at once, naming the agent
    the worker does not hold, and the held request is released."""
    worker, transport, directory, loop = _worker()
    transport.refuse_peers = True
    _computed_and_instructed(worker)
    worker.begin_step(KVPushMetadata(held_prefills=["r1"]))
    loop.run()
    (result,) = directory.session.results
    assert result.status == dpb.WRITE_RESULT_STATUS_FAILED
    assert result.error_message == "instruction refused: layouts cannot exchange KV"
    assert result.dropped_decode_agent_name == "decode-agent" and transport.writes == []
    assert worker.get_finished_sending({"r1"}) == {"r1"}


def test_prefix_cached_tokens_wait_for_this_steps_layer():
    """Tokens from the prefix cache go out with the layer's save in this step (vLLM may be computing those
    blocks for another request in the same forward), never before the layer's event exists."""
    worker, transport, _, loop = _worker()
    worker.begin_step(_step(40, cached=32))
    _on_other_thread(lambda: worker.on_instruction(_instruction(40)))
    loop.run()
    assert transport.writes == []
    worker.save_kv_layer(LAYERS[0])
    loop.run()
    assert [(layer, start, end) for layer, start, end, *_ in transport.writes] == [(0, 0, 40)]
    assert transport.writes[0][3] is not None


def test_gpu_prefill_end_is_when_the_last_layers_event_completes():
    """On GPU the host's save_kv_layer is not the end of prefill: the end is the time the data plane reports for
    the last layer's event, and the step's timeline carries that time."""
    worker, transport, _, loop = _worker()
    worker.begin_step(_step(40))
    for name in LAYERS:
        worker.save_kv_layer(name)
    worker.wait_for_save()
    loop.run()
    ((event, report),) = transport.watched
    assert event == worker.owner.book.layer_event(len(LAYERS) - 1)
    report(1234.5)  # the NIXL I/O thread saw the event complete
    meta = worker.build_worker_meta()
    assert meta is not None and meta.timelines["r1"][0].prefill_end_time == 1234.5


def test_a_gpu_steps_layers_after_its_first_reach_the_owner_in_one_post_at_wait_for_save():
    """batch_layer_posts (the GPU default) where the GPU keeps up with the host: the first layer's save wakes the
    owner (its readiness goes out at once), the others are held until wait_for_save and arrive in one post, behind
    one event recorded there: no CUDA call in their hooks."""
    worker, transport, directory, loop = _worker()
    worker.begin_step(_step(40))
    worker.on_instruction(_instruction(40))
    for name in LAYERS:
        worker.save_kv_layer(name)
    assert len(loop.posted) == 3  # StepStarted, the instruction, the first layer: nothing per later layer
    assert len(worker.recorded_events) == 1, "only the first layer records an event during the forward"
    loop.run()
    assert [layer for layer, *_ in transport.writes] == [0]
    assert [(e.layer_start, e.layer_end) for e in directory.session.ready] == [(0, 1)]
    worker.wait_for_save()
    assert len(loop.posted) == 1
    loop.run()
    assert [(layer, start, end) for layer, start, end, *_ in transport.writes] == [(0, 0, 40), (1, 0, 40), (2, 0, 40)]
    events = [event for _, _, _, event, _ in transport.writes]
    assert events == worker.recorded_events[:1] + worker.recorded_events[1:] * 2, \
        "the held layers wait for the event wait_for_save recorded, the first layer for its own"
    assert [(e.layer_start, e.layer_end) for e in directory.session.ready] == [(0, 1), (0, 3)]
    # The next step starts with nothing held.
    worker.begin_step(_step(40))
    assert worker.post_policy.held_layer_count == 0


def test_held_layers_of_a_step_without_wait_for_save_go_before_the_next_steps():
    """The layers it saved are written (the held one behind an event recorded when the next step began); the one it
    never saved is neither written nor announced ready."""
    worker, transport, directory, loop = _worker()
    worker.begin_step(_step(40))
    worker.on_instruction(_instruction(40))
    for name in LAYERS[:2]:
        worker.save_kv_layer(name)
    assert len(worker.recorded_events) == 1
    worker.begin_step(KVPushMetadata())  # no wait_for_save came for the step above
    loop.run()
    assert [layer for layer, *_ in transport.writes] == [0, 1]
    assert [event for _, _, _, event, _ in transport.writes] == worker.recorded_events
    assert [(e.layer_start, e.layer_end) for e in directory.session.ready] == [(0, 1)]
    assert worker.post_policy.held_layer_count == 0


def test_while_the_gpu_is_behind_each_layer_goes_at_once_and_once_it_caught_up_later_layers_are_held():
    """A long forward: the previous layer's kernel has not finished when the host saves the next layer, so the host
    has time to spare and each layer's write should start as soon as its kernel is done, not at wait_for_save. Once
    the GPU has caught up, later layers are held until the next probe (here beyond the last layer)."""
    worker, transport, directory, loop = _worker()
    worker.gpu_caught_up = False
    worker.begin_step(_step(40))
    worker.on_instruction(_instruction(40))
    worker.save_kv_layer(LAYERS[0])
    worker.save_kv_layer(LAYERS[1])  # behind: goes at once, with its own event
    assert len(loop.posted) == 4 and worker.post_policy.held_layer_count == 0
    loop.run()
    assert [layer for layer, *_ in transport.writes] == [0, 1]
    assert [event for _, _, _, event, _ in transport.writes] == worker.recorded_events
    assert [(e.layer_start, e.layer_end) for e in directory.session.ready] == [(0, 1)]
    worker.gpu_caught_up = True
    worker.save_kv_layer(LAYERS[2])  # caught up: held, no event, no post
    assert loop.posted == [] and len(worker.recorded_events) == 2
    worker.gpu_caught_up = False
    worker.wait_for_save()
    assert len(loop.posted) == 1
    loop.run()
    assert [layer for layer, *_ in transport.writes] == [0, 1, 2]
    assert transport.writes[2][3] == worker.recorded_events[2], "layer 2 waits for wait_for_save's event"
    assert [(e.layer_start, e.layer_end) for e in directory.session.ready] == [(0, 1), (0, 3)]


class _ProbedWorker(_GpuWorker):
    """Records which layer's hook asked the GPU's progress, and answers from a list (caught up unless told)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.behind_at: set[int] = set()
        self.probed_at: list[int] = []
        self.recorded_at: list[int] = []
        self.hook_layer = -1

    def _record_ready_event(self):
        self.recorded_at.append(self.hook_layer)
        return super()._record_ready_event()

    def save_kv_layer(self, layer_name: str) -> None:
        self.hook_layer = self._layer_index[layer_name]
        super().save_kv_layer(layer_name)

    def _is_computed(self, event):
        self.probed_at.append(self.hook_layer)
        return self.hook_layer not in self.behind_at


def test_while_the_gpu_keeps_up_its_progress_is_probed_at_strides_growing_4x():
    """32 layers, the GPU always caught up: probes at layers 1, 5 and 21, events recorded at layers 0 (posted), 4
    and 20 (a layer before the probes that query them) and at wait_for_save, which posts the 31 held layers
    behind its own event."""
    config = ConnectorConfig.from_extra_config({"directory_address": "127.0.0.1:1"}, role="prefill", engine_id="p")
    transport, loop = _Transport(), _ManualLoop()
    names = [f"layers.{i}.attn" for i in range(32)]
    worker = _ProbedWorker(config, _Directory(), names, BLOCK, loop, transport, on_gpu=True)
    worker.begin_step(_step(40))
    worker.on_instruction(_instruction(40))
    for name in names:
        worker.save_kv_layer(name)
    assert worker.probed_at == [1, 5, 21]
    assert worker.recorded_at == [0, 4, 20], "each probe asks whether the GPU is within one layer of the host"
    assert len(worker.recorded_events) == 3 and len(loop.posted) == 3  # StepStarted, the instruction, layer 0
    worker.wait_for_save()
    loop.run()
    events = [event for _, _, _, event, _ in transport.writes]
    assert [layer for layer, *_ in transport.writes] == list(range(32))
    assert events == [worker.recorded_events[0]] + [worker.recorded_events[3]] * 31


def test_a_probe_that_finds_the_gpu_behind_posts_the_held_layers_and_probes_every_layer_again():
    """The GPU looked caught up at layer 1 (the host had not built a lead yet) but is behind at the next probe,
    layer 5: layers 1-5 go at once behind the event recorded there, and from then on each layer probes and goes
    behind its own event, as long as the GPU stays behind."""
    config = ConnectorConfig.from_extra_config({"directory_address": "127.0.0.1:1"}, role="prefill", engine_id="p")
    transport, loop = _Transport(), _ManualLoop()
    names = [f"layers.{i}.attn" for i in range(8)]
    worker = _ProbedWorker(config, _Directory(), names, BLOCK, loop, transport, on_gpu=True)
    worker.behind_at = {5, 6, 7}
    worker.begin_step(_step(40))
    worker.on_instruction(_instruction(40))
    for name in names:
        worker.save_kv_layer(name)
    assert worker.probed_at == [1, 5, 6, 7]
    loop.run()
    layers = [layer for layer, *_ in transport.writes]
    events = [event for _, _, _, event, _ in transport.writes]
    assert layers == list(range(8))
    # recorded: layer 0 (posted), layer 4 (for the probe at 5), layers 5, 6, 7 (posted, each its own)
    recorded = worker.recorded_events
    assert len(recorded) == 5
    assert events == [recorded[0]] + [recorded[2]] * 5 + recorded[3:], "layers 1-5 wait for layer 5's event"
    worker.wait_for_save()
    loop.run()
    assert len(transport.writes) == 8 and len(worker.recorded_events) == 5, "nothing held: no event at wait_for_save"


def test_layers_saved_at_wait_for_save_go_in_its_one_post_while_the_gpu_is_behind():
    """The whole forward is enqueued when wait_for_save saves the layers whose hook did not run: they leave with
    StepSaved in one post, not in a post each because their (just recorded) event is not complete yet."""
    worker, transport, _, loop = _worker()
    worker.gpu_caught_up = False
    worker.begin_step(_step(40))
    worker.on_instruction(_instruction(40))
    worker.save_kv_layer(LAYERS[0])  # the only hook vLLM ran
    loop.run()
    worker.wait_for_save()
    assert len(loop.posted) == 1
    loop.run()
    assert [layer for layer, *_ in transport.writes] == [0, 1, 2]


def test_without_batch_layer_posts_every_layer_wakes_the_owner():
    worker, transport, _, loop = _worker(batch_layer_posts=False)
    worker.begin_step(_step(40))
    worker.on_instruction(_instruction(40))
    for name in LAYERS:
        worker.save_kv_layer(name)
    assert len(loop.posted) == 2 + len(LAYERS)
    loop.run()
    assert [layer for layer, *_ in transport.writes] == [0, 1, 2]


def test_layers_whose_hook_did_not_run_are_saved_at_wait_for_save():
    """A full CUDA graph replays without the attention hooks: wait_for_save saves the missing layers in order,
    behind one event recorded after the whole forward, so their writes still go out (and prefill still ends)."""
    worker, transport, _, loop = _worker()
    worker.begin_step(_step(40))
    _on_other_thread(lambda: worker.on_instruction(_instruction(40)))
    worker.save_kv_layer(LAYERS[0])  # the only hook vLLM ran
    worker.wait_for_save()
    loop.run()
    assert [(layer, start, end) for layer, start, end, *_ in transport.writes] == [(0, 0, 40), (1, 0, 40), (2, 0, 40)]
    events = [event for _, _, _, event, _ in transport.writes]
    assert events[1] == events[2] != events[0], "the missing layers share the one event recorded at wait_for_save"
    assert len(transport.watched) == 1, "the last layer's event must be watched for prefill's end"
    # The next step starts with no layer saved.
    worker.begin_step(_step(40))
    assert worker.post_policy.saved_layer_count == 0


def test_a_step_without_chunks_saves_nothing_at_wait_for_save():
    """No chunk this step: wait_for_save posts nothing, so nothing is written or watched."""
    worker, transport, _, loop = _worker()
    worker.begin_step(KVPushMetadata())
    worker.wait_for_save()
    loop.run()
    assert transport.writes == [] and transport.watched == []


def test_a_session_reset_fails_dispatched_pushes_and_re_announces_the_others():
    """The directory dropped the session: a transfer it had dispatched fails here too (FAILED result on the new
    session, writes cancelled); one still waiting for its instruction has its readiness sent again."""
    worker, transport, directory, loop = _worker()
    two_chunks = KVPushMetadata(prefill_chunks=[
        PrefillChunk("r1", "t1", 0, 40, 40, (10, 11, 12)), PrefillChunk("r2", "t2", 0, 40, 40, (20, 21, 22))])
    worker.begin_step(two_chunks)
    for layer in LAYERS:
        worker.save_kv_layer(layer)
    worker.wait_for_save()
    worker.on_instruction(_instruction(40))  # t1 only
    loop.run()
    directory.session.ready.clear()
    worker.on_session_reset()
    loop.run()
    assert transport.cancelled == ["t1"] and directory.session.results == []  # its writes are still in flight
    for layer, *_ in transport.writes:
        worker.on_write_done(WriteDone("t1", PushOutcome.CANCELLED, "cancelled", layer, None, 12.0, 0.0, 0, 0))
    worker.on_writer_quiet(WriterQuiet("t1", PushOutcome.CANCELLED, "cancelled"))
    loop.run()
    (result,) = directory.session.results
    assert result.transfer_id == "t1" and result.status == dpb.WRITE_RESULT_STATUS_FAILED
    assert "session was lost" in result.error_message
    assert {(e.transfer_id, e.layer_start, e.layer_end) for e in directory.session.ready} == {("t2", 0, len(LAYERS))}


def test_a_rejection_that_says_the_transfer_is_gone_stops_it():
    """NOT_FOUND for an event: the directory no longer knows the transfer, so the push fails here; an
    INVALID_ARGUMENT (a bad event of a live transfer) leaves it alone."""
    from google.rpc import status_pb2

    worker, transport, directory, loop = _worker()
    worker.begin_step(_step(40))
    worker.save_kv_layer(LAYERS[0])
    worker.on_rejection(dpb.EventRejection(transfer_id="t1", status=status_pb2.Status(code=3, message="bad")))
    loop.run()
    worker.on_instruction(_instruction(40))
    loop.run()
    assert len(transport.writes) == 1 and directory.session.results == []
    worker.on_rejection(dpb.EventRejection(transfer_id="t1", status=status_pb2.Status(code=5, message="gone")))
    loop.run()
    assert transport.cancelled == ["t1"]
    worker.on_write_done(WriteDone("t1", PushOutcome.CANCELLED, "cancelled", 0, None, 12.0, 0.0, 0, 0))
    worker.on_writer_quiet(WriterQuiet("t1", PushOutcome.CANCELLED, "cancelled"))
    loop.run()
    (result,) = directory.session.results
    assert result.status == dpb.WRITE_RESULT_STATUS_FAILED and "gone" in result.error_message


def test_writes_are_posted_only_under_the_lease_their_instruction_came_with():
    """Each write carries a post guard: it allows posting while the lease holds, refuses once it lapsed or was
    replaced."""
    from kvpush.client.lease import EngineRegistration

    worker, transport, directory, loop = _worker()
    registration = EngineRegistration(client=None, request=dpb.RegisterEngineRequest(engine_id="p"))
    registration.ttl_s, registration.registration_count = 10.0, 1
    registration.valid_until = time.monotonic() + 10.0
    directory.registration = registration
    worker.begin_step(_step(40))
    worker.on_instruction(_instruction(40))
    worker.save_kv_layer(LAYERS[0])
    loop.run()
    (guard,) = transport.guards
    assert guard() is None
    registration.valid_until = time.monotonic() + 0.3  # within the 5 % margin of a 10 s TTL: no longer posted
    assert "no longer held" in guard()
    registration.valid_until = time.monotonic() + 10.0
    registration.registration_count = 2  # the directory forgot the lease; a new one replaced it
    assert "no longer held" in guard()


def test_only_an_empty_step_after_an_empty_step_waits_for_the_owner():
    """While a push is unreleased, the empty step right after a forward returns at once (vLLM emits that forward's
    tokens only after it); the next empty step waits up to idle_step_wait_s for the owner (no spinning)."""
    worker, _, _, _ = _worker(idle_step_wait_s=0.1)
    worker.begin_step(_step(40))
    for layer in LAYERS:
        worker.save_kv_layer(layer)
    worker.wait_for_save()
    worker.get_finished_sending(set())
    waited = []
    for _ in range(3):
        worker.begin_step(KVPushMetadata(empty_step=True))
        started = time.monotonic()
        worker.get_finished_sending(set())
        waited.append(time.monotonic() - started)
    assert worker.has_live_transfers()
    assert waited[0] < 0.08, waited  # right after the forward: no wait (room left for a loaded machine)
    assert waited[1] >= 0.09 and waited[2] >= 0.09, waited  # back-to-back empty steps: the bounded wait


def test_readiness_of_a_leg_sent_before_its_plan_says_so_and_a_cancellation_before_any_instruction_settles_it():
    """A chunk marked plan_in_flight: every readiness event carries the mark (re-announced ones too), so the
    directory holds them for the plan; the directory's Cancellation when no plan came (no instruction, nothing
    written) settles the push CANCELLED at once."""
    worker, transport, directory, loop = _worker()
    chunk = PrefillChunk(request_id="r1", transfer_id="t1", token_start=0, token_end=40, prompt_token_count=40,
                         block_ids=(10, 11, 12), plan_in_flight=True)
    worker.begin_step(KVPushMetadata(prefill_chunks=[chunk]))
    for layer in LAYERS:
        worker.save_kv_layer(layer)
    worker.wait_for_save()
    loop.run()
    assert directory.session.ready and all(e.plan_in_flight for e in directory.session.ready)
    directory.session.ready.clear()
    worker.on_session_reset()
    loop.run()
    assert directory.session.ready and all(e.plan_in_flight for e in directory.session.ready)
    worker.on_cancellation(dpb.Cancellation(transfer_id="t1", reason="no PlanTransfer named this transfer"))
    loop.run()
    (result,) = directory.session.results
    assert result.transfer_id == "t1" and result.status == dpb.WRITE_RESULT_STATUS_CANCELLED
    assert transport.writes == []


def _announcement(agent: str) -> dpb.PeerAnnouncement:
    return dpb.PeerAnnouncement(decode_engine_id="d", decode_agent_name=agent,
                                decode_agent_metadata=b"md-" + agent.encode())


def test_an_announced_peer_is_loaded_by_the_owner_and_a_refused_one_only_logged():
    """on_peer posts to the owner, which loads the peer; a peer the transport refuses is logged, nothing raised;
    with preload_peers off nothing is posted at all."""
    worker, transport, _, loop = _worker()
    worker.on_peer(_announcement("decode-a"))
    assert transport.peers == []  # posted, not applied on the directory's thread
    loop.run()
    assert transport.peers == [("decode-a", b"md-decode-a")]
    transport.refuse_peers = True
    with structlog.testing.capture_logs() as logs:
        worker.on_peer(_announcement("decode-b"))
        loop.run()
    assert [(e["event"], e["peer"]) for e in logs] == [("announced decode peer refused", "decode-b")]
    off, off_transport, _, off_loop = _worker(preload_peers=False)
    off.on_peer(_announcement("decode-a"))
    assert off_loop.posted == [] and off_transport.peers == []
