"""Every receive of one decode worker as one state machine: `ReceiveBook`, pure (no directory, no clock read).

The decode worker (`DecodeWorker`, engine thread) applies each input here and delivers the `ReceiveEffects` it
returns: cancels to send to the directory, span events and ends, the requests finished this step, their load
errors and first tokens. Times come in as `now` (monotonic seconds).

One `ReceiveRecord` per request waiting for pushed KV, in one `ReceivePhase`:

    WAITING --(transfer_timeout_s passed: CancelTransfer sent)--> EXPIRING
    WAITING or EXPIRING --(vLLM aborted the request)--> ABORTED
    any --(an ending signal whose not_before passed, or the unconfirmed-release bound)--> ENDED (record removed)

Signals (a notification, a directory event or lookup, a refused allocation, the local bound) are kept per
transfer, the first decisive one winning; a receive that awaits prefill's first token ends on the directory's
word, never on a notification alone (it carries no token). `check_invariants()` states what must hold.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvpush.api.outcome import ReceiveOutcome
from kvpush.connector.metadata import ReceiveStart
from kvpush.connector.worker.push_machine import Notice, NoticeLevel, SpanValue


class SignalSource(enum.Enum):
    """Where a receive's ending signal came from (the span's `kvpush.signal`)."""

    NOTIFICATION = "notification"  # prefill's NIXL notification: every write landed
    EVENT = "event"                # the directory's terminal TransferEvent
    LOOKUP = "lookup"              # GetTransfer after a watch gap
    ALLOCATION = "allocation"      # the directory refused decode's allocation report
    TIMEOUT = "timeout"            # decode's own bound, unconfirmed


@dataclass(frozen=True, slots=True)
class Signal:
    """A completion signal for a transfer: a notification (complete) or a terminal state."""

    outcome: ReceiveOutcome
    reason: str
    source: SignalSource
    received_at: float
    # Monotonic time before which the blocks must not be released (a write may still land): 0 for at once.
    not_before: float = 0.0
    first_token_id: int | None = None  # COMPLETE from the directory: prefill's first token, when it sent one


class ReceivePhase(enum.Enum):
    """Where one receive is (module docstring)."""

    WAITING = "waiting"
    EXPIRING = "expiring"
    ABORTED = "aborted"
    ENDED = "ended"


@dataclass(frozen=True, slots=True)
class ReceiveRules:
    """The bounds every receive of a worker shares."""

    block_size_tokens: int
    transfer_timeout_seconds: float


@dataclass(slots=True)
class ReceiveRecord:
    """One request waiting for pushed KV on this worker."""

    start: ReceiveStart
    deadline: float
    started_at: float
    phase: ReceivePhase = ReceivePhase.WAITING


@dataclass(frozen=True, slots=True)
class ReceiveSpanEvent:
    """An event on a receive's span."""

    request_id: str
    name: str


@dataclass(frozen=True, slots=True)
class ReceiveSpanEnd:
    """A receive's span ends."""

    request_id: str
    ok: bool
    reason: str
    attributes: dict[str, SpanValue]


@dataclass(slots=True)
class ReceiveEffects:
    """What one input asks the decode worker to deliver."""

    cancels: list[tuple[str, str]] = field(default_factory=list)  # (transfer id, reason) for the directory
    span_events: list[ReceiveSpanEvent] = field(default_factory=list)
    span_ends: list[ReceiveSpanEnd] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)
    load_errors: set[int] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)  # request ids of failed receives (also in finished)
    first_tokens: dict[str, int] = field(default_factory=dict)
    notices: list[Notice] = field(default_factory=list)


