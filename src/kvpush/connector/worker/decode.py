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
from collections import OrderedDict
from collections.abc import Callable

from kvpush.api.outcome import ReceiveOutcome
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.metadata import KVPushMetadata
from kvpush.connector.outcome import receive_outcome_of
from kvpush.connector.tracing import TransferSpan
from kvpush.connector.worker.inbox import run_queued_actions, wait_for_actions
from kvpush.connector.worker.ports import DecodeDirectory
from kvpush.connector.worker.push_machine import Notice, NoticeLevel
from kvpush.connector.worker.receive_machine import ReceiveBook, ReceiveEffects, ReceiveRules, Signal, SignalSource
from kvpush.observability import get_logger
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb

_log = get_logger("connector.worker.decode")
# The lease TTL assumed before this worker registered (the directory's default).
_DEFAULT_LEASE_TTL_S = 10.0
# Bounds on notifications in parts: writers of one transfer, and transfers with parts still missing.
_MAX_WRITERS = 1024
_PARTS_MEMORY = 4096


class DecodeWorker:
    """Worker half for kv_role=kv_consumer (see the module docstring).

    The receives themselves are `ReceiveBook`'s (receive_machine.py, pure); this class turns the other threads'
    callbacks into signals on its inbox, applies the engine hooks to the book and delivers its effects.
    """

    def __init__(self, config: ConnectorConfig, directory: DecodeDirectory | None, block_size_tokens: int) -> None:
        self._config = config
        self._directory = directory  # DirectoryLink: cancel_transfer / get_transfer
        self._book = ReceiveBook(ReceiveRules(block_size_tokens, config.transfer_timeout_s))
        self._spans: dict[str, TransferSpan] = {}  # request id -> its receive span, until the span ends
        self._load_errors: set[int] = set()
        self._failed_requests: set[str] = set()
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        # The current step schedules no tokens and follows one that scheduled none either (see collect).
        self._empty_step = False
        self._legs_awaiting_prefill = 0
        self._previous_step_empty = True
        # Completed receives' first tokens from prefill, for this step's worker metadata (request id -> token).
        self._first_tokens: dict[str, int] = {}
        # Transfers written by several prefill workers: the notification parts seen so far (NIXL I/O thread).
        self._parts: OrderedDict[str, set[int]] = OrderedDict()

    @property
    def book(self) -> ReceiveBook:
        """The receives (tests read it; only this worker changes it)."""
        return self._book

    @property
    def completed_count(self) -> int:
        """Receives completed."""
        return self._book.completed_count

    @property
    def failed_count(self) -> int:
        """Receives failed (their blocks reported as load errors)."""
        return self._book.failed_count

    # ---------------------------------------------------------------- callbacks from other threads

    def on_notification(self, agent_name: str, message: bytes) -> None:
        """NIXL I/O thread: prefill finished every write of the transfer named by the message.

        With several prefill workers writing into this one (TP sizes differ) each sends "<id>\n<i>/<n>": the
        receive completes only once all n parts arrived.
        """
        text = message.decode("utf-8", errors="replace")
        transfer_id, _, part = text.partition("\n")
        if part:
            index, _, count = part.partition("/")
            if not (index.isdigit() and count.isdigit() and int(index) < int(count) <= _MAX_WRITERS):
                _log.warning("notification with a malformed part ignored", transfer_id=transfer_id, part=part[:32])
                return
            if not self._all_parts_arrived(transfer_id, int(index), int(count)):
                return
        self._post_signal(transfer_id, Signal(ReceiveOutcome.COMPLETE, "", SignalSource.NOTIFICATION,
                                              time.monotonic()))

    def _all_parts_arrived(self, transfer_id: str, index: int, count: int) -> bool:
        """Count one writer's notification (NIXL I/O thread only); True once all `count` of them arrived."""
        parts = self._parts.pop(transfer_id, set())
        parts.add(index)
        if len(parts) >= count:
            return True
        self._parts[transfer_id] = parts
        while len(self._parts) > _PARTS_MEMORY:  # transfers that ended otherwise (failed) leave partial counts
            self._parts.popitem(last=False)
        return False

    def on_event(self, event: dpb.TransferEvent) -> None:
        """Directory client thread: a transfer of this engine reached a terminal state."""
        outcome = receive_outcome_of(event.state)
        if outcome is None:
            return
        self._post_signal(event.transfer_id, Signal(
            outcome, event.reason, SignalSource.EVENT, time.monotonic(),
            first_token_id=event.first_token_id if event.HasField("first_token_id") else None))

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
        self._legs_awaiting_prefill = meta.legs_awaiting_prefill
        for start in meta.receives:
            if self._book.starts(start) and start.request_id not in self._spans:
                self._spans[start.request_id] = TransferSpan.start(
                    "kvpush.receive", start.transfer_id, start.trace_context,
                    {"kvpush.request_id": start.request_id, "kvpush.prompt_token_count": start.prompt_token_count,
                     "kvpush.prefix_hit_token_count": start.skip_token_count,
                     "kvpush.block_count": len(start.block_ids)})
        self._deliver(self._book.begin_step(list(meta.receives), list(meta.failed_receives),
                                            list(meta.cancelled_receives), time.monotonic(),
                                            self._unconfirmed_release_s()))

    def collect(self) -> tuple[set[str], set[int]]:
        """Requests finished receiving this step, and the block ids of those that failed (load errors)."""
        if self._empty_step and (self._book.waiting_count() or self._legs_awaiting_prefill) \
                and not self._book.any_may_end():
            # Nothing computed this step: wait (bounded) for a transfer signal rather than spin vLLM's loop (legs
            # waiting for their prefill's start keep it looping too; that start is seen in the scheduler).
            self._empty_step = False
            wait_for_actions(self._inbox, self._config.idle_step_wait_s, _log, "decode")
        self._drain()
        effects = self._book.collect(time.monotonic(), self._unconfirmed_release_s())
        self._deliver(effects)
        errors, self._load_errors = self._load_errors, set()
        return effects.finished, errors

    def take_failed_requests(self) -> set[str]:
        """Requests whose receive failed since the last call (each also reported finished by collect): how an engine
        of several KV-cache groups reports load failures (`failed_recving`), as vLLM cannot map block ids there."""
        failed, self._failed_requests = self._failed_requests, set()
        return failed

    def take_first_tokens(self) -> dict[str, int]:
        """First tokens of receives completed since the last call (request id -> token), for the scheduler."""
        tokens, self._first_tokens = self._first_tokens, {}
        return tokens

    def waiting_count(self) -> int:
        """Requests waiting for pushed KV (for tests and metrics)."""
        return self._book.waiting_count()

    # ---------------------------------------------------------------- internals

    def _drain(self) -> None:
        run_queued_actions(self._inbox, _log, "decode")

    def _post_signal(self, transfer_id: str, signal: Signal) -> None:
        self._inbox.put(lambda: self._book.signal(transfer_id, signal, time.monotonic()))

    def _deliver(self, effects: ReceiveEffects) -> None:
        for transfer_id, reason in effects.cancels:
            if self._directory is not None:
                self._directory.cancel_transfer(transfer_id, reason)
        for event in effects.span_events:
            span = self._spans.get(event.request_id)
            if span is not None:
                span.event(event.name)
        for end in effects.span_ends:
            span = self._spans.pop(end.request_id, None)
            if span is not None:
                span.set_attributes(end.attributes)
                span.end(ok=end.ok, reason=end.reason)
        self._load_errors |= effects.load_errors
        self._failed_requests |= effects.failed
        self._first_tokens.update(effects.first_tokens)
        for notice in effects.notices:
            _log_notice(notice)

    def _unconfirmed_release_s(self) -> float:
        """How long after a cancel decode waits for the directory before releasing blocks unconfirmed (point 6)."""
        return 2 * (self._lease_ttl_s() + self._config.max_write_s)

    def _lease_ttl_s(self) -> float:
        registration = self._directory.registration if self._directory is not None else None
        return registration.ttl_s if registration is not None else _DEFAULT_LEASE_TTL_S

    def _reread_all(self) -> None:
        if self._directory is None:
            return
        for transfer_id in self._book.waiting_transfers():
            self._directory.get_transfer(transfer_id, self._lookup_done(transfer_id))

    def _lookup_done(self, transfer_id: str) -> Callable[[tpb.Transfer | None, str], None]:
        def done(transfer: tpb.Transfer | None, error: str) -> None:
            if transfer is None:
                if "NOT_FOUND" in error.split(": ")[1:2]:  # DirectoryCallError "GetTransfer: NOT_FOUND: ..."
                    # The directory forgot it (it restarted): no event will ever come. Prefill stops on the new
                    # incarnation and cannot renew the old lease: no write lands after its TTL + max_write_s.
                    now = time.monotonic()
                    self._post_signal(transfer_id, Signal(
                        ReceiveOutcome.FAILED, f"directory no longer knows the transfer: {error}", SignalSource.LOOKUP,
                        now, not_before=now + self._lease_ttl_s() + self._config.max_write_s))
                return  # other errors: the deadline still bounds the wait
            outcome = receive_outcome_of(transfer.state)
            if outcome is not None:
                self._post_signal(transfer_id, Signal(
                    outcome, transfer.failure_reason, SignalSource.LOOKUP, time.monotonic(),
                    first_token_id=transfer.first_token_id if transfer.HasField("first_token_id") else None))

        return done


def _log_notice(notice: Notice) -> None:
    log = {NoticeLevel.INFO: _log.info, NoticeLevel.WARNING: _log.warning, NoticeLevel.ERROR: _log.error}[notice.level]
    log(notice.message, **notice.fields)
