"""Every push of one prefill worker as one state machine: `PushBook`, pure, like the directory's DirectoryState.

One owner (the prefill worker's `PushOwner`, on the NIXL I/O thread) applies each input here and delivers the
`PushEffects` it returns: writes to submit, writer cancels, readiness and results for the directory, span events
and ends, timelines and releases for the engine thread. Nothing here calls the transport, the directory or a
clock: times come in as `now` (monotonic seconds) or as the unix times the hooks and the data plane measured.

One `PushRecord` per transfer, in one `PushPhase`:

    ACTIVE --(stop, failure, or the last owed write landed)--> STOPPING --(no write in flight)--> QUIET
      QUIET --(reported: result, span, final timeline)--> SETTLED --(the request's hold arrived)--> RELEASED

QUIET lasts only while a DONE push waits for the hold that carries the request's first token (bounded by
push_timeout_s); otherwise a push is reported the moment it is quiet. A push with nothing in flight goes from
ACTIVE straight on as far as it can in one input. RELEASED is terminal: the record leaves the book.

`check_invariants()` (called from tests after every input) states what must always hold: a block of a layer is
planned once, writes in flight are planned minus finished and never negative, no result is sent twice, nothing
is released while a write can land, DONE only once every owed write landed with the closing one notified.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpush.api.outcome import PushOutcome, PushStop, StopCause
from kvpush.connector.metadata import PrefillChunk
from kvpush.connector.worker.ports import PostGuard, ReadyEvent
from kvpush.connector.worker.push_state import PlannedWrite, PushTimeline, PushTransfer

# Remember finished transfers a while, so a late instruction for one is answered, not re-created.
FINISHED_MEMORY = 4096

# Which transfers a session reset concerns (directory replicas); None: every one.
Concerns = Callable[[str], bool]
SpanValue = str | int | float | bool


class PushPhase(enum.Enum):
    """Where one transfer's push is (module docstring)."""

    ACTIVE = "active"
    STOPPING = "stopping"
    QUIET = "quiet"
    SETTLED = "settled"
    RELEASED = "released"


@dataclass(frozen=True, slots=True)
class PushRules:
    """The bounds and shape every push of a worker shares."""

    layer_count: int
    block_size_tokens: int
    push_timeout_seconds: float
    max_write_seconds: float
    stall_after_write_count: int | None = None  # fault injection (tests only): stop submitting after this many
    # Each layer's KV-cache group (hybrid KV-cache manager); empty: one group.
    layer_groups: tuple[int, ...] = ()
    # State groups (hybrid SSM models) as (group, tokens per block): their layers push one state block each.
    state_group_block_sizes: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class Instruction:
    """The directory's PushInstruction, as the push needs it (the peer is loaded by the owner)."""

    transfer_id: str
    decode_agent_name: str
    decode_engine_id: str
    decode_block_ids: tuple[int, ...]
    skip_token_count: int
    prompt_token_count: int
    notification: bytes
    # Decode's block size, which decode_block_ids count in (the decode agent's layout); 0: this worker's.
    decode_block_size_tokens: int = 0
    # Several KV-cache groups: per group, decode's blocks and the group's first token (None: one group).
    decode_block_groups: dict[int, tuple[tuple[int, ...], int]] | None = None


@dataclass(frozen=True, slots=True)
class LayerSaved:
    """save_kv_layer: `layer` of this step's chunks is computed (GPU: once `event` completes)."""

    layer: int
    event: ReadyEvent | None  # a CUDA event, or None (CPU, or a layer whose kernel vLLM synchronised)
    saved_at: float  # unix seconds, on the forward thread


@dataclass(frozen=True, slots=True)
class WriteDone:
    """One write's outcome, as the push consumes it (times are unix seconds)."""

    transfer_id: str
    outcome: PushOutcome
    error: str
    layer: int
    start_time: float | None
    end_time: float
    post_duration_s: float
    descriptor_count: int
    bytes_written: int


@dataclass(frozen=True, slots=True)
class WriterQuiet:
    """The data plane holds no handle of this transfer any more: its source blocks may be reused."""

    transfer_id: str
    outcome: PushOutcome
    error: str


# ---------------------------------------------------------------- effects


