"""Prefill engine, worker half: records per-layer readiness and pushes each layer as soon as it exists.

Two parts, one owner each:
- `PrefillWorker` (the engine hooks, engine/forward thread): turns each hook into a typed message
  (`StepStarted`, `LayerSaved`, `StepSaved`) posted to the owner, and reads what the owner published
  (`Released`, `TimelineChanged`) from a thread-safe outbox. A hook never runs push logic and never
  waits for another thread, except the bounded idle wait of an empty step (see `inbox.py`).
- `PushOwner` (the NIXL I/O thread: posts go through `TransferAgent.post`): owns every transfer's
  `PushTransfer`, span and timeline. Directory callbacks (peer announcement, instruction, cancellation,
  rejection, session reset) and data-plane outcomes are posted to it as well, so each wakes the I/O thread and is
  applied at once: an instruction that arrives after the last `save_kv_layer` of a GPU step (the host
  enqueues a whole forward long before the GPU finishes it) starts writing without waiting for a hook.

Life cycle of one transfer on a prefill worker:
  1. `register_kv_caches` (connector): KV memory registered with NIXL, this worker with the directory;
     a StreamPrefill session opens.
  2. `begin_step` (bind_connector_metadata, before the forward) -> `StepStarted`: each `PrefillChunk`
     creates or extends the transfer's `PushTransfer`; tokens from this engine's prefix cache go out with
     this step's layers; preempted requests fail; held requests (request_finished returned True) start
     their push_timeout_s bound.
  3. `save_kv_layer` (forward thread, once per layer) -> `LayerSaved(layer, event, saved_at)`: on GPU a
     CUDA event is recorded on the forward's stream here (every write of that layer waits for the layer's
     latest event, so nothing is read before the kernel wrote it). The owner marks the layer ready for
     the step's chunks, sends the transfer's very first readiness to the directory at once (so the
     instruction comes back while later layers compute) and submits the writes that became possible. Which saved
     layers are posted when is `PostPolicy`'s decision (post_policy.py). On GPU (`batch_layer_posts`) a step's
     first LayerSaved is posted from its hook; a later one is held while the previous layer's event has completed
     (the GPU keeps up with the host, so the forward is bound by its launches and a post would take the GIL from
     them) and goes with the step's StepSaved in one post; while the GPU is behind, the layer and any held before
     it are posted at once. With `post_after_output`, where the scheduler half shares this process
     (output_signal), the first layer is held too, and a step that posted nothing while it ran is applied by the
     owner only once its output was processed (`output_left`, plus output_grace_s; max_output_wait_s at the latest:
     `DeferredSteps`): the owner's Python around each post takes the GIL, so the sampled token leaves first.
  4. The directory's `PushInstruction` (one per transfer, covers every layer) -> the owner submits the
     backlog of ready layers, each behind its own layer's event; later layers go out as they are saved.
  5. `wait_for_save` -> `StepSaved`: the step's readiness batch is queued to the directory.
  6. Write outcomes (I/O thread). When every write landed the data plane notifies decode; the transfer
     is settled (`PushOwner._settle`, the only place): WriteResult to the directory, span ended,
     timeline published. A transfer whose chunks say `sends_first_token` settles DONE only once its hold
     arrived, which carries the token the request sampled after the prompt: the WriteResult reports it
     (first token from prefill). A hold that never comes is bounded by push_timeout_s.
  7. A held request is `Released` once its transfer is settled (DONE / FAILED / CANCELLED with no write
     in flight), or after push_timeout_s (writes cancelled first); `get_finished_sending` reports it
     once vLLM has also passed it in finished_req_ids. A prompt aborted before it was computed, a
     preemption, a Cancellation, an EventRejection or a session reset fail or cancel the transfer.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from google.protobuf import duration_pb2, timestamp_pb2

from kvpush.api.outcome import PushOutcome, PushStop, StopCause
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.metadata import KVPushMetadata, KVPushWorkerMetadata, TimelineReport
from kvpush.connector.outcome import write_result_status
from kvpush.connector.tracing import TransferSpan
from kvpush.connector.worker.ports import (
    HeadRoute,
    OwnerLoop,
    PostGuard,
    PrefillDirectory,
    PushTransportPort,
    ReadyEvent,
)
from kvpush.connector.worker.post_policy import DeferredStep, DeferredSteps, PostPolicy
from kvpush.connector.worker.push_machine import (
    Instruction,
    LayerSaved,
    NoticeLevel,
    PushBook,
    PushEffects,
    PushResult,
    PushRules,
    Released,
    TimelineChanged,
    WriteDone,
    WriteOrder,
    WriterQuiet,
)
from kvpush.connector.worker.push_state import PushTimeline
from kvpush.connector.worker.step_gap import StepGapWatch
from kvpush.observability import get_logger
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb

__all__ = ["LayerSaved", "PrefillWorker", "PushOwner", "Released", "StepSaved", "StepStarted", "TimelineChanged",
           "timing_proto"]

_log = get_logger("connector.worker.prefill")

# EventRejection codes that mean the directory no longer knows the transfer as live.
_TRANSFER_GONE_CODES = frozenset(code.value[0] for code in (
    grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED))
# How often the owner checks the held requests' push_timeout_s bounds (seconds).
_BOUND_CHECK_S = 0.05
# A write is posted only while the lease is held with this fraction of its TTL to spare (clock-rate slack
# between this host and the directory's; docs/connector.md, Block lifetime).
_LEASE_MARGIN = 0.05


# ---------------------------------------------------------------- hook -> owner messages (LayerSaved: push_machine)


@dataclass(frozen=True, slots=True)
class StepStarted:
    """bind_connector_metadata: the step's chunks, holds and preemptions."""

    meta: KVPushMetadata


