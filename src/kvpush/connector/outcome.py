"""The wire form of the outcome vocabulary (`kvpush.api.outcome`): WriteResultStatus and TransferState.

The enums live in `kvpush.api.outcome` (the data plane speaks them and imports no protobuf); this module maps
them to and from the directory's API for the connector's workers.
"""

from __future__ import annotations

from kvpush.api.outcome import PushOutcome, ReceiveOutcome
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb

__all__ = ["receive_outcome_of", "write_result_status"]

_WRITE_RESULT_STATUS: dict[PushOutcome, dpb.WriteResultStatus] = {
    PushOutcome.DONE: dpb.WRITE_RESULT_STATUS_DONE,
    PushOutcome.FAILED: dpb.WRITE_RESULT_STATUS_FAILED,
    PushOutcome.CANCELLED: dpb.WRITE_RESULT_STATUS_CANCELLED,
}

_FROM_TRANSFER_STATE: dict[tpb.TransferState, ReceiveOutcome] = {
    tpb.TRANSFER_STATE_COMPLETE: ReceiveOutcome.COMPLETE,
    tpb.TRANSFER_STATE_FAILED: ReceiveOutcome.FAILED,
    tpb.TRANSFER_STATE_CANCELLED: ReceiveOutcome.CANCELLED,
    tpb.TRANSFER_STATE_EXPIRED: ReceiveOutcome.EXPIRED,
}


def write_result_status(outcome: PushOutcome) -> dpb.WriteResultStatus:
    """The WriteResultStatus a push that ended so is reported with."""
    return _WRITE_RESULT_STATUS[outcome]


def receive_outcome_of(state: tpb.TransferState) -> ReceiveOutcome | None:
    """The receive outcome a terminal TransferState means; None for a non-terminal one."""
    return _FROM_TRANSFER_STATE.get(state)