@dataclass(frozen=True, slots=True)
class WriteOrder:
    """A write to hand to the data plane; the owner reports back `write_accepted` or `write_refused`."""

    transfer_id: str
    peer_agent: str
    write: PlannedWrite
    notification: bytes
    ready_event: ReadyEvent | None
    traceparent: str
    post_guard: PostGuard | None


@dataclass(frozen=True, slots=True)
class LayerReadiness:
    """Layers [layer_start, layer_end) of tokens [token_start, token_end) are computed (a LayerReady)."""

    transfer_id: str
    layer_start: int
    layer_end: int
    token_start: int
    token_end: int
    source_block_ids: tuple[int, ...]
    prompt_token_count: int
    plan_in_flight: bool
    # Several KV-cache groups: every group's blocks for tokens [0, token_end) (the first is source_block_ids).
    source_block_groups: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class PushResult:
    """How a push ended, for the directory (a WriteResult); `instructed_agent` lets the owner say whether the
    data plane dropped the decode agent."""

    transfer_id: str
    outcome: PushOutcome
    error: str = ""
    timeline: PushTimeline | None = None
    layers_written_count: int = 0
    bytes_written: int = 0
    first_token_id: int | None = None
    instructed_agent: str = ""


@dataclass(frozen=True, slots=True)
class SpanEvent:
    """An event on a transfer's push span."""

    transfer_id: str
    name: str
    attributes: dict[str, SpanValue]
    time_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class SpanEnd:
    """A transfer's push span ends."""

    transfer_id: str
    ok: bool
    reason: str
    attributes: dict[str, SpanValue]


@dataclass(frozen=True, slots=True)
class Released:
    """A held request's blocks may be freed: its transfer is settled and no write is in flight."""

    request_id: str


@dataclass(frozen=True, slots=True)
class TimelineChanged:
    """The latest push timeline of a request (a snapshot: later writes make later snapshots)."""

    request_id: str
    timeline: PushTimeline


@dataclass(frozen=True, slots=True)
class PrefillEndWatch:
    """GPU: prefill of the request ends when `event` completes; the owner reports it (`prefill_ended`)."""

    request_id: str
    event: ReadyEvent


class NoticeLevel(enum.Enum):
    """How loud a notice is logged."""

    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class Notice:
    """Something the owner logs (no prompt, completion or credential ever goes in `fields`)."""

    level: NoticeLevel
    message: str
    fields: dict[str, SpanValue | None]


@dataclass(slots=True)
class PushEffects:
    """What one input asks the owner to deliver, in this order: readiness (flushed when asked), writes, writer
    cancels, span events, results, span ends, then the outbox (timelines and releases, in order)."""

    ready: list[LayerReadiness] = field(default_factory=list)
    flush_ready: bool = False
    writes: list[WriteOrder] = field(default_factory=list)
    writer_cancels: list[str] = field(default_factory=list)
    span_events: list[SpanEvent] = field(default_factory=list)
    results: list[PushResult] = field(default_factory=list)
    span_ends: list[SpanEnd] = field(default_factory=list)
    published: list[Released | TimelineChanged] = field(default_factory=list)
    prefill_end_watches: list[PrefillEndWatch] = field(default_factory=list)
    notices: list[Notice] = field(default_factory=list)


# ---------------------------------------------------------------- the record and the book


@dataclass(slots=True)
class PushRecord:
    """One transfer this worker pushes, with the request that owns its source blocks."""

    push: PushTransfer
    traceparent: str                           # the push span's: parent of every write's span
    sends_first_token: bool = False            # DONE waits for the hold, which carries the token
    plan_in_flight: bool = False               # readiness may precede the plan (LayerReady.plan_in_flight)
    phase: PushPhase = PushPhase.ACTIVE
    chunks: list[tuple[int, int]] = field(default_factory=list)
    held_since: float | None = None            # monotonic time the hold arrived (request_finished returned True)
    first_token_id: int | None = None          # the token the request sampled after its prompt (from the hold)
    instructed_agent: str = ""                 # the decode agent of the instruction received (applied or refused)
    post_guard: PostGuard | None = None        # set with the instruction: the lease it came under
    quiet_since: float | None = None           # monotonic time a DONE push started waiting for its first token
    sent_first_ready: bool = False             # the transfer's first readiness went out on this session
    cancel_requested: bool = False             # the directory asked for a stop: a result is owed
    writer_cancel_sent: bool = False
    result_count: int = 0                      # results sent for this record (at most one)

    @property
    def request_id(self) -> str:
        """The request owning the source blocks."""
        return self.push.request_id

    @property
    def transfer_id(self) -> str:
        """The transfer pushed."""
        return self.push.transfer_id

    @property
    def waits_for_first_token(self) -> bool:
        """DONE must carry the token the request samples after its prompt; it comes with the hold."""
        return (self.sends_first_token and self.held_since is None and self.push.outcome is PushOutcome.DONE
                and not self.cancel_requested)