@dataclass(frozen=True, slots=True)
class StepSaved:
    """wait_for_save: the step's forward is enqueued in full."""


class PrefillWorker:
    """Worker half for kv_role=kv_producer: the engine hooks (see the module docstring)."""

    def __init__(self, config: ConnectorConfig, directory: PrefillDirectory, layer_names: list[str],
                 block_size_tokens: int, loop: OwnerLoop, transport: PushTransportPort, on_gpu: bool = False,
                 tp_rank: int = 0, layer_groups: tuple[int, ...] = (),
                 state_group_block_sizes: tuple[tuple[int, int], ...] = ()) -> None:
        self._config = config
        self._tp_rank = tp_rank
        self._layer_index = {name: i for i, name in enumerate(layer_names)}
        self._on_gpu = on_gpu
        self._outbox: queue.SimpleQueue[Released | TimelineChanged] = queue.SimpleQueue()
        self.owner = PushOwner(config, directory, len(layer_names), block_size_tokens, transport,
                               self._outbox.put, layer_groups, state_group_block_sizes)
        self._post: Callable[[Callable[[], None]], None] = loop.post
        loop.attach(self.owner)
        # Engine thread only: what the hooks saw.
        self._last_layer = len(layer_names) - 1
        self._step_has_chunks = False
        # Which saved layers are posted now, held, or deferred to the step's output (GPU: config.batch_layer_posts).
        self.post_policy = PostPolicy(len(layer_names), on_gpu and config.batch_layer_posts,
                                      self._record_ready_event, self._is_computed)
        self._step_last_chunks: list[str] = []  # requests whose prompt this step's forward completes
        self._prefill_ends: dict[str, float] = {}  # CPU: request -> when its last layer was saved
        self._empty_step = False  # this step schedules no tokens and follows one that scheduled none either
        self._previous_step_empty = True
        self._unreleased: set[str] = set()   # requests with a transfer the owner has not released
        self._released: set[str] = set()     # released by the owner, not yet seen finished by vLLM
        self._seen_finished: set[str] = set()
        self._timelines: dict[str, PushTimeline] = {}

    # ---------------------------------------------------------------- directory callbacks (client thread)

    def on_instruction(self, instruction: dpb.PushInstruction) -> None:
        """Directory client thread: hand the instruction to the owner, which applies it at once."""
        self._post(lambda: self.owner.apply_instruction(instruction))

    def on_peer(self, peer: dpb.PeerAnnouncement) -> None:
        """Directory client thread: a decode worker this one may push to; the owner loads it now (preload_peers)."""
        if self._config.preload_peers:
            self._post(lambda: self.owner.apply_peer(peer))

    def on_cancellation(self, cancellation: dpb.Cancellation) -> None:
        """Directory client thread: hand the cancellation to the owner, which applies it at once."""
        stop = PushStop(StopCause.CANCELLED, cancellation.reason or "cancelled by the directory")
        self._post(lambda: self.owner.apply_stop(cancellation.transfer_id, stop))

    def on_rejection(self, rejection: dpb.EventRejection) -> None:
        """Directory client thread: a refused event; the owner stops a transfer the directory ended."""
        status = rejection.status
        _log.warning("directory refused an event", transfer_id=rejection.transfer_id, code=status.code,
                     message=status.message)
        if status.code in _TRANSFER_GONE_CODES:
            stop = PushStop(StopCause.REJECTED, f"directory refused the transfer: {status.message}")
            self._post(lambda: self.owner.apply_stop(rejection.transfer_id, stop))

    def on_session_reset(self, concerns: Callable[[str], bool] | None = None) -> None:
        """Directory client thread: the directory dropped this worker's session (the stream reconnected, or
        the lease was lost), failing every dispatched transfer; the owner stops those, re-announces the rest.
        With directory replicas `concerns(transfer_id)` names the transfers of the replica whose session broke."""
        self._post(lambda: self.owner.apply_session_reset(concerns))

    # ---------------------------------------------------------------- data-plane callbacks (I/O thread)

    def on_write_done(self, done: WriteDone) -> None:
        """NIXL I/O thread: one write's outcome."""
        self._post(lambda: self.owner.apply_write_done(done))

    def on_writer_quiet(self, quiet: WriterQuiet) -> None:
        """NIXL I/O thread: the data plane holds no handle of this transfer any more."""
        self._post(lambda: self.owner.apply_writer_quiet(quiet))

    # ---------------------------------------------------------------- engine hooks

    def defers_to_output(self) -> bool:
        """Caller: the prefill scheduler half of this engine, in this process (output_signal), once. From now on
        launch-bound steps push after their output left (ConnectorConfig.post_after_output); True if they can."""
        return self.post_policy.defer_to_output()

    def output_left(self, step_seq: int) -> None:
        """Caller: engine thread, update_from_output's last connector call: step `step_seq`'s sampled tokens go
        to vLLM's output thread now. Deferred steps up to it may push once output_grace_s passed.

        Blocks: never (one post, only when a deferred step waits). Failure: none.
        """
        if not self.post_policy.output_left(step_seq):
            return
        left_at = time.monotonic()
        self._post(lambda: self.owner.output_left(step_seq, left_at))

    def begin_step(self, meta: KVPushMetadata) -> None:
        """Caller: engine thread, bind_connector_metadata, before the forward.

        Blocks: never (posts StepStarted). Failure: bad chunks fail their transfer on the owner.
        """
        leftover = self.post_policy.begin_step(meta.step_seq)
        if leftover:
            # A step that ended without wait_for_save: the layers it saved go before this step's.
            self._post(lambda: self.owner.layers_saved(leftover))
        self._step_has_chunks = bool(meta.prefill_chunks)
        self._step_last_chunks = [chunk.request_id for chunk in meta.prefill_chunks if chunk.is_last]
        # Only an empty step after an empty step may wait: with async scheduling vLLM's engine core submits the
        # next step before it emits a forward's tokens, and where the worker runs in the engine core's process
        # (UniProcExecutor) that step runs in line, so a wait in it would hold back the tokens the forward
        # sampled (a prefill leg's answer). A worker process of its own (MultiprocExecutor) is not held back.
        self._empty_step = meta.empty_step and self._previous_step_empty
        self._previous_step_empty = meta.empty_step
        for chunk in meta.prefill_chunks:
            self._unreleased.add(chunk.request_id)
        self._post(lambda: self.owner.step_started(StepStarted(meta)))

    def save_kv_layer(self, layer_name: str) -> None:
        """Caller: forward thread, after a layer's attention wrote its KV, once per layer per step.

        Blocks: never: records a CUDA event (GPU) on the forward's stream and posts LayerSaved, or holds the layer
        (post_policy.PostPolicy). Failure: none here; the owner fails a transfer whose writes cannot be planned or
        posted.
        """
        if not self._step_has_chunks:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        saved_at = time.time()
        messages = self.post_policy.layer_saved(layer, saved_at)
        if not messages:
            return  # held
        if len(messages) == 1:
            message = messages[0]
            self._post(lambda: self.owner.layer_saved(message))
        else:
            self._post(lambda: self.owner.layers_saved(messages))
        if layer == self._last_layer and messages[-1].event is None:
            # CPU: prefill ended now. The step's timeline says so even if the owner has not caught up when this
            # step's worker metadata is built (the request's response is built in this step).
            for request_id in self._step_last_chunks:
                self._prefill_ends[request_id] = saved_at

    def wait_for_save(self) -> None:
        """Caller: engine thread, after the forward. Blocks: never (posts StepSaved). Failure: none.

        Layers whose save_kv_layer did not run this step are saved here, in order: vLLM skips the attention
        hooks when it replays a full CUDA graph (a step of one-token chunks under FULL_AND_PIECEWISE), and the
        whole forward is enqueued by now, so one ready event recorded here covers them.
        """
        if not self._step_has_chunks:
            return
        # One event, recorded after the whole forward was enqueued, covers every held layer.
        end = self.post_policy.step_saved(time.time())
        self._step_has_chunks = False
        step_seq = end.deferred_step_seq
        if step_seq is not None:
            # A launch-bound step, whose sampled token is next on this thread: its push waits for that token to
            # leave (output_left) rather than take the GIL from the sampling.
            self._post(lambda: self.owner.defer_step(step_seq, end.layers))
            return
        self._post(lambda: self.owner.layers_saved(end.layers, StepSaved()))

    def get_finished_sending(self, finished_req_ids: set[str]) -> set[str]:
        """Caller: engine thread, get_finished. Requests whose held blocks may be freed now, each once.

        Blocks: on the second and later of back-to-back steps that schedule no tokens while a push is unreleased,
        up to idle_step_wait_s for the owner to publish (so vLLM does not spin empty steps). Failure: none (bounds
        run on the owner).
        """
        self._seen_finished |= finished_req_ids & (self._unreleased | self._released)
        if self._empty_step and self._unreleased:
            self._empty_step = False
            self._read_outbox(self._config.idle_step_wait_s)
        else:
            self._read_outbox(0.0)
        done = self._released & self._seen_finished
        self._released -= done
        self._seen_finished -= done
        return done

    def build_worker_meta(self) -> KVPushWorkerMetadata | None:
        """Caller: engine thread, after get_finished. Push timelines that changed since the last call.

        Blocks: never. Failure: none.
        """
        self._read_outbox(0.0)
        if not self._timelines and not self._prefill_ends:
            return None
        reports = {request_id: TimelineReport(timeline.summary()) for request_id, timeline in self._timelines.items()}
        for request_id, end_time in self._prefill_ends.items():
            reports.setdefault(request_id, TimelineReport()).hook_prefill_end_time = end_time
        self._timelines, self._prefill_ends = {}, {}
        return KVPushWorkerMetadata(timelines={request_id: {self._tp_rank: report}
                                               for request_id, report in reports.items()})

    def has_live_transfers(self) -> bool:
        """True while a transfer of this worker has not been released (engine thread)."""
        return bool(self._unreleased)

    # ---------------------------------------------------------------- engine-thread internals

    def _read_outbox(self, wait_s: float) -> None:
        try:
            item = self._outbox.get(timeout=wait_s) if wait_s > 0 else self._outbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(item, Released):
                self._unreleased.discard(item.request_id)
                self._released.add(item.request_id)
            else:
                self._timelines[item.request_id] = item.timeline
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                return

    @staticmethod
    def _is_computed(event: ReadyEvent | None) -> bool:
        return event is None or bool(event.query())  # cudaEventQuery: never blocks

    def _record_ready_event(self) -> ReadyEvent | None:
        if not self._on_gpu:
            return None  # CPU attention wrote the KV synchronously before save_kv_layer
        import torch

        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        ready: ReadyEvent = event
        return ready


