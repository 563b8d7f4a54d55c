"""Prefill engine, worker half: records per-layer readiness and pushes each layer as soon as it exists.

Life cycle of one transfer on a prefill worker. Worker state has one owner at a time (`_owner`):
engine hooks hold it while they run; directory and NIXL callbacks enqueue into `_inbox`, drained at
every hook. A directory callback (an instruction above all) also runs the inbox itself when no hook is
running: on GPU the host enqueues a whole forward long before the GPU finishes it, and an instruction
that arrives after the last `save_kv_layer` of a step must not wait for the next step to start writing.
  1. `register_kv_caches`: the KV memory is registered with NIXL and this worker with the directory;
     a StreamPrefill session opens.
  2. `begin_step` (bind_connector_metadata, before the forward): each `PrefillChunk` creates or extends
     the transfer's `PushTransfer`; tokens from this engine's prefix cache go out with this step's layers.
  3. `save_kv_layer` (forward thread, once per layer): marks the layer ready for this step's chunks
     (on GPU a CUDA event is recorded on the forward's stream; every write of that layer waits for
     the layer's latest event, so nothing is read before the kernel wrote it), sends the
     transfer's very first readiness to the directory at once (so the instruction comes back while
     later layers compute), and submits the writes that became possible. Never blocks.
  4. The directory's `PushInstruction` (one per transfer, covers every layer) arrives on the client
     thread -> inbox -> (at once when no hook runs) the backlog of ready layers is submitted, each
     behind its own layer's event; later layers go out as they are saved.
  5. `wait_for_save`: the step's readiness batch is queued to the directory (no waiting).
  6. Write outcomes (NIXL I/O thread) -> inbox. When every write landed: a NIXL notification to
     decode, WriteResult DONE with the timing, and a span per transfer with an event per layer write.
  7. `request_finished` held the blocks (metadata `held_prefills`): the request is reported in
     finished_sending once the transfer is DONE / FAILED / CANCELLED and no write is in flight, or
     after push_timeout_s (writes cancelled first). A prompt aborted before it was computed, a
     preemption, a Cancellation, an EventRejection or a lost session fail or cancel the transfer.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import duration_pb2, timestamp_pb2

from kvpush.connector.config import ConnectorConfig
from kvpush.connector.worker.inbox import run_queued_actions, wait_for_actions
from kvpush.connector.metadata import KVPushMetadata, KVPushWorkerMetadata, PrefillChunk
from kvpush.connector.tracing import TransferSpan
from kvpush.connector.worker.push_state import (
    STATE_CANCELLED,
    STATE_DONE,
    STATE_FAILED,
    PlannedWrite,
    PushTransfer,
)
from kvpush.connector.worker.transport import PushTransport, WriteDone, WriterQuiet
from kvpush.observability import get_logger
from kvpush.v1 import directory_pb2 as dpb

_log = get_logger("connector.worker.prefill")

# EventRejection codes that mean the directory no longer knows the transfer as live.
_TRANSFER_GONE_CODES = frozenset(code.value[0] for code in (
    grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED))
# Remember finished transfers a while, so a late instruction for one is answered, not re-created.
_FINISHED_MEMORY = 4096


@dataclass
class _Live:
    """A transfer this worker pushes, with the request that owns its source blocks."""

    push: PushTransfer
    trace_context: str
    span: TransferSpan
    chunks: list[tuple[int, int]] = field(default_factory=list)
    held_since: float | None = None          # monotonic time request_finished handed us the blocks
    result_sent: bool = False
    sent_first_ready: bool = False
    cancel_requested: bool = False
    writer_cancelled: bool = False
    worker_meta_sent: bool = False


def _hook(method: Callable) -> Callable:
    """An engine hook: runs as the state's owner, then runs whatever callbacks queued meanwhile."""

    @functools.wraps(method)
    def run(self: "PrefillWorker", *args: Any) -> Any:
        with self._owner:
            result = method(self, *args)
        self._run_inbox_if_unowned()
        return result

    return run


