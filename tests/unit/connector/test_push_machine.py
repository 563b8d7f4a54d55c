"""PushBook, the prefill worker's push state machine, driven directly: every input, then check_invariants().

A small harness plays the data plane (accepts or refuses each WriteOrder, lands or fails accepted writes, reports
the transfer quiet once it holds none) and records every effect, so the tests assert on what the owner would
deliver: the writes and their token ranges, the results sent to the directory, the releases.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.api.outcome import PushOutcome, PushStop, StopCause
from kvpush.connector.metadata import PrefillChunk
from kvpush.connector.worker.push_machine import (
    Instruction,
    LayerSaved,
    PushBook,
    PushEffects,
    PushPhase,
    PushResult,
    PushRules,
    Released,
    TimelineChanged,
    WriteDone,
    WriteOrder,
    WriterQuiet,
)

LAYERS = 3
BLOCK = 16
PROMPT = 40
_PHASE_ORDER = list(PushPhase)


@dataclass
class Harness:
    """The book, a scripted data plane, and everything delivered."""

    book: PushBook = field(default_factory=lambda: PushBook(PushRules(LAYERS, BLOCK, 5.0, 1.0)))
    now: float = 100.0
    accepted: list[WriteOrder] = field(default_factory=list)      # in flight at the data plane
    orders: list[WriteOrder] = field(default_factory=list)        # every order, accepted or refused
    results: list[PushResult] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    timelines: list[TimelineChanged] = field(default_factory=list)
    cancelled: set[str] = field(default_factory=set)              # writer cancels asked for
    failed_at_writer: set[str] = field(default_factory=set)       # a write failed: the writer ends the transfer
    quiet_sent: set[str] = field(default_factory=set)
    refuse_next: bool = False
    phases: dict[str, int] = field(default_factory=dict)

    def apply(self, effects: PushEffects) -> None:
        for order in effects.writes:
            self.orders.append(order)
            if self.refuse_next:
                self.refuse_next = False
                self.apply(self.book.write_refused(order.transfer_id, order.write.layer, "no such peer", self.now))
            else:
                self.accepted.append(order)
                self.book.write_accepted(order.transfer_id)
        self.cancelled.update(effects.writer_cancels)
        self.results.extend(effects.results)
        for item in effects.published:
            if isinstance(item, Released):
                assert item.request_id not in self.released, "released twice"
                self.released.append(item.request_id)
            else:
                self.timelines.append(item)
        self.check()

    def check(self) -> None:
        self.book.check_invariants()
        for record in self.book.records():
            rank = _PHASE_ORDER.index(record.phase)
            assert rank >= self.phases.get(record.transfer_id, 0), "a phase went back"
            self.phases[record.transfer_id] = rank
        for request_id in self.released:
            assert self.book.record(request_id) is None
        # Answers for a transfer not here (an instruction, or a cancellation confirmed at once) may repeat; the one
        # result of a push may not.
        owed = [r for r in self.results if r.transfer_id == "t1" and not r.error.startswith("transfer is ")
                and not (r.outcome is PushOutcome.CANCELLED and not r.error and not r.instructed_agent)]
        assert len(owed) <= 1, f"result sent twice: {owed}"

    # ---- inputs

    def step(self, *chunks: PrefillChunk, held: dict[str, int | None] | None = None,
             preempted: tuple[str, ...] = ()) -> None:
        traceparents = {c.request_id: f"tp-{c.transfer_id}" for c in chunks if self.book.opens(c)}
        self.apply(self.book.step_started(list(chunks), held or {}, list(preempted), traceparents, self.now))

    def layers(self, *layers: int, step_saved: bool = False) -> None:
        saved = [LayerSaved(layer, None, self.now) for layer in layers]
        self.apply(self.book.layers_saved(saved, step_saved, self.now))

    def instruct(self, transfer_id: str = "t1", skip: int = 0, peer_error: str | None = None) -> None:
        blocks = tuple(range(50, 50 + -(-PROMPT // BLOCK)))
        self.apply(self.book.instruction(Instruction(transfer_id, "d-agent", "d", blocks, skip, PROMPT,
                                                     transfer_id.encode()), peer_error, None, self.now))

    def land(self, index: int = 0, ok: bool = True) -> None:
        order = self.accepted.pop(index)
        if not ok:
            self.failed_at_writer.add(order.transfer_id)
        self.apply(self.book.write_done(WriteDone(
            order.transfer_id, PushOutcome.DONE if ok else PushOutcome.FAILED, "" if ok else "ERR",
            order.write.layer, self.now - 0.001, self.now, 0.0001, 1, 10), self.now))

    def quiet(self, transfer_id: str = "t1") -> bool:
        """The writer reports the transfer quiet when it would: nothing of it in flight, and it ended there."""
        if any(o.transfer_id == transfer_id for o in self.accepted) or transfer_id in self.quiet_sent:
            return False
        closing_landed = any(o.write.notify for o in self.orders if o.transfer_id == transfer_id) and not any(
            o.write.notify for o in self.accepted if o.transfer_id == transfer_id)
        submitted = any(o in self.orders for o in self.orders if o.transfer_id == transfer_id)
        if transfer_id in self.cancelled:
            outcome = PushOutcome.CANCELLED
        elif transfer_id in self.failed_at_writer:
            outcome = PushOutcome.FAILED
        elif closing_landed and submitted:
            outcome = PushOutcome.DONE
        else:
            return False
        self.quiet_sent.add(transfer_id)
        self.apply(self.book.writer_quiet(WriterQuiet(transfer_id, outcome, ""), self.now))
        return True

    def tick(self, seconds: float) -> None:
        self.now += seconds
        self.apply(self.book.enforce_bounds(self.now))
        self.apply(self.book.publish_changed_timelines())


def _chunk(start: int, end: int, request_id: str = "r1", transfer_id: str = "t1", **extra: object) -> PrefillChunk:
    blocks = tuple(range(10, 10 + -(-end // BLOCK)))
    return PrefillChunk(request_id, transfer_id, start, end, PROMPT, blocks, **extra)  # type: ignore[arg-type]


def _written_blocks(orders: list[WriteOrder]) -> list[tuple[int, int]]:
    """(layer, block) of every token written, once per block."""
    seen = []
    for order in orders:
        w = order.write
        seen += [(w.layer, block) for block in range(w.token_start // BLOCK, -(-w.token_end // BLOCK))]
    return seen


def test_a_push_streams_each_block_once_settles_done_after_the_closing_write_and_releases_on_the_hold():
    h = Harness()
    h.step(_chunk(0, 20))
    h.layers(0)
    h.instruct()
    h.layers(1, 2, step_saved=True)
    assert h.orders and all(o.write.token_end == 16 for o in h.orders)  # only the full block of a partial chunk
    h.step(_chunk(20, 40))
    h.layers(0, 1, 2, step_saved=True)
    blocks = _written_blocks(h.orders)
    assert sorted(blocks) == sorted(set(blocks)) == [(layer, b) for layer in range(LAYERS) for b in range(3)]
    assert [o.write.notify for o in h.orders].count(True) == 1 and h.orders[-1].write.notify
    while h.accepted:
        h.land()
    assert h.book.record("r1").phase is PushPhase.STOPPING  # DONE, but the writer has not reported it quiet
    assert h.quiet()
    assert h.book.record("r1").phase is PushPhase.SETTLED
    (result,) = h.results
    assert (result.outcome, result.layers_written_count, result.bytes_written) == (PushOutcome.DONE, LAYERS, 60)
    assert h.timelines[-1].timeline.settled and h.timelines[-1].timeline.state == "done"
    h.step(held={"r1": 7})
    assert h.released == ["r1"] and h.book.live_count == 0


def test_a_cancel_with_writes_in_flight_waits_for_them_and_the_writer_before_it_settles():
    h = Harness()
    h.step(_chunk(0, PROMPT))
    h.instruct()
    h.layers(0, 1, 2, step_saved=True)
    h.step(held={"r1": None})
    h.apply(h.book.stop_transfer("t1", PushStop(StopCause.CANCELLED, "gateway gave up"), h.now))
    assert h.cancelled == {"t1"} and h.results == [] and h.released == []
    assert h.book.record("r1").phase is PushPhase.STOPPING
    h.land()
    h.land(ok=False)
    assert h.released == []  # one write can still land
    h.land()
    assert h.released == [] and h.quiet()
    (result,) = h.results
    assert (result.outcome, result.error) == (PushOutcome.CANCELLED, "gateway gave up")
    assert h.released == ["r1"]


def test_a_cancellation_of_a_transfer_not_here_is_confirmed_and_a_rejection_is_not():
    h = Harness()
    h.apply(h.book.stop_transfer("gone", PushStop(StopCause.REJECTED, "refused"), h.now))
    h.apply(h.book.stop_transfer("gone", PushStop(StopCause.CANCELLED, "x"), h.now))
    assert [(r.transfer_id, r.outcome) for r in h.results] == [("gone", PushOutcome.CANCELLED)]


def test_a_session_reset_fails_an_instructed_push_and_re_announces_an_uninstructed_one():
    h = Harness()
    h.step(_chunk(0, PROMPT), _chunk(0, PROMPT, "r2", "t2"))
    h.instruct("t1")
    effects = h.book.layers_saved([LayerSaved(layer, None, h.now) for layer in range(LAYERS)], True, h.now)
    h.apply(effects)
    effects = h.book.session_reset(None, h.now)
    h.apply(effects)
    assert h.book.record("r1").push.stopped_by.cause is StopCause.SESSION_LOST
    assert [(r.transfer_id, r.token_end) for r in effects.ready] == [("t2", PROMPT)] and effects.flush_ready


def test_a_held_push_past_its_bound_is_stopped_then_its_unreported_writes_abandoned_and_released():
    h = Harness()
    h.step(_chunk(0, PROMPT))
    h.instruct()
    h.layers(0, 1, 2, step_saved=True)
    h.step(held={"r1": None})
    h.tick(5.5)
    record = h.book.record("r1")
    assert record.push.stopped_by.cause is StopCause.PUSH_TIMEOUT and h.cancelled == {"t1"}
    h.tick(2.0)  # past push_timeout + max_write + 1: the writes the data plane never reported are given up
    assert h.released == ["r1"]
    (result,) = h.results
    assert result.outcome is PushOutcome.FAILED and "push_timeout_s" in result.error


def test_a_push_that_sends_the_first_token_stays_quiet_until_the_hold_brings_it():
    h = Harness()
    h.step(_chunk(0, PROMPT, sends_first_token=True))
    h.instruct()
    h.layers(0, 1, 2, step_saved=True)
    while h.accepted:
        h.land()
    h.quiet()
    assert h.book.record("r1").phase is PushPhase.QUIET and h.results == []
    h.step(held={"r1": 42})
    (result,) = h.results
    assert (result.outcome, result.first_token_id) == (PushOutcome.DONE, 42) and h.released == ["r1"]


def test_a_refused_write_fails_the_push_and_decode_prefix_hit_covering_the_prompt_is_done_with_no_write():
    h = Harness()
    h.step(_chunk(0, PROMPT))
    h.refuse_next = True
    h.layers(0, 1, 2, step_saved=True)
    h.instruct()
    record = h.book.record("r1")
    assert record.push.stopped_by.cause is StopCause.WRITE_REFUSED
    h2 = Harness()
    h2.step(_chunk(0, PROMPT))
    h2.layers(0, 1, 2, step_saved=True)
    h2.instruct(skip=PROMPT)
    assert h2.orders == [] and [r.outcome for r in h2.results] == [PushOutcome.DONE]


def test_a_late_instruction_for_a_released_transfer_is_answered_with_how_it_ended():
    h = Harness()
    h.step(_chunk(0, PROMPT))
    h.step(held={"r1": None}, preempted=("r1",))
    assert h.released == ["r1"]
    h.instruct()
    assert [(r.outcome, r.error) for r in h.results] == [
        (PushOutcome.FAILED, "transfer is failed on this prefill worker (request gone or worker restarted)")]


# ---------------------------------------------------------------- random sequences

_OPS = st.sampled_from(["chunk", "layer", "step_saved", "instruct", "land", "fail", "quiet", "cancel", "reject",
                        "reset", "hold", "tick", "bound", "refuse", "preempt", "instruct_bad"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_OPS, st.integers(0, 7)), max_size=40), st.booleans(), st.booleans())
def test_any_sequence_of_inputs_keeps_every_invariant(ops, sends_first_token, chunked):
    h = Harness()
    bounds = [0, 20, PROMPT] if chunked else [0, PROMPT]
    next_chunk = 0
    for op, n in ops:
        if op == "chunk" and next_chunk + 1 < len(bounds):
            start, end = bounds[next_chunk], bounds[next_chunk + 1]
            next_chunk += 1
            h.step(_chunk(start, end, sends_first_token=sends_first_token))
        elif op == "layer":
            h.layers(n % LAYERS)
        elif op == "step_saved":
            h.layers(step_saved=True)
        elif op == "instruct":
            h.instruct(skip=(n * 7) % (PROMPT + 1))
        elif op == "instruct_bad":
            h.instruct(peer_error="layouts cannot exchange KV")
        elif op in ("land", "fail") and h.accepted:
            h.land(n % len(h.accepted), ok=op == "land")
        elif op == "quiet":
            h.quiet()
        elif op == "cancel":
            h.apply(h.book.stop_transfer("t1", PushStop(StopCause.CANCELLED, "cancelled"), h.now))
        elif op == "reject":
            h.apply(h.book.stop_transfer("t1", PushStop(StopCause.REJECTED, "gone"), h.now))
        elif op == "reset":
            h.apply(h.book.session_reset(None, h.now))
        elif op == "hold" and h.book.record("r1") is not None:
            h.step(held={"r1": n})
        elif op == "preempt":
            h.step(preempted=("r1",))
        elif op == "tick":
            h.tick(0.5 * n)
        elif op == "bound":
            h.tick(10.0)
        elif op == "refuse":
            h.refuse_next = True
    # Drain: every accepted write lands, the writer reports, the hold comes, the bounds pass.
    while h.accepted:
        h.land()
    h.quiet()
    if h.book.record("r1") is not None:
        h.step(held={"r1": 1})
    h.tick(10.0)
    h.tick(10.0)
    # A held push always ends: settled and released within its bounds, whatever happened before.
    assert h.book.record("r1") is None
    assert h.released in ([], ["r1"]) and (h.released == ["r1"]) == (next_chunk > 0 and "r1" in h.released)
    done = [r for r in h.results if r.transfer_id == "t1" and r.outcome is PushOutcome.DONE]
    for result in done:
        assert result.timeline is not None and result.layers_written_count == LAYERS
    blocks = _written_blocks(h.orders)
    assert len(blocks) == len(set(blocks)), "a block written twice"


# ---------------------------------------------------------------- decode of another block size

@settings(max_examples=200, deadline=None)
@given(st.integers(1, 300), st.lists(st.integers(1, 299), max_size=4), st.sampled_from([BLOCK, 128, 8, 24]),
       st.integers(0, 12), st.integers(1, 4))
def test_a_push_into_decode_blocks_of_another_size_writes_every_token_once(prompt, cuts, decode_block, hit_blocks,
                                                                          instruct_after):
    """Prefill blocks of 16, decode blocks of 16, 128, 8 or 24; the prompt in chunks ending anywhere; decode's prefix
    hit a multiple of its block size; the instruction between or after the chunks (the directory dispatches it
    after the first readiness). Each write lists
    prefill's blocks and decode's (in decode's size) holding [0, token_end), and every token after the hit is
    written exactly once per layer; the push ends DONE and the blocks are released."""
    ends = sorted({c for c in cuts if c < prompt} | {prompt})
    skip = min(hit_blocks * decode_block, prompt)
    h = Harness()
    src = tuple(range(10, 10 + -(-prompt // BLOCK)))
    dst = tuple(range(50, 50 + -(-prompt // decode_block)))

    def instruct() -> None:
        h.apply(h.book.instruction(Instruction("t1", "d-agent", "d", dst, skip, prompt, b"t1", decode_block), None,
                                   None, h.now))

    start = 0
    for i, end in enumerate(ends):
        if i == instruct_after:
            instruct()
        h.step(PrefillChunk("r1", "t1", start, end, prompt, src[:-(-end // BLOCK)]))
        h.layers(*range(LAYERS), step_saved=True)
        start = end
    if instruct_after >= len(ends):
        instruct()
    while h.accepted:
        h.land()
    h.quiet()
    h.step(held={"r1": 1})
    assert h.released == ["r1"]
    assert [r.outcome for r in h.results] == [PushOutcome.DONE], h.results
    for order in h.orders:
        w = order.write
        assert w.src_block_ids == src[:-(-w.token_end // BLOCK)], w
        assert w.dst_block_ids == dst[:-(-w.token_end // decode_block)], w
    for layer in range(LAYERS):
        tokens = sorted(t for o in h.orders if o.write.layer == layer
                        for t in range(o.write.token_start, o.write.token_end))
        assert tokens == list(range(skip, prompt)), (layer, skip)
    assert sum(o.write.notify for o in h.orders) == (1 if skip < prompt else 0)
