"""The `kv_transfer_params` a request carries into kvpush engines, parsed strictly.

Prefill leg: {"transfer_id": T, "do_remote_decode": true, "traceparent": "00-..."} (max_tokens=1).
Decode leg:  {"transfer_id": T, "do_remote_prefill": true, "traceparent": "00-...", "first_token_id": 17}.
`first_token_id` (decode leg, optional): the token the prefill leg produced and the client already has;
the decode engine's `ForcePrefillFirstToken` logits processor (connector/first_token.py) makes it the
request's first sampled token.
Both legs carry the same transfer id, minted by the directory's PlanTransfer. A request without these
params is an ordinary local request and the connector leaves it alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# Transfer ids are minted by the directory; bound them so a bad client cannot make us log megabytes.
_MAX_TRANSFER_ID_CHARS = 128
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


class TransferParamsError(ValueError):
    """kv_transfer_params ask for a kvpush transfer but are malformed; the message names the field."""


@dataclass(frozen=True)
class TransferParams:
    """One leg's transfer parameters: which transfer, which side, and the W3C trace context."""

    transfer_id: str
    is_prefill_leg: bool
    traceparent: str = ""
    first_token_id: int | None = None  # decode leg: the token its first step must sample (None: sample freely)


def parse_transfer_params(params: Any) -> TransferParams | None:
    """Return the leg's TransferParams, None for a request that is no kvpush leg; raise TransferParamsError if malformed."""
    if not params or not isinstance(params, dict):
        return None
    prefill_leg = bool(params.get("do_remote_decode"))
    decode_leg = bool(params.get("do_remote_prefill"))
    if not prefill_leg and not decode_leg:
        return None
    if prefill_leg and decode_leg:
        raise TransferParamsError("kv_transfer_params sets both do_remote_decode and do_remote_prefill")
    transfer_id = params.get("transfer_id")
    if not isinstance(transfer_id, str) or not transfer_id or len(transfer_id) > _MAX_TRANSFER_ID_CHARS:
        raise TransferParamsError(
            f"kv_transfer_params.transfer_id must be a non-empty string of at most {_MAX_TRANSFER_ID_CHARS} "
            f"characters, got {str(transfer_id)[:64]!r}")
    traceparent = params.get("traceparent") or ""
    if not isinstance(traceparent, str) or (traceparent and not _TRACEPARENT.match(traceparent)):
        traceparent = ""  # tracing is best effort: a bad traceparent starts a new trace, it fails nothing
    first_token_id = params.get("first_token_id")
    if first_token_id is not None:
        if prefill_leg:
            raise TransferParamsError("kv_transfer_params.first_token_id belongs on the decode leg only")
        if isinstance(first_token_id, bool) or not isinstance(first_token_id, int) or first_token_id < 0:
            raise TransferParamsError(
                f"kv_transfer_params.first_token_id must be a non-negative token id, got {str(first_token_id)[:32]!r}")
    return TransferParams(transfer_id=transfer_id, is_prefill_leg=prefill_leg, traceparent=traceparent,
                          first_token_id=first_token_id)