class PushBook:
    """Every push of one prefill worker (module docstring). Each input returns the effects to deliver."""

    def __init__(self, rules: PushRules) -> None:
        self._rules = rules
        self._records: dict[str, PushRecord] = {}      # by request id
        self._by_transfer: dict[str, str] = {}         # transfer id -> request id
        self._finished: dict[str, PushOutcome] = {}    # transfer id -> outcome, bounded (FINISHED_MEMORY)
        self._step_chunks: list[PrefillChunk] = []     # the current step's chunks, until its StepSaved
        self._layer_events: dict[int, ReadyEvent] = {}     # GPU: layer -> event of its latest save_kv_layer
        self._dirty: set[str] = set()                  # requests whose timeline changed since the last tick
        self._violations: list[str] = []               # what a transition found broken (check_invariants)

    # ---------------------------------------------------------------- queries

    def record(self, request_id: str) -> PushRecord | None:
        """The live record of a request, if any."""
        return self._records.get(request_id)

    def record_of(self, transfer_id: str) -> PushRecord | None:
        """The live record of a transfer, if any."""
        request_id = self._by_transfer.get(transfer_id)
        return self._records.get(request_id) if request_id is not None else None

    def records(self) -> list[PushRecord]:
        """Every live record."""
        return list(self._records.values())

    def layer_event(self, layer: int) -> ReadyEvent | None:
        """The event of the layer's latest save_kv_layer (GPU), which its next writes wait for."""
        return self._layer_events.get(layer)

    @property
    def live_count(self) -> int:
        """Transfers not yet released."""
        return len(self._records)

    def opens(self, chunk: PrefillChunk) -> bool:
        """True when `chunk` starts a new push (the owner opens its span first)."""
        return (chunk.request_id not in self._records and chunk.transfer_id not in self._by_transfer
                and chunk.transfer_id not in self._finished)

    def wants_instruction(self, transfer_id: str) -> bool:
        """True when an instruction for the transfer would be applied (the owner loads its peer first)."""
        record = self.record_of(transfer_id)
        return record is not None and not record.push.terminal

    # ---------------------------------------------------------------- engine-hook inputs

    def step_started(self, chunks: list[PrefillChunk], held: dict[str, int | None], preempted: list[str],
                     traceparents: dict[str, str], now: float) -> PushEffects:
        """A step's chunks, holds (request -> its first token) and preemptions; `traceparents` names the span
        of each chunk that `opens` a push."""
        effects = PushEffects()
        self._step_chunks = []
        for request_id in preempted:
            record = self._records.get(request_id)
            if record is not None:
                self._stop(record, PushStop(StopCause.PREEMPTED,
                                            "prefill request was preempted; its source blocks were freed"),
                           effects, now)
        for chunk in chunks:
            self._start_chunk(chunk, traceparents.get(chunk.request_id), effects, now)
        for request_id, first_token_id in held.items():
            record = self._records.get(request_id)
            if record is None:
                effects.published.append(Released(request_id))  # nothing of it is pushed here (a reused id)
                continue
            record.held_since = now
            record.first_token_id = first_token_id
            if not record.push.fully_computed:
                self._stop(record, PushStop(StopCause.UNFINISHED_PROMPT,
                                            "prefill request finished before its prompt was computed"),
                           effects, now)
        for record in list(self._records.values()):
            self._pump(record, effects, now)
        return effects

    def layer_saved(self, saved: LayerSaved, now: float) -> PushEffects:
        """Mark the layer ready for this step's chunks and plan what became possible."""
        effects = PushEffects()
        self._layer_saved(saved, effects, now)
        return effects

    def layers_saved(self, layers: list[LayerSaved], step_saved: bool, now: float) -> PushEffects:
        """The step's held layers, in order, then its end when it had one (wait_for_save's one post)."""
        effects = PushEffects()
        for saved in layers:
            self._layer_saved(saved, effects, now)
        if step_saved:
            self._step_saved(effects)
        return effects

    def take_step_chunks(self) -> list[PrefillChunk]:
        """The current step's chunks, handed to a deferred step (post_after_output); none left current."""
        chunks, self._step_chunks = self._step_chunks, []
        return chunks

    def apply_deferred(self, chunks: list[PrefillChunk], layers: list[LayerSaved], now: float) -> PushEffects:
        """A deferred step's layers and its StepSaved, applied to its own chunks."""
        current, self._step_chunks = self._step_chunks, chunks
        effects = self.layers_saved(layers, True, now)
        self._step_chunks = current
        return effects

    def prefill_ended(self, request_id: str, end_time: float) -> PushEffects:
        """The last layer of the request's last chunk was computed at `end_time` (unix seconds)."""
        effects = PushEffects()
        record = self._records.get(request_id)
        if record is not None:
            self._prefill_ended(record, end_time, effects)
        return effects

    # ---------------------------------------------------------------- directory inputs

    def instruction(self, instruction: Instruction, peer_error: str | None, post_guard: PostGuard | None,
                    now: float) -> PushEffects:
        """Record where to write and plan the backlog of ready layers; answer one for a push not here."""
        effects = PushEffects()
        record = self.record_of(instruction.transfer_id)
        if record is None:
            final = self._finished.get(instruction.transfer_id)
            effects.results.append(PushResult(
                instruction.transfer_id, PushOutcome.FAILED,
                f"transfer is {final.value if final else 'unknown'} on this prefill worker "
                "(request gone or worker restarted)"))
            return effects
        push = record.push
        if push.terminal:
            if record.phase is PushPhase.SETTLED and record.result_count == 0 and push.outcome is not None:
                # It ended before it was dispatched: say how.
                self._result(record, PushResult(push.transfer_id, push.outcome, push.reason), effects)
            return effects  # otherwise its result went (or goes, once quiet) to the directory when settled
        record.instructed_agent = instruction.decode_agent_name  # a refused instruction is answered too
        try:
            if peer_error is not None:
                raise ValueError(peer_error)
            push.set_instruction(instruction.decode_agent_name, instruction.decode_block_ids,
                                 instruction.skip_token_count, instruction.prompt_token_count,
                                 instruction.notification, instruction.decode_block_size_tokens,
                                 instruction.decode_block_groups)
        except ValueError as exc:
            self._stop(record, PushStop(StopCause.INSTRUCTION_REFUSED, f"instruction refused: {exc}"), effects, now)
            return effects
        record.post_guard = post_guard
        effects.span_events.append(SpanEvent(push.transfer_id, "instruction", {
            "kvpush.decode_engine_id": instruction.decode_engine_id,
            "kvpush.skip_token_count": instruction.skip_token_count}))
        if push.nothing_to_write():
            push.stop(PushStop(StopCause.NOTHING_TO_WRITE, "decode already holds every token"))
        self._pump(record, effects, now)
        return effects

    def stop_transfer(self, transfer_id: str, stop: PushStop, now: float) -> PushEffects:
        """The directory cancelled the transfer (CANCELLED) or refused an event of it (REJECTED): stop it.
        A cancellation of a transfer not here is confirmed at once (no write of it is in flight)."""
        effects = PushEffects()
        record = self.record_of(transfer_id)
        if record is None:
            if stop.cause is StopCause.CANCELLED:
                effects.results.append(PushResult(transfer_id, PushOutcome.CANCELLED))
            return effects
        record.cancel_requested = True
        self._stop(record, stop, effects, now)
        return effects

    def session_reset(self, concerns: Concerns | None, now: float) -> PushEffects:
        """The directory failed every dispatched transfer of this worker (or those `concerns` names): stop
        those, re-announce the rest on the new session."""
        effects = PushEffects()
        for record in list(self._records.values()):
            push = record.push
            if concerns is not None and not concerns(push.transfer_id):
                continue
            if push.terminal:
                continue
            if push.has_instruction:
                self._stop(record, PushStop(StopCause.SESSION_LOST,
                                            "directory session was lost; the directory failed the transfer"),
                           effects, now)
                continue
            record.sent_first_ready = False
            for start, end in record.chunks:
                if end <= min(push.tokens_ready):
                    self._queue_ready(record, start, end, 0, self._rules.layer_count, effects)
        effects.flush_ready = True
        return effects

    # ---------------------------------------------------------------- data-plane inputs

    def write_accepted(self, transfer_id: str) -> None:
        """The data plane queued a write of a WriteOrder."""
        record = self.record_of(transfer_id)
        if record is not None:
            record.push.write_submitted()

    def write_refused(self, transfer_id: str, layer: int, detail: str, now: float) -> PushEffects:
        """The data plane refused a WriteOrder before posting anything."""
        effects = PushEffects()
        record = self.record_of(transfer_id)
        if record is None:
            return effects
        stop = PushStop(StopCause.WRITE_REFUSED, f"write refused: {detail}")
        record.push.write_finished(PushOutcome.FAILED, stop.detail, end_time=0.0, layer=layer,
                                   cause=StopCause.WRITE_REFUSED)
        self._stop(record, stop, effects, now)
        return effects

    def write_done(self, done: WriteDone, now: float) -> PushEffects:
        """Count one write's outcome; settle the transfer if that ended it."""
        effects = PushEffects()
        record = self.record_of(done.transfer_id)
        if record is None:
            return effects
        push = record.push
        if done.start_time is not None:
            push.write_started(done.start_time, layer=done.layer)
        self._dirty.add(push.request_id)
        push.write_finished(done.outcome, done.error, done.end_time, done.post_duration_s, done.descriptor_count,
                            done.bytes_written, layer=done.layer)
        ok = done.outcome is PushOutcome.DONE
        attributes: dict[str, SpanValue] = {"kvpush.layer": done.layer, "kvpush.bytes": done.bytes_written,
                                            "kvpush.descriptor_count": done.descriptor_count}
        if done.error:
            attributes["kvpush.error"] = done.error
        effects.span_events.append(SpanEvent(push.transfer_id, "layer_write" if ok else "layer_write_failed",
                                             attributes, done.end_time))
        # A failed write failed the transfer in the writer too (it drops the rest and reports it quiet).
        self._settle_if_ended(record, effects, now)
        return effects

    def writer_quiet(self, quiet: WriterQuiet, now: float) -> PushEffects:
        """The data plane holds no handle of the transfer any more."""
        effects = PushEffects()
        record = self.record_of(quiet.transfer_id)
        if record is None:
            return effects
        record.push.writer_is_quiet()
        if quiet.outcome is not PushOutcome.DONE and not record.push.terminal:
            self._stop(record, PushStop(StopCause.DATA_PLANE_FAILED, quiet.error or "data plane failed the transfer"),
                       effects, now)
        self._settle_if_ended(record, effects, now)
        return effects

    # ---------------------------------------------------------------- time

    def publish_changed_timelines(self) -> PushEffects:
        """The timelines that changed since the last call."""
        effects = PushEffects()
        for request_id in sorted(self._dirty):
            record = self._records.get(request_id)
            if record is not None:
                effects.published.append(TimelineChanged(request_id, record.push.finalize_timeline().snapshot()))
        self._dirty.clear()
        return effects

    def enforce_bounds(self, now: float) -> PushEffects:
        """Held requests never wait past push_timeout_s; then their writes are cancelled and the blocks freed."""
        effects = PushEffects()
        rules = self._rules
        for record in list(self._records.values()):
            push = record.push
            if (record.phase is PushPhase.QUIET and record.quiet_since is not None and record.held_since is None
                    and now - record.quiet_since > rules.push_timeout_seconds):
                # Every write landed but the request never finished (a leg without max_tokens=1): report DONE
                # without the token rather than keep decode waiting for ever.
                effects.notices.append(Notice(NoticeLevel.WARNING,
                                              "first token not known within push_timeout_s; DONE reported without it",
                                              {"transfer_id": push.transfer_id, "request_id": push.request_id}))
                record.sends_first_token = False
                self._settle_if_ended(record, effects, now)
            if record.held_since is None:
                continue
            waited = now - record.held_since
            if waited > rules.push_timeout_seconds and not push.terminal:
                self._stop(record, PushStop(StopCause.PUSH_TIMEOUT,
                                            f"push not finished within push_timeout_s={rules.push_timeout_seconds}"),
                           effects, now)
            if (waited > rules.push_timeout_seconds + rules.max_write_seconds + 1.0
                    and record.phase is not PushPhase.SETTLED):
                # Writes were cancelled at push_timeout_s; none waits for its event past it and every posted one
                # ends within max_write_s, so the data plane holds none by now. One it still reports in flight is
                # lost to its bookkeeping: release the blocks rather than hold them for ever.
                effects.notices.append(Notice(
                    NoticeLevel.ERROR, "writes still in flight past push_timeout_s + max_write_s; releasing the blocks "
                    "anyway", {"transfer_id": push.transfer_id, "in_flight": push.in_flight}))
                push.abandon_in_flight()
                self._settle_if_ended(record, effects, now)
        return effects

    # ---------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Raise AssertionError if any rule of the module docstring is broken (tests call it after every input)."""
        if self._violations:
            raise AssertionError("; ".join(self._violations))
        assert set(self._by_transfer.values()) == set(self._records), "transfer index out of step with records"
        for transfer_id, request_id in self._by_transfer.items():
            assert self._records[request_id].transfer_id == transfer_id, f"{transfer_id}: indexed under another id"
        for record in self._records.values():
            self._check_record(record)

    def _check_record(self, record: PushRecord) -> None:
        push = record.push
        tid = push.transfer_id
        assert push.in_flight >= 0, f"{tid}: negative writes in flight"
        assert push.writes_submitted <= push.writes_planned, f"{tid}: more writes submitted than planned"
        assert record.result_count <= 1, f"{tid}: {record.result_count} results sent"
        for layer, ranges in enumerate(push.planned_ranges):
            previous_end = push.layer_skip_tokens[layer]
            for start, end in ranges:
                assert previous_end <= start < end <= push.prompt_token_count, \
                    f"{tid}: layer {layer} tokens [{start}, {end}) planned twice or out of range"
                # Blocks: a write starts at a block boundary unless it starts at decode's prefix hit.
                assert start % push.block_size_tokens == 0 or start == push.layer_skip_tokens[layer], \
                    f"{tid}: layer {layer} write starts mid-block at {start}"
                previous_end = end
        if push.outcome is PushOutcome.DONE and push.stopped_by is None:
            assert push.notify_planned and push.all_planned and push.writes_landed == push.writes_planned, \
                f"{tid}: DONE before every owed write landed"
        phase = record.phase
        assert phase is not PushPhase.RELEASED, f"{tid}: a released record is still in the book"
        assert (phase is PushPhase.ACTIVE) == (push.outcome is None), \
            f"{tid}: phase {phase} with outcome {push.outcome}"
        if phase in (PushPhase.QUIET, PushPhase.SETTLED):
            assert push.quiescent, f"{tid}: {phase.value} with a write in flight"
        if phase is PushPhase.QUIET:
            assert record.waits_for_first_token, f"{tid}: quiet without waiting for the first token"
        if phase is PushPhase.SETTLED:
            assert record.held_since is None, f"{tid}: settled and held but not released"

    # ---------------------------------------------------------------- internals

    def _start_chunk(self, chunk: PrefillChunk, traceparent: str | None, effects: PushEffects, now: float) -> None:
        record = self._records.get(chunk.request_id)
        if record is None:
            if chunk.transfer_id in self._by_transfer or chunk.transfer_id in self._finished:
                effects.notices.append(Notice(NoticeLevel.ERROR, "transfer id reused by another request; not pushed",
                                              {"transfer_id": chunk.transfer_id, "request_id": chunk.request_id}))
                return
            push = PushTransfer(chunk.transfer_id, chunk.request_id, chunk.prompt_token_count, self._rules.layer_count,
                                self._rules.block_size_tokens, self._rules.layer_groups,
                                dict(self._rules.state_group_block_sizes))
            record = PushRecord(push, traceparent or chunk.trace_context, sends_first_token=chunk.sends_first_token,
                                plan_in_flight=chunk.plan_in_flight)
            self._records[chunk.request_id] = record
            self._by_transfer[chunk.transfer_id] = chunk.request_id
        if record.push.terminal:
            return
        try:
            record.push.set_source_blocks(chunk.block_ids)
            for group, block_ids in enumerate(chunk.block_groups[1:], start=1):
                record.push.set_source_blocks(block_ids, group)
        except ValueError as exc:
            self._stop(record, PushStop(StopCause.BAD_CHUNK, str(exc)), effects, now)
            return
        if chunk.cached_token_count > 0:
            # This engine's prefix cache holds these tokens, never recomputed. They are pushed with each layer's
            # save_kv_layer of this step all the same (it marks [0, token_end) ready): vLLM shares blocks that
            # another request computes in this very step, so "cached" does not yet mean "written".
            self._queue_ready(record, 0, chunk.cached_token_count, 0, self._rules.layer_count, effects)
            effects.span_events.append(SpanEvent(chunk.transfer_id, "prefix_cache_ready",
                                                 {"kvpush.token_end": chunk.cached_token_count}))
        record.chunks.append((chunk.token_start, chunk.token_end))
        self._step_chunks.append(chunk)

    def _layer_saved(self, saved: LayerSaved, effects: PushEffects, now: float) -> None:
        layer = saved.layer
        if saved.event is not None:
            self._layer_events[layer] = saved.event
        for chunk in self._step_chunks:
            record = self._records.get(chunk.request_id)
            if record is None or record.push.terminal:
                continue
            record.push.mark_ready(layer, chunk.token_end)
            if not record.sent_first_ready:
                # The first readiness of a transfer goes out at once: the directory can dispatch the
                # instruction while the remaining layers compute.
                self._queue_ready(record, chunk.token_start, chunk.token_end, 0, layer + 1, effects)
                effects.flush_ready = True
            if layer == self._rules.layer_count - 1 and chunk.is_last:
                if saved.event is None:
                    self._prefill_ended(record, saved.saved_at, effects)
                else:
                    # The host runs ahead of the GPU: prefill ends when the last layer's kernel does.
                    effects.prefill_end_watches.append(PrefillEndWatch(chunk.request_id, saved.event))
            self._pump(record, effects, now)

    def _step_saved(self, effects: PushEffects) -> None:
        for chunk in self._step_chunks:
            record = self._records.get(chunk.request_id)
            if record is not None and not record.push.terminal:
                self._queue_ready(record, chunk.token_start, chunk.token_end, 0, self._rules.layer_count, effects)
        self._step_chunks = []
        effects.flush_ready = True

    def _prefill_ended(self, record: PushRecord, end_time: float, effects: PushEffects) -> None:
        push = record.push
        push.prefill_ended(end_time)
        effects.span_events.append(SpanEvent(push.transfer_id, "prefill_end",
                                             {"kvpush.token_end": push.prompt_token_count}, end_time))
        # At once: the request's response may be built in this very step.
        effects.published.append(TimelineChanged(push.request_id, push.finalize_timeline().snapshot()))

    def _queue_ready(self, record: PushRecord, token_start: int, token_end: int, layer_start: int, layer_end: int,
                     effects: PushEffects) -> None:
        if token_end <= token_start:
            return
        record.sent_first_ready = True
        push = record.push
        end_block = -(-token_end // push.block_size_tokens)
        groups = tuple(ids[:end_block] for ids in push.src_block_groups) if push.group_count > 1 else ()
        effects.ready.append(LayerReadiness(push.transfer_id, layer_start, layer_end, token_start, token_end,
                                            push.src_block_ids[:end_block], push.prompt_token_count,
                                            record.plan_in_flight, groups))

    def _pump(self, record: PushRecord, effects: PushEffects, now: float) -> None:
        """Plan every write that became possible; settle the transfer once it ended."""
        push = record.push
        if not push.terminal:
            stall = self._rules.stall_after_write_count
            if stall is not None and push.writes_submitted >= stall:
                return  # fault injection (tests only): behave like a writer that stopped making progress
            try:
                writes = push.next_writes()
            except ValueError as exc:
                self._stop(record, PushStop(StopCause.BAD_CHUNK, str(exc)), effects, now)
                return
            for write in writes:
                # The layer's latest event covers every token of it marked ready so far. None: CPU, or a layer not
                # computed since start-up (prefix-cache tokens from earlier steps, which vLLM synchronised).
                effects.writes.append(WriteOrder(push.transfer_id, push.peer_agent, write, push.notification,
                                                 self._layer_events.get(write.layer), record.traceparent,
                                                 record.post_guard))
        self._settle_if_ended(record, effects, now)

    def _stop(self, record: PushRecord, stop: PushStop, effects: PushEffects, now: float) -> None:
        """End the push (first stop wins) and make the data plane drop what it still holds of it."""
        push = record.push
        push.stop(stop)
        if push.writes_submitted and not push.writer_quiet and not record.writer_cancel_sent:
            record.writer_cancel_sent = True
            effects.writer_cancels.append(push.transfer_id)
        self._settle_if_ended(record, effects, now)

    def _settle_if_ended(self, record: PushRecord, effects: PushEffects, now: float) -> None:
        """Advance the phase: settle once the push ended and nothing is in flight; release once also held.

        The closing write carries the notification; the data plane sends it only after every write of
        the transfer landed (NIXL does not order handles), so decode never starts on partial KV.
        """
        push = record.push
        if record.phase is PushPhase.ACTIVE and push.terminal:
            record.phase = PushPhase.STOPPING
        if record.phase in (PushPhase.STOPPING, PushPhase.QUIET) and push.quiescent:
            if record.waits_for_first_token:
                if record.quiet_since is None:
                    record.quiet_since = now
                record.phase = PushPhase.QUIET
                return
            self._settle(record, effects)
        if record.phase is PushPhase.SETTLED and record.held_since is not None:
            self._release(record, effects)

    def _settle(self, record: PushRecord, effects: PushEffects) -> None:
        """The one place a transfer's end is decided: result, span end, log, final timeline."""
        record.phase = PushPhase.SETTLED
        push = record.push
        outcome = push.outcome
        assert outcome is not None
        timeline = push.finalize_timeline()
        done = outcome is PushOutcome.DONE
        if record.instructed_agent or record.cancel_requested:
            self._result(record, PushResult(
                push.transfer_id, outcome, push.reason if not done else "", timeline.snapshot() if done else None,
                push.layers_written(), timeline.bytes_written,
                record.first_token_id if done and record.sends_first_token else None, record.instructed_agent),
                effects)
        values = {k: v for k, v in timeline.as_dict().items() if v is not None}
        attributes: dict[str, SpanValue] = {f"kvpush.{k}": v for k, v in values.items() if k not in ("state", "reason")}
        attributes["kvpush.state"] = outcome.value
        effects.span_ends.append(SpanEnd(push.transfer_id, done, push.reason, attributes))
        self._dirty.discard(push.request_id)
        final = timeline.snapshot()
        final.settled = True  # the one timeline that says how the push ended (metrics count it once)
        effects.published.append(TimelineChanged(push.request_id, final))
        effects.notices.append(Notice(NoticeLevel.INFO if done else NoticeLevel.WARNING, "push ended",
                                      {"transfer_id": push.transfer_id, "request_id": push.request_id, **values}))

    def _result(self, record: PushRecord, result: PushResult, effects: PushEffects) -> None:
        record.result_count += 1
        effects.results.append(result)

    def _release(self, record: PushRecord, effects: PushEffects) -> None:
        push = record.push
        if not push.quiescent:
            self._violations.append(f"{push.transfer_id}: released with a write in flight")
        record.phase = PushPhase.RELEASED
        self._records.pop(push.request_id, None)
        self._by_transfer.pop(push.transfer_id, None)
        if push.outcome is not None:
            self._finished[push.transfer_id] = push.outcome
        while len(self._finished) > FINISHED_MEMORY:
            self._finished.pop(next(iter(self._finished)))
        effects.published.append(Released(push.request_id))
