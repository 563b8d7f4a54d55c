"""Decode engine, worker half: turns NIXL notifications and directory events into finished receives.

Life cycle of one receive on a decode worker (state lives on the engine thread; the NIXL I/O thread
and the directory client thread only enqueue into `_inbox`, drained at every hook):
  1. `register_kv_caches` (connector): KV memory registered with NIXL, this worker registered with
     the directory (agent metadata + layout, so prefill can write here), a NotificationListener and
     the WatchTransfers stream started.
  2. `begin_step`: a `ReceiveStart` from the scheduler starts waiting for the transfer, with a
     deadline of transfer_timeout_s. Signals that arrived earlier (fast prefill) are applied now.
  3. Completion is whichever comes first: prefill's NIXL notification (sent only after every write
     landed) or the directory's COMPLETE event. The request is reported in finished_recving. A receive
     that `awaits_first_token` (first token from prefill) completes only with the directory's word (its
     COMPLETE event, or a lookup of the COMPLETE transfer), which carries the token prefill sampled after
     the prompt; the token goes to the scheduler half in the same step's worker metadata (`first_tokens`),
     which makes it the request's first sampled token.
  4. Failure: a FAILED / EXPIRED / CANCELLED event (the directory sends one only once no write of the
     transfer can land: docs/connector.md, Block lifetime), a refused allocation report, or the deadline
     (then CancelTransfer, and the failure waits for the directory's terminal state) -> the request is
     reported in finished_recving and the blocks the push was to fill are reported as load errors in the
     same step, so vLLM's kv_load_failure_policy applies (fail: the request errors; recompute: decode
     computes those tokens itself, keeping its own prefix hit).
  5. Abort while waiting (`cancelled_receives`): the request is reported finished only once the
     transfer is terminal (the directory's CANCELLED comes after prefill confirmed no write is in
     flight), or a notification proved every write landed: vLLM frees the blocks only then, so prefill
     never writes into blocks another request reuses.
  6. A directory that never confirms (down, or decode cut off from it): the blocks are released after
     `_unconfirmed_release_s` = 2 x (lease TTL + max_write_s), the longest the directory itself may take
     to fence a silent prefill rank (revoke its lease after TTL + max_write_s, then its lease deadline +
     max_write_s); with the directory unreachable, prefill cannot renew its lease either, so it posts
     nothing after one TTL and its last write ends within max_write_s.
A watch gap (events lost) re-reads every waiting transfer with GetTransfer; one the directory no longer
knows (it restarted) fails once prefill's lease under the old directory surely ended (TTL + max_write_s).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpush.connector.config import ConnectorConfig
from kvpush.connector.metadata import KVPushMetadata, ReceiveStart
from kvpush.connector.outcome import ReceiveOutcome, receive_outcome_of
from kvpush.connector.tracing import TransferSpan
from kvpush.connector.worker.inbox import run_queued_actions, wait_for_actions
from kvpush.observability import get_logger
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb

_log = get_logger("connector.worker.decode")



@dataclass
class _Signal:
    """A completion signal for a transfer: a notification (complete) or a directory terminal state."""

    outcome: ReceiveOutcome
    reason: str
    source: str           # "notification" | "event" | "lookup" | "allocation" | "timeout"
    received_at: float
    # Monotonic time before which the blocks must not be released (a write may still land): 0 for at once.
    not_before: float = 0.0
    first_token_id: int | None = None  # COMPLETE from the directory: prefill's first token, when it sent one


@dataclass
class _Receive:
    """One request waiting for pushed KV on this worker."""

    start: ReceiveStart
    deadline: float
    span: TransferSpan
    started_at: float
    aborted: bool = False
    # Past transfer_timeout_s: cancelled at the directory, waiting (bounded) for it to confirm no write is in flight.
    expiring: bool = False


class DecodeWorker:
    """Worker half for kv_role=kv_consumer (see the module docstring)."""

    def __init__(self, config: ConnectorConfig, directory: Any, block_size_tokens: int) -> None:
        self._config = config
        self._directory = directory  # DirectoryLink: cancel_transfer / get_transfer
        self._block_size = block_size_tokens
        self._receives: dict[str, _Receive] = {}
        self._by_transfer: dict[str, str] = {}
        self._early: dict[str, _Signal] = {}   # signals for transfers no receive waits for (yet)
        # The directory's signal for a transfer whose notification came first: it ends a receive that awaits
        # prefill's first token (the notification carries none).
        self._after_notification: dict[str, _Signal] = {}
        # Refused allocations end their own request only (another request may name the same transfer id).
        self._refused: dict[str, _Signal] = {}
        self._load_errors: set[int] = set()
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        # The current step schedules no tokens and follows one that scheduled none either (see collect).
        self._empty_step = False
        self._previous_step_empty = True
        self.completed_count = 0
        self.failed_count = 0
        # Completed receives' first tokens from prefill, for this step's worker metadata (request id -> token).
        self._first_tokens: dict[str, int] = {}

    # ---------------------------------------------------------------- callbacks from other threads

    def on_notification(self, agent_name: str, message: bytes) -> None:
        """NIXL I/O thread: prefill finished every write of the transfer named by the message."""
        transfer_id = message.decode("utf-8", errors="replace")
        self._inbox.put(lambda: self._signal(transfer_id, _Signal(ReceiveOutcome.COMPLETE, "", "notification", time.monotonic())))

    def on_event(self, event: dpb.TransferEvent) -> None:
        """Directory client thread: a transfer of this engine reached a terminal state."""
        outcome = receive_outcome_of(event.state)
        if outcome is None:
            return
        signal = _Signal(outcome, event.reason, "event", time.monotonic(),
                         first_token_id=event.first_token_id if event.HasField("first_token_id") else None)
        self._inbox.put(lambda: self._signal(event.transfer_id, signal))

    def on_gap(self, last_sequence_number: int) -> None:
        """Directory client thread: events were lost; re-read every waiting transfer."""
        self._inbox.put(self._reread_all)

    # ---------------------------------------------------------------- engine-thread hooks

    def begin_step(self, meta: KVPushMetadata) -> None:
        """Start new receives, fail refused allocations, note aborts."""
        self._drain()
        # As on prefill: a wait in the step right after a forward would hold back that forward's tokens.
        self._empty_step = meta.empty_step and self._previous_step_empty
        self._previous_step_empty = meta.empty_step
        now = time.monotonic()
        for start in meta.receives:
            self._begin_receive(start, now)
        for request_id, reason in meta.failed_receives:
            receive = self._receives.get(request_id)
            if receive is not None:
                self._refused[request_id] = _Signal(ReceiveOutcome.FAILED, f"allocation refused: {reason}",
                                                    "allocation", now)
        for request_id in meta.cancelled_receives:
            receive = self._receives.get(request_id)
            if receive is not None and not receive.aborted:
                receive.aborted = True
                receive.deadline = now + self._unconfirmed_release_s()
                receive.span.event("aborted")

    def collect(self) -> tuple[set[str], set[int]]:
        """Requests finished receiving this step, and the block ids of those that failed (load errors)."""
        if (self._empty_step and self._receives
                and not any(self._ending_signal(r) is not None for r in self._receives.values())):
            # Nothing computed this step: wait (bounded) for a transfer signal rather than spin vLLM's loop.
            self._empty_step = False
            wait_for_actions(self._inbox, self._config.idle_step_wait_s, _log, "decode")
        self._drain()
        now = time.monotonic()
        for receive in list(self._receives.values()):
            if now >= receive.deadline:
                self._on_deadline(receive, now)
        finished: set[str] = set()
        for request_id, signal in list(self._refused.items()):
            del self._refused[request_id]
            receive = self._receives.get(request_id)
            if receive is not None:
                finished.add(request_id)
                self._end_receive(receive, signal)
        for request_id, receive in list(self._receives.items()):
            signal = self._ending_signal(receive)
            if signal is None or signal.not_before > now:
                continue
            self._early.pop(receive.start.transfer_id, None)
            self._after_notification.pop(receive.start.transfer_id, None)
            finished.add(request_id)
            self._end_receive(receive, signal)
        errors, self._load_errors = self._load_errors, set()
        self._prune_early(now)
        return finished, errors

    def take_first_tokens(self) -> dict[str, int]:
        """First tokens of receives completed since the last call (request id -> token), for the scheduler."""
        tokens, self._first_tokens = self._first_tokens, {}
        return tokens

    def waiting_count(self) -> int:
        """Requests waiting for pushed KV (for tests and metrics)."""
        return len(self._receives)

    # ---------------------------------------------------------------- internals

    def _drain(self) -> None:
        run_queued_actions(self._inbox, _log, "decode")

    def _begin_receive(self, start: ReceiveStart, now: float) -> None:
        if start.request_id in self._receives:
            return
        if start.transfer_id in self._by_transfer:
            _log.error("transfer id already received by another request", transfer_id=start.transfer_id,
                       request_id=start.request_id)
        span = TransferSpan.start("kvpush.receive", start.transfer_id, start.trace_context,
                                  {"kvpush.request_id": start.request_id,
                                   "kvpush.prompt_token_count": start.prompt_token_count,
                                   "kvpush.prefix_hit_token_count": start.prefix_hit_token_count,
                                   "kvpush.block_count": len(start.block_ids)})
        self._receives[start.request_id] = _Receive(start, now + self._config.transfer_timeout_s, span, now)
        self._by_transfer[start.transfer_id] = start.request_id

    def _signal(self, transfer_id: str, signal: _Signal) -> None:
        """Keep the first decisive signal per transfer; one that may release at once replaces a held one.

        After a notification, the directory's first signal is kept beside it: only the directory's COMPLETE
        carries prefill's first token, and a receive that awaits one ends on the directory's word.
        """
        held = self._early.get(transfer_id)
        if held is None:
            self._early[transfer_id] = signal
        elif held.source == "notification" and signal.source != "notification":
            self._after_notification.setdefault(transfer_id, signal)
        elif held.not_before > signal.not_before and signal.not_before <= time.monotonic():
            self._early[transfer_id] = signal

    def _ending_signal(self, receive: _Receive) -> _Signal | None:
        """The signal that may end this receive, if any (the caller checks its not_before).

        A notification cannot end a receive that awaits prefill's first token (it carries no token): the
        directory's COMPLETE, sent with prefill's DONE result, follows it. The deadline bounds that wait.
        """
        signal = self._early.get(receive.start.transfer_id)
        if signal is None:
            return None
        if receive.start.awaits_first_token and signal.source == "notification" and not receive.aborted:
            return self._after_notification.get(receive.start.transfer_id)
        return signal

    def _unconfirmed_release_s(self) -> float:
        """How long after a cancel decode waits for the directory before releasing blocks unconfirmed (point 6)."""
        return 2 * (self._lease_ttl_s() + self._config.max_write_s)

    def _lease_ttl_s(self) -> float:
        registration = getattr(self._directory, "registration", None)
        return registration.ttl_s if registration is not None else 10.0

    def _on_deadline(self, receive: _Receive, now: float) -> None:
        """A wait passed its bound: cancel, then wait for the directory to confirm no write is in flight.

        That wait is bounded too (`_unconfirmed_release_s`, point 6 of the module docstring); only past it are
        the blocks released without confirmation (logged), because a request must end in bounded time.
        """
        transfer_id = receive.start.transfer_id
        timeout = self._config.transfer_timeout_s
        if not receive.aborted and not receive.expiring:
            receive.expiring = True
            receive.deadline = now + self._unconfirmed_release_s()
            reason = f"transfer not complete within transfer_timeout_s={timeout}s"
            receive.span.event("timeout")
            self._directory.cancel_transfer(transfer_id, reason)
            return
        reason = (f"no terminal state within the bound after the {'abort' if receive.aborted else 'timeout'}; "
                  "blocks released unconfirmed")
        _log.warning("releasing a receive's blocks on the local bound", transfer_id=transfer_id,
                     request_id=receive.start.request_id, aborted=receive.aborted)
        self._early[transfer_id] = _Signal(ReceiveOutcome.EXPIRED, reason, "timeout", now)

    def _end_receive(self, receive: _Receive, signal: _Signal) -> None:
        start = receive.start
        self._receives.pop(start.request_id, None)
        if self._by_transfer.get(start.transfer_id) == start.request_id:
            self._by_transfer.pop(start.transfer_id)
        waited = time.monotonic() - receive.started_at
        receive.span.set_attributes({"kvpush.outcome": signal.outcome.value, "kvpush.signal": signal.source,
                                     "kvpush.wait_s": round(waited, 6), "kvpush.aborted": receive.aborted})
        if receive.aborted:
            receive.span.end(ok=False, reason=f"aborted; transfer {signal.outcome.value}")
            _log.info("aborted receive released", transfer_id=start.transfer_id, request_id=start.request_id,
                      outcome=signal.outcome.value)
            return
        if signal.outcome is ReceiveOutcome.COMPLETE:
            self.completed_count += 1
            if start.awaits_first_token:
                if signal.first_token_id is not None:
                    self._first_tokens[start.request_id] = signal.first_token_id
                    receive.span.set_attributes({"kvpush.first_token_id": signal.first_token_id})
                else:  # prefill finished without a token (its request aborted): decode samples freely
                    _log.warning("transfer complete without prefill's first token; decode samples its own",
                                 transfer_id=start.transfer_id, request_id=start.request_id, signal=signal.source)
            receive.span.end(ok=True)
            _log.info("receive complete", transfer_id=start.transfer_id, request_id=start.request_id,
                      signal=signal.source, wait_s=round(waited, 4))
            return
        if receive.expiring:
            signal = _Signal(ReceiveOutcome.EXPIRED, f"timed out; transfer then {signal.outcome.value}: {signal.reason}", signal.source,
                             signal.received_at)
        self.failed_count += 1
        self._load_errors.update(start.pushed_block_ids(self._block_size))
        receive.span.end(ok=False, reason=f"{signal.outcome.value}: {signal.reason}")
        _log.warning("receive failed; blocks reported as load errors", transfer_id=start.transfer_id,
                     request_id=start.request_id, outcome=signal.outcome.value, reason=signal.reason,
                     signal=signal.source)

    def _prune_early(self, now: float) -> None:
        """Forget signals no receive claimed within transfer_timeout_s (transfers of other requests)."""
        horizon = now - self._config.transfer_timeout_s
        for transfer_id in [t for t, s in self._early.items() if s.received_at < horizon
                            and t not in self._by_transfer]:
            del self._early[transfer_id]
            self._after_notification.pop(transfer_id, None)

    def _reread_all(self) -> None:
        for transfer_id in list(self._by_transfer):
            def done(transfer: tpb.Transfer | None, error: str, transfer_id: str = transfer_id) -> None:
                if transfer is None:
                    if "NOT_FOUND" in error.split(": ")[1:2]:  # DirectoryCallError "GetTransfer: NOT_FOUND: ..."
                        # The directory forgot it (it restarted): no event will ever come. Prefill stops on the new
                        # incarnation and cannot renew the old lease: no write lands after its TTL + max_write_s.
                        now = time.monotonic()
                        signal = _Signal(ReceiveOutcome.FAILED, f"directory no longer knows the transfer: {error}",
                                         "lookup", now, not_before=now + self._lease_ttl_s() + self._config.max_write_s)
                        self._inbox.put(lambda: self._signal(transfer_id, signal))
                    return  # other errors: the deadline still bounds the wait
                outcome = receive_outcome_of(transfer.state)
                if outcome is not None:
                    signal = _Signal(outcome, transfer.failure_reason, "lookup", time.monotonic(),
                                     first_token_id=transfer.first_token_id if transfer.HasField("first_token_id")
                                     else None)
                    self._inbox.put(lambda: self._signal(transfer_id, signal))

            self._directory.get_transfer(transfer_id, done)
