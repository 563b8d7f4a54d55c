"""How a transfer ends, one vocabulary per side of the connector, and why a push stopped.

- `PushOutcome` (prefill): how one write, or a transfer's whole push, ended. The data plane's write outcomes,
  the prefill worker's push state, its WriteResult to the directory and its span all speak it.
- `StopCause` + `PushStop` (prefill): why a push ended other than by its last write landing; the cause says
  the outcome (a cancellation is CANCELLED, everything else FAILED, an instruction with nothing to write DONE),
  so no reason text is ever compared.
- `ReceiveOutcome` (decode): how a receive ended. Notifications, the directory's terminal events and lookups,
  the decode worker's bookkeeping and its span all speak it.

The `.value` strings are what logs, spans (`kvpush.state`, `kvpush.outcome`) and the response's push timeline
(`state`) show; they are stable. No protobuf here: the data plane speaks these enums too, and the wire mapping
lives on the connector's side (`kvpush.connector.outcome`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class PushOutcome(enum.Enum):
    """How a write or a push ended on a prefill worker."""

    DONE = "done"            # every write landed (a push: every write it owes, the closing one notified)
    FAILED = "failed"        # a write failed, was refused, or the push was stopped by an error or bound
    CANCELLED = "cancelled"  # stopped on a cancellation; nothing more is written

    @property
    def severity(self) -> int:
        """Order for combining ranks: the worst outcome of any rank is the push's."""
        return _SEVERITY[self]


_SEVERITY = {PushOutcome.DONE: 1, PushOutcome.CANCELLED: 2, PushOutcome.FAILED: 3}
# The push timeline's `state` while a push has not ended.
PUSH_ACTIVE = "active"


class StopCause(enum.Enum):
    """Why a push stopped before (or instead of) its last write landing."""

    CANCELLED = "cancelled"                    # the directory cancelled the transfer (or the data plane's cancel)
    REJECTED = "rejected"                      # the directory refused an event: it no longer knows the transfer
    PREEMPTED = "preempted"                    # vLLM preempted the request; its source blocks were freed
    UNFINISHED_PROMPT = "unfinished_prompt"    # the request finished before its prompt was computed
    BAD_CHUNK = "bad_chunk"                    # a chunk's blocks cannot be pushed (changed, or missing)
    INSTRUCTION_REFUSED = "instruction_refused"  # the instruction does not fit this transfer, or its peer
    SESSION_LOST = "session_lost"              # the directory dropped this worker's session
    WRITE_REFUSED = "write_refused"            # the data plane refused a write before posting anything
    WRITE_FAILED = "write_failed"              # a write did not land
    DATA_PLANE_FAILED = "data_plane_failed"    # the data plane ended the transfer failed
    PUSH_TIMEOUT = "push_timeout"              # held past push_timeout_s
    UNREPORTED_WRITES = "unreported_writes"    # writes the data plane never reported, past every bound
    NOTHING_TO_WRITE = "nothing_to_write"      # decode's prefix hit covers the prompt: DONE with no write

    @property
    def outcome(self) -> PushOutcome:
        """The outcome a push stopped for this cause ends with."""
        if self is StopCause.CANCELLED:
            return PushOutcome.CANCELLED
        if self is StopCause.NOTHING_TO_WRITE:
            return PushOutcome.DONE
        return PushOutcome.FAILED


@dataclass(frozen=True, slots=True)
class PushStop:
    """Why a push ended: a typed cause and the detail for logs, spans and the WriteResult's error."""

    cause: StopCause
    detail: str

    @property
    def outcome(self) -> PushOutcome:
        """How the push ends."""
        return self.cause.outcome


class ReceiveOutcome(enum.Enum):
    """How a receive ended on a decode worker (the directory's terminal transfer states, as decode sees them)."""

    COMPLETE = "complete"    # every write landed (a notification, or the directory's COMPLETE)
    FAILED = "failed"        # a write or an engine failed, or the allocation was refused
    CANCELLED = "cancelled"  # the transfer was cancelled (a gateway, or decode's own abort)
    EXPIRED = "expired"      # it outlived its deadline (at the directory, or decode's local bound)
