"""The prefill worker half: when an instruction is applied, and which CUDA event each write waits for.

The worker runs with a recording transport and directory session (the data plane and the directory have
their own integration tests); events are plain objects standing in for CUDA events, one per save_kv_layer.
"""

from __future__ import annotations

import itertools
import threading

from kvpush.connector.config import ConnectorConfig
from kvpush.connector.metadata import KVPushMetadata, PrefillChunk
from kvpush.connector.worker.prefill import PrefillWorker
from kvpush.v1 import directory_pb2 as dpb

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
    def __init__(self) -> None:
        self.session = _Session()


class _Transport:
    """Records submitted writes with the event each waits for, and the thread that submitted it."""

    def __init__(self) -> None:
        self.writes: list[tuple[int, int, int, object, str]] = []
        self.watched: list[tuple[object, object]] = []

    def ensure_peer(self, agent_name, metadata, layout) -> None:
        pass

    def submit(self, transfer_id, peer_agent, write, notification, ready_event, trace_context) -> None:
        self.writes.append((write.layer, write.token_start, write.token_end, ready_event,
                            threading.current_thread().name))

    def when_computed(self, event, callback) -> None:
        self.watched.append((event, callback))

    def cancel(self, transfer_id) -> None:
        pass


class _GpuWorker(PrefillWorker):
    """A GPU prefill worker whose CUDA events are numbered objects (the one seam replaced)."""

    _numbers = itertools.count()

    def _record_ready_event(self):
        return f"event-{next(self._numbers)}"


def _worker() -> tuple[_GpuWorker, _Transport, _Directory]:
    config = ConnectorConfig.from_extra_config({"directory_address": "127.0.0.1:1"}, role="prefill", engine_id="p")
    directory = _Directory()
    worker = _GpuWorker(config, directory, LAYERS, BLOCK, on_gpu=True)
    transport = _Transport()
    worker.attach_transport(transport)
    return worker, transport, directory


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
    """The host enqueued the whole forward; an instruction arriving before the next hook writes every layer
    from the directory thread at once, each write waiting for its own layer's event (not the last one)."""
    worker, transport, _ = _worker()
    worker.begin_step(_step(40))
    for name in LAYERS:
        worker.save_kv_layer(name)
    worker.wait_for_save()
    assert transport.writes == []  # no instruction yet
    _on_other_thread(lambda: worker.on_instruction(_instruction(40)))
    assert [(layer, start, end) for layer, start, end, _, _ in transport.writes] == [(0, 0, 40), (1, 0, 40), (2, 0, 40)]
    events = [event for _, _, _, event, _ in transport.writes]
    assert len(set(events)) == 3, f"each layer waits for its own event, got {events}"
    assert {thread for *_, thread in transport.writes} == {"directory-client"}


def test_instruction_during_a_hook_waits_for_the_hook_then_runs():
    """While a hook owns the state the callback only queues; the hook's end runs it (not the next hook)."""
    worker, transport, _ = _worker()
    worker.begin_step(_step(40))
    arrived = threading.Event()
    original = worker._record_ready_event

    def record_while_instruction_arrives():
        # The first save_kv_layer is running (the hook owns the state) when the instruction arrives.
        if not arrived.is_set():
            _on_other_thread(lambda: worker.on_instruction(_instruction(40)))
            arrived.set()
            assert transport.writes == [], "applied while a hook owned the worker state"
        return original()

    worker._record_ready_event = record_while_instruction_arrives
    worker.save_kv_layer(LAYERS[0])
    assert [(layer, start, end) for layer, start, end, *_ in transport.writes] == [(0, 0, 40)]


def test_prefix_cached_tokens_wait_for_this_steps_layer():
    """Tokens from the prefix cache go out with the layer's save in this step (vLLM may be computing those
    blocks for another request in the same forward), never before the layer's event exists."""
    worker, transport, _ = _worker()
    worker.begin_step(_step(40, cached=32))
    _on_other_thread(lambda: worker.on_instruction(_instruction(40)))
    assert transport.writes == []
    worker.save_kv_layer(LAYERS[0])
    assert [(layer, start, end) for layer, start, end, *_ in transport.writes] == [(0, 0, 40)]
    assert transport.writes[0][3] is not None


def test_gpu_prefill_end_is_when_the_last_layers_event_completes():
    """On GPU the host's save_kv_layer is not the end of prefill: the end is the time the data plane reports for
    the last layer's event, and the step's timeline carries that time."""
    worker, transport, _ = _worker()
    worker.begin_step(_step(40))
    for name in LAYERS:
        worker.save_kv_layer(name)
    ((event, report),) = transport.watched
    assert event == worker._layer_events[len(LAYERS) - 1]
    worker.wait_for_save()
    report(1234.5)  # the NIXL I/O thread saw the event complete
    meta = worker.build_worker_meta()
    assert meta is not None and meta.timelines["r1"]["prefill_end_time"] == 1234.5


def test_layers_whose_hook_did_not_run_are_saved_at_wait_for_save():
    """A full CUDA graph replays without the attention hooks: wait_for_save saves the missing layers in order,
    behind one event recorded after the whole forward, so their writes still go out (and prefill still ends)."""
    worker, transport, _ = _worker()
    worker.begin_step(_step(40))
    _on_other_thread(lambda: worker.on_instruction(_instruction(40)))
    worker.save_kv_layer(LAYERS[0])  # the only hook vLLM ran
    worker.wait_for_save()
    assert [(layer, start, end) for layer, start, end, *_ in transport.writes] == [(0, 0, 40), (1, 0, 40), (2, 0, 40)]
    assert len(transport.watched) == 1, "the last layer's event must be watched for prefill's end"
    # The next step starts with no layer saved.
    worker.begin_step(_step(40))
    assert worker._saved_this_step == set()


def test_a_step_without_chunks_saves_nothing_at_wait_for_save():
    worker, transport, _ = _worker()
    worker.begin_step(KVPushMetadata())
    worker.wait_for_save()
    assert transport.writes == [] and transport.watched == []