class PushOwner:
    """Every push of one prefill worker, on its owner thread (see the module docstring).

    The pushes themselves are `PushBook`'s (push_machine.py, pure); this class applies each message to it and
    delivers the effects it returns: writes to the transport, readiness and results to the directory, span events
    and ends, the outbox. Nothing here is touched by another thread: hooks and callbacks reach it only through posts.
    """

    def __init__(self, config: ConnectorConfig, directory: PrefillDirectory, layer_count: int,
                 block_size_tokens: int, transport: PushTransportPort,
                 publish: Callable[[Released | TimelineChanged], None], layer_groups: tuple[int, ...] = (),
                 state_group_block_sizes: tuple[tuple[int, int], ...] = ()) -> None:
        self._config = config
        self._directory = directory  # DirectoryLink with an open prefill session
        self._transport = transport
        self._publish = publish
        self._book = PushBook(PushRules(layer_count, block_size_tokens, config.push_timeout_s, config.max_write_s,
                                        config.fault_stall_after_writes, layer_groups, state_group_block_sizes))
        self._spans: dict[str, TransferSpan] = {}  # transfer id -> its push span, until the span ends
        self._pending_ready: list[dpb.LayerReady] = []
        self._next_bound_check = 0.0
        self._step_gap = StepGapWatch(_log)  # where the engine is when its steps stop while pushes wait
        self._deferred = DeferredSteps(config.output_grace_s, config.max_output_wait_s)  # post_after_output

    @property
    def book(self) -> PushBook:
        """The pushes (tests read it; only this owner changes it)."""
        return self._book

    # ---------------------------------------------------------------- engine-hook messages

    def step_started(self, message: StepStarted) -> None:
        """Open transfers for new chunks, apply holds and preemptions."""
        meta = message.meta
        now = time.monotonic()
        self._step_gap.stepped(now)
        # Deferred steps go first: those whose output left, and every one when this step changes what they
        # cover (a later chunk of their prompt, a hold, a preemption that frees their blocks).
        self._apply_deferred(self._deferred.take_due(now, every=bool(meta.prefill_chunks or meta.held_prefills
                                                                      or meta.preempted)), now)
        traceparents: dict[str, str] = {}
        for chunk in meta.prefill_chunks:
            if self._book.opens(chunk):
                span = TransferSpan.start("kvpush.push", chunk.transfer_id, chunk.trace_context,
                                          {"kvpush.request_id": chunk.request_id,
                                           "kvpush.prompt_token_count": chunk.prompt_token_count,
                                           "kvpush.cached_token_count": chunk.cached_token_count})
                self._spans[chunk.transfer_id] = span
                traceparents[chunk.request_id] = span.traceparent() or chunk.trace_context  # writes: its children
            _log.debug("chunk", transfer_id=chunk.transfer_id, token_start=chunk.token_start,
                       token_end=chunk.token_end, prompt=chunk.prompt_token_count, blocks=len(chunk.block_ids),
                       cached=chunk.cached_token_count)
        held = {request_id: meta.first_tokens.get(request_id) for request_id in meta.held_prefills}
        self._deliver(self._book.step_started(list(meta.prefill_chunks), held, list(meta.preempted), traceparents,
                                              now))

    def layer_saved(self, message: LayerSaved) -> None:
        """Mark the layer ready for this step's chunks and push what became possible."""
        self._deliver(self._book.layer_saved(message, time.monotonic()))

    def layers_saved(self, layers: list[LayerSaved], step: StepSaved | None = None) -> None:
        """The step's held layers, in order, then its end when it had one (wait_for_save's one post)."""
        self._deliver(self._book.layers_saved(layers, step is not None, time.monotonic()))

    def defer_step(self, step_seq: int, layers: list[LayerSaved]) -> None:
        """A launch-bound step ended (post_after_output): keep its layers, and its StepSaved, until its output
        left."""
        self._deferred.defer(step_seq, self._book.take_step_chunks(), layers, time.monotonic())

    def output_left(self, step_seq: int, left_at: float) -> None:
        """Steps up to `step_seq` had their output processed at `left_at`: apply them output_grace_s later."""
        self._deferred.output_left(step_seq, left_at)
        now = time.monotonic()
        self._apply_deferred(self._deferred.take_due(now), now)

    def _apply_deferred(self, steps: list[DeferredStep], now: float) -> None:
        """Apply deferred steps, oldest first, each with its own chunks."""
        for deferred in steps:
            self._deliver(self._book.apply_deferred(deferred.chunks, deferred.layers, now))

    def step_saved(self, message: StepSaved) -> None:
        """Queue this step's readiness (all layers of each chunk) to the directory."""
        self._deliver(self._book.layers_saved([], True, time.monotonic()))

    def _prefill_ended(self, request_id: str, end_time: float) -> None:
        self._deliver(self._book.prefill_ended(request_id, end_time))

    # ---------------------------------------------------------------- directory messages

    def apply_instruction(self, instruction: dpb.PushInstruction) -> None:
        """Record where to write and submit the backlog of ready layers."""
        peer_error: str | None = None
        guard: PostGuard | None = None
        decode_block_size = 0
        if self._book.wants_instruction(instruction.transfer_id):
            try:
                self._transport.ensure_peer(instruction.decode_agent_name, instruction.decode_agent_metadata,
                                            instruction.decode_layout if instruction.HasField("decode_layout")
                                            else None)
                # decode_block_ids count in decode's block size, which may not be this engine's.
                decode_block_size = self._transport.peer_block_size_tokens(instruction.decode_agent_name)
                if instruction.HasField("head_slice"):
                    self._transport.set_routes(instruction.transfer_id, self._head_routes(instruction))
            except (ValueError, RuntimeError) as exc:
                peer_error = str(exc)
            guard = self._lease_guard()
        self._deliver(self._book.instruction(Instruction(
            instruction.transfer_id, instruction.decode_agent_name, instruction.decode_engine_id,
            tuple(instruction.decode_block_ids), instruction.skip_token_count, instruction.prompt_token_count,
            bytes(instruction.notification), decode_block_size, _block_groups(instruction)), peer_error, guard,
            time.monotonic()))

    def _head_routes(self, instruction: dpb.PushInstruction) -> list[HeadRoute]:
        """The decode agents and KV heads of an instruction between engines of different TP sizes (its first
        destination and every further one), each agent loaded; raises ValueError when one cannot be."""
        cut = instruction.head_slice
        routes = [HeadRoute(instruction.decode_agent_name, cut.source_head_start, cut.destination_head_start,
                            cut.head_count, bytes(instruction.notification))]
        for more in instruction.more_destinations:
            self._transport.ensure_peer(more.decode_agent_name, more.decode_agent_metadata,
                                        more.decode_layout if more.HasField("decode_layout") else None)
            routes.append(HeadRoute(more.decode_agent_name, more.head_slice.source_head_start,
                                    more.head_slice.destination_head_start, more.head_slice.head_count,
                                    bytes(more.notification)))
        if any(route.head_count < 1 for route in routes):
            raise ValueError("a head slice of the instruction has no heads")
        return routes

    def apply_peer(self, peer: dpb.PeerAnnouncement) -> None:
        """Load an announced decode worker's agent ahead of the first instruction to it: its wire-up (it occupies
        the I/O thread) then happens when the peer joins, not on a request's path. Known agents are skipped;
        an agent that cannot be loaded is logged, and its first instruction tries again."""
        try:
            self._transport.ensure_peer(peer.decode_agent_name, peer.decode_agent_metadata, peer.decode_layout)
        except (ValueError, RuntimeError) as exc:
            _log.warning("announced decode peer refused", peer=peer.decode_agent_name,
                         decode_engine_id=peer.decode_engine_id, error=str(exc))

    def apply_stop(self, transfer_id: str, stop: PushStop) -> None:
        """Stop a transfer the directory cancelled or refused; confirm at once a cancellation of one not here."""
        self._deliver(self._book.stop_transfer(transfer_id, stop, time.monotonic()))

    def apply_session_reset(self, concerns: Callable[[str], bool] | None = None) -> None:
        """The directory failed every dispatched transfer of this worker (or, replicas, those `concerns` names):
        stop those, re-announce the rest."""
        self._deliver(self._book.session_reset(concerns, time.monotonic()))

    # ---------------------------------------------------------------- data-plane messages

    def apply_write_done(self, done: WriteDone) -> None:
        """Count one write's outcome; settle the transfer if that ended it."""
        self._deliver(self._book.write_done(done, time.monotonic()))

    def apply_writer_quiet(self, quiet: WriterQuiet) -> None:
        """The data plane holds no handle of the transfer any more."""
        self._deliver(self._book.writer_quiet(quiet, time.monotonic()))

    # ---------------------------------------------------------------- owner-loop participant

    def poll(self, now: float) -> bool:
        """Owner thread, every loop iteration: publish changed timelines, enforce held requests' bounds.

        Never busy (returns False): it has no handle of its own in flight, and a deferred step's due time is
        met to within the loop's idle wake-up (notif_poll_s).
        """
        if self._deferred:
            self._apply_deferred(self._deferred.take_due(now), now)
        self._deliver(self._book.publish_changed_timelines())
        if now >= self._next_bound_check:
            self._next_bound_check = now + _BOUND_CHECK_S
            self._step_gap.check(now, self._book.live_count)
            self._deliver(self._book.enforce_bounds(now))
        return False

    def on_peer_leaving(self, peer: str, reason: str) -> None:
        """Nothing: the writer fails the peer's writes, whose outcomes come back here."""

    def peer_in_flight(self, peer: str) -> int:
        """No handle of its own."""
        return 0

    def shutdown(self, reason: str) -> None:
        """Nothing to fail: the writer reports every write it held."""

    # ---------------------------------------------------------------- delivering effects

    def _deliver(self, effects: PushEffects) -> None:
        """Carry out what the book decided, in its order (PushEffects)."""
        for ready in effects.ready:
            self._pending_ready.append(dpb.LayerReady(
                transfer_id=ready.transfer_id, layer_start=ready.layer_start, layer_end=ready.layer_end,
                token_start=ready.token_start, token_end=ready.token_end, source_block_ids=ready.source_block_ids,
                prompt_token_count=ready.prompt_token_count, plan_in_flight=ready.plan_in_flight,
                source_block_groups=[tpb.BlockGroup(group_index=index, block_ids=ids)
                                     for index, ids in enumerate(ready.source_block_groups)]))
        if effects.flush_ready:
            self._flush_ready()
        for order in effects.writes:
            self._submit(order)
        for transfer_id in effects.writer_cancels:
            self._transport.cancel(transfer_id)
        for event in effects.span_events:
            span = self._spans.get(event.transfer_id)
            if span is not None:
                span.event(event.name, event.attributes, time_s=event.time_seconds)
        for result in effects.results:
            self._send_result(result)
        for end in effects.span_ends:
            span = self._spans.pop(end.transfer_id, None)
            if span is not None:
                span.set_attributes(end.attributes)
                span.end(ok=end.ok, reason=end.reason)
        for item in effects.published:
            self._publish(item)
        for watch in effects.prefill_end_watches:
            # The callback runs on this (the I/O) thread.
            self._transport.when_computed(watch.event, self._prefill_end_callback(watch.request_id))
        for notice in effects.notices:
            log = {NoticeLevel.INFO: _log.info, NoticeLevel.WARNING: _log.warning,
                   NoticeLevel.ERROR: _log.error}[notice.level]
            log(notice.message, **notice.fields)

    def _prefill_end_callback(self, request_id: str) -> Callable[[float], None]:
        return lambda end_time: self._prefill_ended(request_id, end_time)

    def _submit(self, order: WriteOrder) -> None:
        write = order.write
        _log.debug("write", transfer_id=order.transfer_id, layer=write.layer, token_start=write.token_start,
                   token_end=write.token_end, notify=write.notify)
        try:
            self._transport.submit(order.transfer_id, order.peer_agent, write, order.notification, order.ready_event,
                                   order.traceparent, order.post_guard)
        except Exception as exc:  # refused before anything was posted
            self._deliver(self._book.write_refused(order.transfer_id, write.layer, str(exc), time.monotonic()))
            return
        self._book.write_accepted(order.transfer_id)

    def _flush_ready(self) -> None:
        session = self._directory.session
        if self._pending_ready and session is not None:
            events, self._pending_ready = self._pending_ready, []
            session.send_ready(events)

    def _send_result(self, result: PushResult) -> None:
        session = self._directory.session
        if session is None:
            return
        # A failure that left this worker without the decode agent (a write to it aborted, or an instruction
        # without the metadata it lacked) says so: the directory resends the metadata with the next instruction.
        dropped = (result.instructed_agent if result.outcome is not PushOutcome.DONE and result.instructed_agent
                   and not self._transport.has_peer(result.instructed_agent) else "")
        proto = dpb.WriteResult(transfer_id=result.transfer_id, status=write_result_status(result.outcome),
                                error_message=result.error[:1000], layers_written_count=result.layers_written_count,
                                bytes_written=result.bytes_written, dropped_decode_agent_name=dropped)
        if result.first_token_id is not None:
            proto.first_token_id = result.first_token_id
        if result.timeline is not None:
            proto.timing.CopyFrom(timing_proto(result.timeline))
        session.send_result(proto)

    def _lease_guard(self) -> PostGuard | None:
        """A check the data plane runs before posting each write of an instruction received now.

        The directory fences a rank whose lease is gone at lease deadline + max_write_s; this worker's
        deadline (renewal send time + TTL) is never after the directory's, so posting only while it holds
        (and only under the lease the instruction came with) keeps every write inside that fence.
        """
        registration = self._directory.registration
        if registration is None:
            return None
        generation = registration.registration_count

        def guard() -> str | None:
            if registration.holds_lease(generation, registration.ttl_s * _LEASE_MARGIN):
                return None
            return "the lease this push was instructed under is no longer held (lapsed, or the directory forgot it)"

        return guard