class ReceiveBook:
    """Every receive of one decode worker (module docstring)."""

    def __init__(self, rules: ReceiveRules) -> None:
        self._rules = rules
        self._records: dict[str, ReceiveRecord] = {}   # by request id
        self._by_transfer: dict[str, str] = {}
        self._early: dict[str, Signal] = {}            # the decisive signal per transfer, claimed or not (yet)
        # The directory's signal for a transfer whose notification came first: it ends a receive that awaits
        # prefill's first token (the notification carries none).
        self._after_notification: dict[str, Signal] = {}
        # Refused allocations end their own request only (another request may name the same transfer id).
        self._refused: dict[str, Signal] = {}
        self.completed_count = 0
        self.failed_count = 0

    # ---------------------------------------------------------------- queries

    def record(self, request_id: str) -> ReceiveRecord | None:
        """The waiting receive of a request, if any."""
        return self._records.get(request_id)

    def waiting_count(self) -> int:
        """Requests waiting for pushed KV."""
        return len(self._records)

    def waiting_transfers(self) -> list[str]:
        """Transfers a receive waits for."""
        return list(self._by_transfer)

    def starts(self, start: ReceiveStart) -> bool:
        """True when `start` begins a receive (the worker opens its span first)."""
        return start.request_id not in self._records

    def any_may_end(self) -> bool:
        """True when some receive has a signal that may end it (its not_before aside)."""
        return any(self._ending_signal(r) is not None for r in self._records.values())

    # ---------------------------------------------------------------- inputs

    def begin_step(self, receives: list[ReceiveStart], failed: list[tuple[str, str]], aborted: list[str],
                   now: float, unconfirmed_release_seconds: float) -> ReceiveEffects:
        """Start new receives, fail refused allocations, note aborts (each then waits at most
        `unconfirmed_release_seconds`, 2 x (lease TTL + max_write_s): decode.py, point 6)."""
        effects = ReceiveEffects()
        for start in receives:
            if start.request_id in self._records:
                continue
            if start.transfer_id in self._by_transfer:
                effects.notices.append(Notice(NoticeLevel.ERROR, "transfer id already received by another request",
                                              {"transfer_id": start.transfer_id, "request_id": start.request_id}))
            self._records[start.request_id] = ReceiveRecord(start, now + self._rules.transfer_timeout_seconds, now)
            self._by_transfer.setdefault(start.transfer_id, start.request_id)  # a duplicate leaves the first's
        for request_id, reason in failed:
            if request_id in self._records:
                self._refused[request_id] = Signal(ReceiveOutcome.FAILED, f"allocation refused: {reason}",
                                                   SignalSource.ALLOCATION, now)
        for request_id in aborted:
            record = self._records.get(request_id)
            if record is not None and record.phase is not ReceivePhase.ABORTED:
                record.phase = ReceivePhase.ABORTED
                record.deadline = now + unconfirmed_release_seconds
                effects.span_events.append(ReceiveSpanEvent(request_id, "aborted"))
        return effects

    def signal(self, transfer_id: str, signal: Signal, now: float) -> None:
        """Keep the first decisive signal per transfer; one that may release at once replaces a held one.

        After a notification, the directory's first signal is kept beside it: only the directory's COMPLETE
        carries prefill's first token, and a receive that awaits one ends on the directory's word.
        """
        held = self._early.get(transfer_id)
        if held is None:
            self._early[transfer_id] = signal
        elif held.source is SignalSource.NOTIFICATION and signal.source is not SignalSource.NOTIFICATION:
            self._after_notification.setdefault(transfer_id, signal)
        elif held.not_before > signal.not_before and signal.not_before <= now:
            self._early[transfer_id] = signal

    def collect(self, now: float, unconfirmed_release_seconds: float) -> ReceiveEffects:
        """End what may end now: deadlines, refused allocations, receives with an ending signal."""
        effects = ReceiveEffects()
        for record in list(self._records.values()):
            if now >= record.deadline:
                self._on_deadline(record, now, unconfirmed_release_seconds, effects)
        for request_id, signal in list(self._refused.items()):
            del self._refused[request_id]
            refused = self._records.get(request_id)
            if refused is not None:
                self._end(refused, signal, now, effects)
        for record in list(self._records.values()):
            ending = self._ending_signal(record)
            if ending is None or ending.not_before > now:
                continue
            self._early.pop(record.start.transfer_id, None)
            self._after_notification.pop(record.start.transfer_id, None)
            self._end(record, ending, now, effects)
        self._prune_early(now)
        return effects

    # ---------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Raise AssertionError if a rule is broken (tests call it after every input)."""
        for request_id, record in self._records.items():
            assert record.phase is not ReceivePhase.ENDED, f"{request_id}: ended but still waiting"
            assert record.start.request_id == request_id
        for transfer_id, request_id in self._by_transfer.items():
            assert request_id in self._records, f"{transfer_id}: indexed for a receive that is gone"
        for request_id in self._refused:
            assert request_id in self._records, f"{request_id}: refusal kept for a receive that is gone"

    # ---------------------------------------------------------------- internals

    def _ending_signal(self, record: ReceiveRecord) -> Signal | None:
        """The signal that may end this receive, if any (the caller checks its not_before).

        A notification cannot end a receive that awaits prefill's first token (it carries no token): the
        directory's COMPLETE, sent with prefill's DONE result, follows it. The deadline bounds that wait.
        """
        transfer_id = record.start.transfer_id
        signal = self._early.get(transfer_id)
        if signal is None:
            return None
        if (record.start.awaits_first_token and signal.source is SignalSource.NOTIFICATION
                and record.phase is not ReceivePhase.ABORTED):
            return self._after_notification.get(transfer_id)
        return signal

    def _on_deadline(self, record: ReceiveRecord, now: float, unconfirmed_release_seconds: float,
                     effects: ReceiveEffects) -> None:
        """A wait passed its bound: cancel, then wait (bounded) for the directory to confirm no write is in flight;
        only past that bound are the blocks released unconfirmed (logged): a request must end in bounded time."""
        start = record.start
        if record.phase is ReceivePhase.WAITING:
            record.phase = ReceivePhase.EXPIRING
            record.deadline = now + unconfirmed_release_seconds
            effects.span_events.append(ReceiveSpanEvent(start.request_id, "timeout"))
            effects.cancels.append((start.transfer_id, "transfer not complete within "
                                    f"transfer_timeout_s={self._rules.transfer_timeout_seconds}s"))
            return
        aborted = record.phase is ReceivePhase.ABORTED
        reason = (f"no terminal state within the bound after the {'abort' if aborted else 'timeout'}; "
                  "blocks released unconfirmed")
        effects.notices.append(Notice(NoticeLevel.WARNING, "releasing a receive's blocks on the local bound",
                                      {"transfer_id": start.transfer_id, "request_id": start.request_id,
                                       "aborted": aborted}))
        self._early[start.transfer_id] = Signal(ReceiveOutcome.EXPIRED, reason, SignalSource.TIMEOUT, now)

    def _end(self, record: ReceiveRecord, signal: Signal, now: float, effects: ReceiveEffects) -> None:
        start = record.start
        phase = record.phase
        record.phase = ReceivePhase.ENDED
        self._records.pop(start.request_id, None)
        if self._by_transfer.get(start.transfer_id) == start.request_id:
            self._by_transfer.pop(start.transfer_id)
            other = next((r.start.request_id for r in self._records.values()
                          if r.start.transfer_id == start.transfer_id), None)
            if other is not None:  # a duplicate receive of the same transfer is still waiting: it keeps the index
                self._by_transfer[start.transfer_id] = other
        effects.finished.add(start.request_id)
        waited = now - record.started_at
        attributes: dict[str, SpanValue] = {"kvpush.outcome": signal.outcome.value,
                                            "kvpush.signal": signal.source.value, "kvpush.wait_s": round(waited, 6),
                                            "kvpush.aborted": phase is ReceivePhase.ABORTED}
        ids = {"transfer_id": start.transfer_id, "request_id": start.request_id}
        if phase is ReceivePhase.ABORTED:
            effects.span_ends.append(ReceiveSpanEnd(start.request_id, False,
                                                    f"aborted; transfer {signal.outcome.value}", attributes))
            effects.notices.append(Notice(NoticeLevel.INFO, "aborted receive released",
                                          {**ids, "outcome": signal.outcome.value}))
            return
        if signal.outcome is ReceiveOutcome.COMPLETE:
            self.completed_count += 1
            if start.awaits_first_token:
                if signal.first_token_id is not None:
                    effects.first_tokens[start.request_id] = signal.first_token_id
                    attributes["kvpush.first_token_id"] = signal.first_token_id
                else:  # prefill finished without a token (its request aborted): decode samples freely
                    effects.notices.append(Notice(
                        NoticeLevel.WARNING, "transfer complete without prefill's first token; decode samples its own",
                        {**ids, "signal": signal.source.value}))
            effects.span_ends.append(ReceiveSpanEnd(start.request_id, True, "", attributes))
            effects.notices.append(Notice(NoticeLevel.INFO, "receive complete",
                                          {**ids, "signal": signal.source.value, "wait_s": round(waited, 4)}))
            return
        if phase is ReceivePhase.EXPIRING:
            signal = Signal(ReceiveOutcome.EXPIRED, f"timed out; transfer then {signal.outcome.value}: {signal.reason}",
                            signal.source, signal.received_at)
        self.failed_count += 1
        effects.load_errors.update(start.pushed_block_ids(self._rules.block_size_tokens))
        effects.failed.add(start.request_id)
        effects.span_ends.append(ReceiveSpanEnd(start.request_id, False, f"{signal.outcome.value}: {signal.reason}",
                                                attributes))
        effects.notices.append(Notice(NoticeLevel.WARNING, "receive failed; blocks reported as load errors",
                                      {**ids, "outcome": signal.outcome.value, "reason": signal.reason,
                                       "signal": signal.source.value}))

    def _prune_early(self, now: float) -> None:
        """Forget signals no receive claimed within transfer_timeout_s (transfers of other requests)."""
        horizon = now - self._rules.transfer_timeout_seconds
        for transfer_id in [t for t, s in self._early.items() if s.received_at < horizon
                            and t not in self._by_transfer]:
            del self._early[transfer_id]
            self._after_notification.pop(transfer_id, None)
