"""How a transfer ends, one vocabulary per side of the connector.

- `PushOutcome` (prefill): how one write, or a transfer's whole push, ended. The writer's outcomes, the
  prefill worker's push state, its WriteResult to the directory and its span all speak it.
- `ReceiveOutcome` (decode): how a receive ended. Notifications, the directory's terminal events and
  lookups, the decode worker's bookkeeping and its span all speak it.

The `.value` strings are what logs, spans (`kvpush.state`, `kvpush.outcome`) and the response's
push timeline (`state`) show; they are stable.
"""

from __future__ import annotations

import enum

from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb


class PushOutcome(enum.Enum):
    """How a write or a push ended on a prefill worker."""

    DONE = "done"            # every write landed (a push: every write it owes, the closing one notified)
    FAILED = "failed"        # a write failed, was refused, or the push was stopped by an error or bound
    CANCELLED = "cancelled"  # stopped on a cancellation; nothing more is written

    @property
    def write_result_status(self) -> int:
        """The WriteResultStatus a push that ended so is reported with."""
        return _WRITE_RESULT_STATUS[self]

    @property
    def severity(self) -> int:
        """Order for combining ranks: the worst outcome of any rank is the push's."""
        return _SEVERITY[self]


_WRITE_RESULT_STATUS = {
    PushOutcome.DONE: dpb.WRITE_RESULT_STATUS_DONE,
    PushOutcome.FAILED: dpb.WRITE_RESULT_STATUS_FAILED,
    PushOutcome.CANCELLED: dpb.WRITE_RESULT_STATUS_CANCELLED,
}
_SEVERITY = {PushOutcome.DONE: 1, PushOutcome.CANCELLED: 2, PushOutcome.FAILED: 3}
# The push timeline's `state` while a push has not ended.
PUSH_ACTIVE = "active"


class ReceiveOutcome(enum.Enum):
    """How a receive ended on a decode worker (the directory's terminal transfer states, as decode sees them)."""

    COMPLETE = "complete"    # every write landed (a notification, or the directory's COMPLETE)
    FAILED = "failed"        # a write or an engine failed, or the allocation was refused
    CANCELLED = "cancelled"  # the transfer was cancelled (a gateway, or decode's own abort)
    EXPIRED = "expired"      # it outlived its deadline (at the directory, or decode's local bound)

    @classmethod
    def from_transfer_state(cls, state: int) -> ReceiveOutcome | None:
        """The outcome a terminal TransferState means; None for a non-terminal one."""
        return _FROM_TRANSFER_STATE.get(state)


_FROM_TRANSFER_STATE = {
    tpb.TRANSFER_STATE_COMPLETE: ReceiveOutcome.COMPLETE,
    tpb.TRANSFER_STATE_FAILED: ReceiveOutcome.FAILED,
    tpb.TRANSFER_STATE_CANCELLED: ReceiveOutcome.CANCELLED,
    tpb.TRANSFER_STATE_EXPIRED: ReceiveOutcome.EXPIRED,
}