class PrefillWorker:
    """Worker half for kv_role=kv_producer (see the module docstring)."""

    def __init__(self, config: ConnectorConfig, directory: Any, layer_names: list[str], block_size_tokens: int,
                 on_gpu: bool = False) -> None:
        self._config = config
        self._transport: PushTransport | Any = None
        self._directory = directory  # DirectoryLink with an open prefill session
        self._layer_index = {name: i for i, name in enumerate(layer_names)}
        self._layer_count = len(layer_names)
        self._saved_this_step: set[int] = set()  # layers whose save_kv_layer ran in the current step
        self._block_size = block_size_tokens
        self._on_gpu = on_gpu
        self._live: dict[str, _Live] = {}            # by request id
        self._by_transfer: dict[str, str] = {}       # transfer id -> request id
        self._finished_transfers: dict[str, str] = {}  # transfer id -> final state, bounded
        self._step_chunks: list[PrefillChunk] = []
        self._pending_ready: list[dpb.LayerReady] = []
        self._seen_finished: set[str] = set()
        self._finished_sending: set[str] = set()
        self._timelines: dict[str, dict[str, Any]] = {}
        self._timeline_dirty: set[str] = set()
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._owner = threading.Lock()  # held by whoever touches worker state (see the module docstring)
        self._layer_events: dict[int, Any] = {}  # GPU: layer -> CUDA event of its latest save_kv_layer
        self._empty_step = False  # the current step schedules no tokens (see get_finished / collect)

    def attach_transport(self, transport: PushTransport | Any) -> None:
        """Use this data-plane adapter for peers, writes and cancellations (set once, before the first step)."""
        self._transport = transport

    # ---------------------------------------------------------------- callbacks from other threads

    def on_instruction(self, instruction: dpb.PushInstruction) -> None:
        """Directory client thread: apply the instruction now, or when the running hook returns."""
        self._offer(lambda: self._apply_instruction(instruction))

    def on_cancellation(self, cancellation: dpb.Cancellation) -> None:
        """Directory client thread: apply the cancellation now, or when the running hook returns."""
        self._offer(lambda: self._apply_cancellation(cancellation.transfer_id, cancellation.reason))

    def on_rejection(self, rejection: dpb.EventRejection) -> None:
        """Directory client thread: a readiness event was refused; stop pushing a transfer the directory ended."""
        status = rejection.status
        _log.warning("directory refused an event", transfer_id=rejection.transfer_id, code=status.code,
                     message=status.message)
        if status.code in _TRANSFER_GONE_CODES:
            self._offer(lambda: self._apply_cancellation(
                rejection.transfer_id, f"directory refused the transfer: {status.message}", failed=True))

    def on_session_lost(self) -> None:
        """Directory client thread: the session broke, so the directory failed every dispatched transfer; stop them."""
        self._offer(self._fail_after_session_loss)

    def on_write_done(self, done: WriteDone) -> None:
        """NIXL I/O thread: queue one write's outcome."""
        self._inbox.put(lambda: self._apply_write_done(done))

    def on_writer_quiet(self, quiet: WriterQuiet) -> None:
        """NIXL I/O thread: the data plane holds no handle of this transfer any more."""
        self._inbox.put(lambda: self._apply_writer_quiet(quiet))

    # ---------------------------------------------------------------- engine-thread hooks

    @_hook
    def begin_step(self, meta: KVPushMetadata) -> None:
        """Before the forward: open transfers for new chunks, apply holds and preemptions."""
        self._drain()
        self._step_chunks = []
        self._saved_this_step = set()
        self._empty_step = meta.empty_step
        for request_id in meta.preempted:
            live = self._live.get(request_id)
            if live is not None:
                self._stop(live, STATE_FAILED, "prefill request was preempted; its source blocks were freed")
        for chunk in meta.prefill_chunks:
            self._start_chunk(chunk)
        for request_id in meta.held_prefills:
            live = self._live.get(request_id)
            if live is None:
                continue
            live.held_since = time.monotonic()
            if not live.push.fully_computed:
                self._stop(live, STATE_FAILED, "prefill request finished before its prompt was computed")
        self._pump_all()

    def _start_chunk(self, chunk: PrefillChunk) -> None:
        live = self._live.get(chunk.request_id)
        if live is None:
            if chunk.transfer_id in self._by_transfer or chunk.transfer_id in self._finished_transfers:
                _log.error("transfer id reused by another request; not pushed", transfer_id=chunk.transfer_id,
                           request_id=chunk.request_id)
                return
            push = PushTransfer(chunk.transfer_id, chunk.request_id, chunk.prompt_token_count, self._layer_count,
                                self._block_size)
            span = TransferSpan.start("kvpush.push", chunk.transfer_id, chunk.trace_context,
                                      {"kvpush.request_id": chunk.request_id,
                                       "kvpush.prompt_token_count": chunk.prompt_token_count,
                                       "kvpush.cached_token_count": chunk.cached_token_count})
            live = _Live(push, span.traceparent() or chunk.trace_context, span)  # writes: children of the push
            self._live[chunk.request_id] = live
            self._by_transfer[chunk.transfer_id] = chunk.request_id
        if live.push.terminal:
            return
        try:
            live.push.set_source_blocks(chunk.block_ids)
        except ValueError as exc:
            self._stop(live, STATE_FAILED, str(exc))
            return
        if chunk.cached_token_count > 0:
            # This engine's prefix cache holds these tokens, never recomputed. They are pushed with each layer's
            # save_kv_layer of this step all the same (it marks [0, token_end) ready): vLLM shares blocks that
            # another request computes in this very step, so "cached" does not yet mean "written".
            self._queue_ready(live, chunk.request_id, 0, chunk.cached_token_count, 0, self._layer_count)
            live.span.event("prefix_cache_ready", {"kvpush.token_end": chunk.cached_token_count})
        live.chunks.append((chunk.token_start, chunk.token_end))
        self._step_chunks.append(chunk)
        _log.debug("chunk", transfer_id=chunk.transfer_id, token_start=chunk.token_start, token_end=chunk.token_end,
                   prompt=chunk.prompt_token_count, blocks=len(chunk.block_ids), cached=chunk.cached_token_count)

    @_hook
    def save_kv_layer(self, layer_name: str) -> None:
        """Forward thread, after a layer's attention wrote its KV: mark it ready and push what became possible."""
        layer = self._layer_index.get(layer_name)
        if layer is None or not self._step_chunks:
            return
        self._layer_saved(layer)

    def _layer_saved(self, layer: int) -> None:
        self._saved_this_step.add(layer)
        self._drain()
        ready_event = self._record_ready_event()
        if ready_event is not None:
            self._layer_events[layer] = ready_event
        now = time.time()
        for chunk in self._step_chunks:
            live = self._live.get(chunk.request_id)
            if live is None or live.push.terminal:
                continue
            live.push.mark_ready(layer, chunk.token_end)
            if not live.sent_first_ready:
                # The first readiness of a transfer goes out at once: the directory can dispatch the
                # instruction while the remaining layers compute.
                self._send_ready_now(live, chunk, layer)
            if layer == self._layer_count - 1 and chunk.is_last:
                if ready_event is None:
                    self._prefill_ended(chunk.request_id, now)
                else:
                    # The host runs ahead of the GPU: prefill ends when the last layer's kernel does.
                    request_id = chunk.request_id
                    self._transport.when_computed(ready_event, lambda end, r=request_id: self._inbox.put(
                        lambda: self._prefill_ended(r, end)))
            self._pump(live)

    def _prefill_ended(self, request_id: str, end_time: float) -> None:
        live = self._live.get(request_id)
        if live is None:
            return
        live.push.prefill_ended(end_time)
        self._timeline_dirty.add(request_id)
        live.span.event("prefill_end", {"kvpush.token_end": live.push.prompt_token_count}, time_s=end_time)

    @_hook
    def wait_for_save(self) -> None:
        """End of step: queue this step's readiness (all layers of each chunk) to the directory; never waits.

        Layers whose save_kv_layer did not run this step are saved here, in order: vLLM skips the attention
        hooks when it replays a full CUDA graph (a step of one-token chunks under FULL_AND_PIECEWISE), and the
        whole forward is enqueued by now, so one ready event recorded here covers them.
        """
        if self._step_chunks:
            for layer in range(self._layer_count):
                if layer not in self._saved_this_step:
                    self._layer_saved(layer)
        self._saved_this_step = set()
        for chunk in self._step_chunks:
            live = self._live.get(chunk.request_id)
            if live is not None and not live.push.terminal:
                self._queue_ready(live, chunk.request_id, chunk.token_start, chunk.token_end, 0,
                                  self._layer_count)
        self._step_chunks = []
        self._flush_ready()

    @_hook
    def get_finished_sending(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose held blocks may be freed now (each reported exactly once)."""
        self._seen_finished |= {r for r in finished_req_ids if r in self._live}
        if self._empty_step and self._pushes_in_flight():
            # Nothing computed this step: wait (bounded) for a write outcome rather than spin vLLM's loop.
            self._empty_step = False
            wait_for_actions(self._inbox, self._config.idle_step_wait_s, _log, "prefill")
        self._drain()
        self._enforce_bounds()
        self._flush_ready()
        done: set[str] = set()
        for request_id, live in list(self._live.items()):
            if live.held_since is None or not live.push.terminal or not live.push.quiescent:
                continue
            if request_id not in self._seen_finished:
                continue
            self._finish(request_id, live)
            done.add(request_id)
        return done

    @_hook
    def build_worker_meta(self) -> KVPushWorkerMetadata | None:
        """Push timelines that changed this step (for the response's kv_transfer_params)."""
        self._drain()  # a GPU prefill end the I/O thread stamped since the last hook belongs in this step's snapshot
        for request_id in self._timeline_dirty:
            live = self._live.get(request_id)
            if live is not None and request_id not in self._timelines:
                self._timelines[request_id] = {**live.push.finalize_timing().as_dict(), "state": live.push.state}
        self._timeline_dirty.clear()
        if not self._timelines:
            return None
        meta = KVPushWorkerMetadata(timelines=self._timelines)
        self._timelines = {}
        return meta

    def has_live_transfers(self) -> bool:
        """True while any transfer holds state here."""
        return bool(self._live)

    # ---------------------------------------------------------------- internals

    def _drain(self) -> None:
        run_queued_actions(self._inbox, _log, "prefill")

    def _offer(self, action: Callable[[], None]) -> None:
        """Directory client thread: queue `action`, and run the inbox now if no hook owns the state."""
        self._inbox.put(action)
        self._run_inbox_if_unowned()

    def _run_inbox_if_unowned(self) -> None:
        # Whoever finds the state free runs what is queued; the owner looks again after letting go,
        # so nothing queued while it held the state waits for the next hook.
        while not self._inbox.empty() and self._owner.acquire(blocking=False):
            try:
                self._drain()
                self._flush_ready()
            finally:
                self._owner.release()

    def _pushes_in_flight(self) -> bool:
        return any(not live.push.terminal or not live.push.quiescent for live in self._live.values())

    def _record_ready_event(self) -> Any:
        if not self._on_gpu:
            return None  # CPU attention wrote the KV synchronously before save_kv_layer
        import torch

        event = torch.cuda.Event()
        event.record()
        return event

    def _send_ready_now(self, live: _Live, chunk: PrefillChunk, layer: int) -> None:
        live.sent_first_ready = True
        self._queue_ready(live, chunk.request_id, chunk.token_start, chunk.token_end, 0, layer + 1)
        self._flush_ready()

    def _queue_ready(self, live: _Live, request_id: str, token_start: int, token_end: int, layer_start: int,
                     layer_end: int) -> None:
        """Queue readiness of layers [layer_start, layer_end) for tokens [token_start, token_end)."""
        if token_end <= token_start:
            return
        live.sent_first_ready = True
        end_block = -(-token_end // self._block_size)
        self._pending_ready.append(dpb.LayerReady(
            transfer_id=live.push.transfer_id, layer_start=layer_start, layer_end=layer_end,
            token_start=token_start, token_end=token_end, source_block_ids=live.push.src_block_ids[:end_block],
            prompt_token_count=live.push.prompt_token_count))

    def _flush_ready(self) -> None:
        if self._pending_ready and self._directory.session is not None:
            events, self._pending_ready = self._pending_ready, []
            self._directory.session.send_ready(events)

    def _apply_instruction(self, instruction: dpb.PushInstruction) -> None:
        request_id = self._by_transfer.get(instruction.transfer_id)
        live = self._live.get(request_id) if request_id is not None else None
        if live is None:
            final = self._finished_transfers.get(instruction.transfer_id, "unknown")
            self._send_result(instruction.transfer_id, dpb.WRITE_RESULT_STATUS_FAILED,
                              f"transfer is {final} on this prefill worker (request gone or worker restarted)")
            return
        if live.push.terminal:
            self._send_final_result(live)
            return
        try:
            self._transport.ensure_peer(instruction.decode_agent_name, instruction.decode_agent_metadata,
                                        instruction.decode_layout if instruction.HasField("decode_layout") else None)
            live.push.set_instruction(instruction.decode_agent_name, tuple(instruction.decode_block_ids),
                                      instruction.skip_token_count, instruction.prompt_token_count,
                                      bytes(instruction.notification))
        except (ValueError, RuntimeError) as exc:
            self._stop(live, STATE_FAILED, f"instruction refused: {exc}")
            return
        live.span.event("instruction", {"kvpush.decode_engine_id": instruction.decode_engine_id,
                                        "kvpush.skip_token_count": instruction.skip_token_count})
        if live.push.nothing_to_write():
            live.push.stop(STATE_DONE, "decode already holds every token")
        self._pump(live)

    def _apply_cancellation(self, transfer_id: str, reason: str, failed: bool = False) -> None:
        request_id = self._by_transfer.get(transfer_id)
        live = self._live.get(request_id) if request_id is not None else None
        if live is None:
            if not failed:
                # Nothing of it here (finished, or never seen): confirm no write is in flight.
                self._send_result(transfer_id, dpb.WRITE_RESULT_STATUS_CANCELLED, "")
            return
        live.cancel_requested = True
        self._stop(live, STATE_FAILED if failed else STATE_CANCELLED, reason or "cancelled by the directory")

    def _fail_after_session_loss(self) -> None:
        for live in self._live.values():
            if live.push.has_instruction and not live.push.terminal:
                self._stop(live, STATE_FAILED, "directory session was lost; the directory failed the transfer")
            elif not live.push.terminal:
                live.sent_first_ready = False  # re-announce on the new session
                for start, end in live.chunks:
                    if end <= min(live.push.tokens_ready):
                        self._queue_ready(live, live.push.request_id, start, end, 0, self._layer_count)
        self._flush_ready()

    def _apply_write_done(self, done: WriteDone) -> None:
        request_id = self._by_transfer.get(done.transfer_id)
        live = self._live.get(request_id) if request_id is not None else None
        if live is None:
            return
        if done.start_time is not None:
            live.push.write_started(done.start_time)
        was_terminal = live.push.terminal
        self._timeline_dirty.add(request_id)
        live.push.write_finished(done.ok, done.error, done.end_time, done.post_duration_s, done.descriptor_count,
                                 done.bytes_written, layer=done.layer)
        if done.ok:
            ends = live.push.timing.layer_write_end_times
            ends[done.layer] = max(ends.get(done.layer, 0.0), done.end_time)
        live.span.event("layer_write" if done.ok else "layer_write_failed",
                        {"kvpush.layer": done.layer, "kvpush.bytes": done.bytes_written,
                         "kvpush.descriptor_count": done.descriptor_count,
                         **({"kvpush.error": done.error} if done.error else {})}, time_s=done.end_time)
        if not was_terminal and live.push.terminal:
            self._on_terminal(live)
        elif live.push.terminal and live.push.quiescent:
            self._send_final_result(live)

    def _apply_writer_quiet(self, quiet: WriterQuiet) -> None:
        request_id = self._by_transfer.get(quiet.transfer_id)
        live = self._live.get(request_id) if request_id is not None else None
        if live is None:
            return
        live.push.writer_is_quiet()
        if not quiet.ok and not live.push.terminal:
            self._stop(live, STATE_FAILED, quiet.error or "data plane failed the transfer")
        elif live.push.terminal and live.push.quiescent:
            self._send_final_result(live)

    def _pump_all(self) -> None:
        for live in list(self._live.values()):
            self._pump(live)

    def _pump(self, live: _Live) -> None:
        """Submit every write that became possible; notice when the transfer is finished."""
        if live.push.terminal:
            if live.push.quiescent:
                self._send_final_result(live)
            return
        stall = self._config.fault_stall_after_writes
        if stall is not None and live.push.writes_submitted >= stall:
            return  # fault injection (tests only): behave like a writer that stopped making progress
        try:
            writes = live.push.next_writes()
        except ValueError as exc:
            self._stop(live, STATE_FAILED, str(exc))
            return
        for write in writes:
            _log.debug("write", transfer_id=live.push.transfer_id, layer=write.layer, token_start=write.token_start,
                       token_end=write.token_end, notify=write.notify)
            # The layer's latest event covers every token of it marked ready so far. None: CPU, or a layer not
            # computed since start-up (prefix-cache tokens from earlier steps, which vLLM synchronised).
            self._submit(live, write, self._layer_events.get(write.layer))
        if live.push.terminal and live.push.quiescent:
            self._on_terminal(live)

    def _submit(self, live: _Live, write: PlannedWrite, ready_event: Any) -> None:
        try:
            self._transport.submit(live.push.transfer_id, live.push.peer_agent, write, live.push.notification,
                                   ready_event, live.trace_context)
        except Exception as exc:  # refused before anything was posted
            live.push.write_finished(False, f"write refused: {exc}")
            self._stop(live, STATE_FAILED, f"write refused: {exc}")
            return
        live.push.write_submitted()

    def _stop(self, live: _Live, state: str, reason: str) -> None:
        """End the push (first reason wins) and make the data plane drop what it still holds of it."""
        live.push.stop(state, reason)
        if live.push.writes_submitted and not live.push.writer_quiet and not live.writer_cancelled:
            live.writer_cancelled = True
            self._transport.cancel(live.push.transfer_id)
        self._on_terminal(live)

    def _on_terminal(self, live: _Live) -> None:
        """The push ended (DONE / FAILED / CANCELLED); report once nothing is in flight.

        The closing write carries the notification; the data plane sends it only after every write of
        the transfer landed (NIXL does not order handles), so decode never starts on partial KV.
        """
        if live.push.quiescent:
            self._send_final_result(live)

    def _send_final_result(self, live: _Live) -> None:
        if live.result_sent or not live.push.terminal or not live.push.quiescent:
            return
        live.result_sent = True
        push = live.push
        status = {STATE_DONE: dpb.WRITE_RESULT_STATUS_DONE, STATE_FAILED: dpb.WRITE_RESULT_STATUS_FAILED,
                  STATE_CANCELLED: dpb.WRITE_RESULT_STATUS_CANCELLED}[push.state]
        timing = push.finalize_timing()
        if push.has_instruction or live.cancel_requested:
            self._send_result(push.transfer_id, status, push.reason if push.state != STATE_DONE else "",
                              timing if push.state == STATE_DONE else None, push.layers_written(),
                              timing.bytes_written)
        live.span.set_attributes({**{f"kvpush.{k}": v for k, v in timing.as_dict().items() if v is not None},
                                  "kvpush.state": push.state})
        live.span.end(ok=push.state == STATE_DONE, reason=push.reason)
        self._timelines[push.request_id] = {**timing.as_dict(), "state": push.state, "reason": push.reason}
        log = _log.info if push.state == STATE_DONE else _log.warning
        log("push ended", transfer_id=push.transfer_id, request_id=push.request_id, state=push.state,
            reason=push.reason, **{k: v for k, v in timing.as_dict().items() if v is not None})

    def _send_result(self, transfer_id: str, status: int, error: str = "", timing: Any = None,
                     layers_written: int = 0, bytes_written: int = 0) -> None:
        if self._directory.session is None:
            return
        result = dpb.WriteResult(transfer_id=transfer_id, status=status, error_message=error[:1000],
                                 layers_written_count=layers_written, bytes_written=bytes_written)
        if timing is not None:
            result.timing.CopyFrom(_timing_proto(timing))
        self._directory.session.send_result(result)

    def _enforce_bounds(self) -> None:
        """Held requests never wait past push_timeout_s; then their writes are cancelled and the blocks freed."""
        now = time.monotonic()
        for live in self._live.values():
            if live.held_since is None:
                continue
            waited = now - live.held_since
            if waited > self._config.push_timeout_s and not live.push.terminal:
                self._stop(live, STATE_FAILED, f"push not finished within push_timeout_s={self._config.push_timeout_s}")
            if waited > 2 * self._config.push_timeout_s and not live.push.quiescent:
                _log.error("writes still in flight after twice push_timeout_s; releasing the blocks anyway",
                           transfer_id=live.push.transfer_id, in_flight=live.push.in_flight)
                live.push.in_flight = 0
                live.push.writer_is_quiet()
                self._send_final_result(live)

    def _finish(self, request_id: str, live: _Live) -> None:
        self._live.pop(request_id, None)
        self._by_transfer.pop(live.push.transfer_id, None)
        self._seen_finished.discard(request_id)
        self._finished_transfers[live.push.transfer_id] = live.push.state
        while len(self._finished_transfers) > _FINISHED_MEMORY:
            self._finished_transfers.pop(next(iter(self._finished_transfers)))


def _timing_proto(timing: Any) -> Any:
    from kvpush.v1 import types_pb2 as tpb

    proto = tpb.TransferTiming(
        write_count=timing.write_count, descriptor_count=timing.descriptor_count, bytes_written=timing.bytes_written,
        writes_before_prefill_end_count=timing.writes_before_prefill_end_count,
        layers_written_before_prefill_end_count=timing.layers_written_before_prefill_end_count)
    for name in ("first_write_start_time", "last_write_end_time", "prefill_end_time"):
        value = getattr(timing, name)
        if value is not None:
            stamp = timestamp_pb2.Timestamp()
            stamp.FromNanoseconds(int(value * 1e9))
            getattr(proto, name).CopyFrom(stamp)
    for layer in sorted(timing.layer_write_end_times):
        proto.layer_writes.add(layer=layer).end_time.FromNanoseconds(int(timing.layer_write_end_times[layer] * 1e9))
    proto.post_duration.CopyFrom(duration_pb2.Duration(seconds=int(timing.post_duration_s),
                                                       nanos=int((timing.post_duration_s % 1) * 1e9)))
    return proto
