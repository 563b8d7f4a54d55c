"""ReceiveBook, the decode worker's receive state machine, driven directly: every input, then check_invariants().

The harness records what the decode worker would deliver (finished requests, load errors, first tokens, cancels
sent to the directory) and checks, across inputs, that a request ends once, that an aborted receive never
reports load errors, and that a phase never goes back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.api.outcome import ReceiveOutcome
from kvpush.connector.metadata import ReceiveStart
from kvpush.connector.worker.receive_machine import (
    ReceiveBook,
    ReceiveEffects,
    ReceivePhase,
    ReceiveRules,
    Signal,
    SignalSource,
)

BLOCK = 16
TIMEOUT = 5.0
UNCONFIRMED = 30.0
_ORDER = list(ReceivePhase)


@dataclass
class Harness:
    book: ReceiveBook = field(default_factory=lambda: ReceiveBook(ReceiveRules(BLOCK, TIMEOUT)))
    now: float = 1000.0
    finished: list[str] = field(default_factory=list)
    errors: set[int] = field(default_factory=set)
    tokens: dict[str, int] = field(default_factory=dict)
    cancels: list[tuple[str, str]] = field(default_factory=list)
    aborted: set[str] = field(default_factory=set)
    phases: dict[str, int] = field(default_factory=dict)

    def apply(self, effects: ReceiveEffects) -> ReceiveEffects:
        for request_id in effects.finished:
            assert request_id not in self.finished, f"{request_id} finished twice"
            self.finished.append(request_id)
            if request_id in self.aborted:
                assert not (set(effects.load_errors) & {1, 2}), "an aborted receive reported load errors"
        self.errors |= effects.load_errors
        self.tokens.update(effects.first_tokens)
        self.cancels += effects.cancels
        self.book.check_invariants()
        for request_id in ("r1",):
            record = self.book.record(request_id)
            if record is not None:
                rank = _ORDER.index(record.phase)
                assert rank >= self.phases.get(request_id, 0), "a phase went back"
                self.phases[request_id] = rank
        return effects

    def start(self, awaits: bool = False) -> None:
        self.apply(self.book.begin_step([ReceiveStart("r1", "t1", (1, 2), 32, 0, awaits_first_token=awaits)], [], [],
                                        self.now, UNCONFIRMED))

    def abort(self) -> None:
        self.aborted.add("r1")
        self.apply(self.book.begin_step([], [], ["r1"], self.now, UNCONFIRMED))

    def refuse(self) -> None:
        self.apply(self.book.begin_step([], [("r1", "no room")], [], self.now, UNCONFIRMED))

    def signal(self, outcome: ReceiveOutcome, source: SignalSource, token: int | None = None,
               not_before: float = 0.0) -> None:
        self.book.signal("t1", Signal(outcome, "why", source, self.now, not_before, token), self.now)
        self.book.check_invariants()

    def collect(self, advance: float = 0.0) -> ReceiveEffects:
        self.now += advance
        return self.apply(self.book.collect(self.now, UNCONFIRMED))


def test_a_notification_completes_a_receive_and_a_directory_failure_reports_its_blocks_as_load_errors():
    h = Harness()
    h.start()
    h.signal(ReceiveOutcome.COMPLETE, SignalSource.NOTIFICATION)
    assert h.collect().finished == {"r1"} and h.errors == set()
    h2 = Harness()
    h2.start()
    h2.signal(ReceiveOutcome.FAILED, SignalSource.EVENT)
    assert h2.collect().load_errors == {1, 2}


def test_a_receive_awaiting_the_first_token_ends_only_on_the_directory_word():
    h = Harness()
    h.start(awaits=True)
    h.signal(ReceiveOutcome.COMPLETE, SignalSource.NOTIFICATION)
    assert h.collect().finished == set()
    h.signal(ReceiveOutcome.COMPLETE, SignalSource.EVENT, token=9)
    assert h.collect().finished == {"r1"} and h.tokens == {"r1": 9}


def test_past_its_deadline_a_receive_is_cancelled_then_released_unconfirmed_as_expired():
    h = Harness()
    h.start()
    effects = h.collect(TIMEOUT)
    assert effects.cancels == [("t1", f"transfer not complete within transfer_timeout_s={TIMEOUT}s")]
    assert h.book.record("r1").phase is ReceivePhase.EXPIRING
    assert h.collect(UNCONFIRMED - 1).finished == set()
    h.collect(1.0)  # the bound passed: the local EXPIRED signal ...
    assert h.finished == ["r1"] and h.errors == {1, 2}


def test_an_expiring_receive_that_then_fails_reports_expired_and_an_aborted_one_no_load_errors():
    h = Harness()
    h.start()
    h.collect(TIMEOUT)
    h.signal(ReceiveOutcome.CANCELLED, SignalSource.EVENT)
    assert h.collect().load_errors == {1, 2}
    h2 = Harness()
    h2.start()
    h2.abort()
    h2.signal(ReceiveOutcome.CANCELLED, SignalSource.EVENT)
    effects = h2.collect()
    assert effects.finished == {"r1"} and effects.load_errors == set()


def test_a_refused_allocation_ends_its_own_request_and_a_lookup_waits_for_its_not_before():
    h = Harness()
    h.start()
    h.refuse()
    assert h.collect().load_errors == {1, 2}
    h2 = Harness()
    h2.start()
    h2.signal(ReceiveOutcome.FAILED, SignalSource.LOOKUP, not_before=h2.now + 3)
    assert h2.collect(1.0).finished == set()
    assert h2.collect(2.0).finished == {"r1"}


_OPS = st.sampled_from(["start", "start_awaits", "notify", "complete", "fail", "cancelled", "lookup_gone",
                        "abort", "refuse", "collect", "wait", "late"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_OPS, st.integers(0, 9)), max_size=30))
def test_any_sequence_of_inputs_keeps_every_invariant_and_every_receive_ends(ops):
    h = Harness()
    started = False
    for op, n in ops:
        if op in ("start", "start_awaits") and not started:
            started = True
            h.start(awaits=op == "start_awaits")
        elif op == "notify":
            h.signal(ReceiveOutcome.COMPLETE, SignalSource.NOTIFICATION)
        elif op == "complete":
            h.signal(ReceiveOutcome.COMPLETE, SignalSource.EVENT, token=n)
        elif op == "fail":
            h.signal(ReceiveOutcome.FAILED, SignalSource.EVENT)
        elif op == "cancelled":
            h.signal(ReceiveOutcome.CANCELLED, SignalSource.EVENT)
        elif op == "lookup_gone":
            h.signal(ReceiveOutcome.FAILED, SignalSource.LOOKUP, not_before=h.now + n)
        elif op == "abort" and started:
            h.abort()
        elif op == "refuse" and started:
            h.refuse()
        elif op == "collect":
            h.collect()
        elif op == "wait":
            h.collect(float(n))
        elif op == "late":
            h.collect(TIMEOUT + UNCONFIRMED)
    # Bounded: whatever happened, a started receive ends within its deadline and the unconfirmed bound.
    h.collect(TIMEOUT)
    h.collect(UNCONFIRMED)
    assert h.book.waiting_count() == 0
    assert h.finished == (["r1"] if started else [])
    if "r1" in h.tokens:
        assert h.errors == set()


def test_a_duplicate_receive_refused_in_its_first_step_leaves_the_first_its_transfer():
    """Two receives of one transfer start in one step and the second is refused there (its scheduler saw the first):
    the second ends FAILED at once, the first stays indexed (its transfer still watched) and ends on the transfer's
    notification; whichever ends first, the other keeps the index."""
    h = Harness()
    h.apply(h.book.begin_step([ReceiveStart("r1", "t1", (1, 2), 32, 0), ReceiveStart("r2", "t1", (3, 4), 32, 0)],
                              [("r2", "transfer t1 is already received by another request of this engine")], [],
                              h.now, UNCONFIRMED))
    h.collect()
    assert h.finished == ["r2"] and h.book.record("r1") is not None
    assert h.book.waiting_transfers() == ["t1"]
    h.signal(ReceiveOutcome.COMPLETE, SignalSource.NOTIFICATION)
    h.collect()
    assert h.finished == ["r2", "r1"] and h.book.waiting_transfers() == []