def timing_proto(timeline: PushTimeline) -> tpb.TransferTiming:
    """The wire form of a push timeline (one TP rank's TransferTiming)."""
    proto = tpb.TransferTiming(
        write_count=timeline.write_count, descriptor_count=timeline.descriptor_count,
        bytes_written=timeline.bytes_written, writes_before_prefill_end_count=timeline.writes_before_prefill_end_count,
        layers_written_before_prefill_end_count=timeline.layers_written_before_prefill_end_count)
    for name in ("first_write_start_time", "last_write_end_time", "prefill_end_time"):
        value = getattr(timeline, name)
        if value is not None:
            stamp = timestamp_pb2.Timestamp()
            stamp.FromNanoseconds(int(value * 1e9))
            getattr(proto, name).CopyFrom(stamp)
    for layer in sorted(timeline.layer_write_end_times):
        write = proto.layer_writes.add(layer=layer)
        write.end_time.FromNanoseconds(int(timeline.layer_write_end_times[layer] * 1e9))
        if layer in timeline.layer_write_post_times:
            write.post_time.FromNanoseconds(int(timeline.layer_write_post_times[layer] * 1e9))
    proto.post_duration.CopyFrom(duration_pb2.Duration(seconds=int(timeline.post_duration_s),
                                                       nanos=int((timeline.post_duration_s % 1) * 1e9)))
    return proto


def _block_groups(instruction: dpb.PushInstruction) -> dict[int, tuple[tuple[int, ...], int]] | None:
    """Decode's blocks per KV-cache group (group -> (block ids, first token)); None for a one-group instruction."""
    if not instruction.decode_block_groups:
        return None
    return {group.group_index: (tuple(group.block_ids), group.first_token)
            for group in instruction.decode_block_groups}
