"""The `kv_transfer_params` a request carries into kvpush engines, parsed strictly.

Prefill leg: {"transfer_id": T, "do_remote_decode": true, "traceparent": "00-...",
              "first_token_from_prefill": true} (max_tokens=1).
Decode leg:  {"transfer_id": T, "do_remote_prefill": true, "traceparent": "00-...",
              "first_token_from_prefill": true} or {..., "first_token_id": 17}.
First token from prefill (docs/gateway.md), the token the prefill leg sampled and the client already has
becomes the decode request's first sampled token (the decode engine's `ForcePrefillFirstToken` logits
processor, src/kvpush/connector/first_token.py, forces it). Two ways to name it:
- `first_token_from_prefill: true` on both legs (both legs sent at once): prefill's workers report the token
  with the transfer's DONE result, the directory passes it to decode with the COMPLETE event, and decode's
  scheduler half writes it into the request's `first_token_id` before the request's first step.
- `first_token_id` (decode leg): the token itself, for a decode leg sent after the prefill leg returned.
Both legs carry the same transfer id, minted by the directory's PlanTransfer or named by the gateway in it.
`plan_in_flight: true` (prefill leg): the gateway sent this leg before its PlanTransfer returned, so the
directory may not know the transfer yet; the workers mark their readiness so, and the directory holds it
for the plan (LayerReady.plan_in_flight). A request without these params is an ordinary local request and
the connector leaves it alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# Transfer ids are minted by the directory; bound them so a bad client cannot make us log megabytes.
_MAX_TRANSFER_ID_CHARS = 128
# Both legs: the first token travels from prefill to decode with the transfer's completion (module docstring).
FIRST_TOKEN_FROM_PREFILL_KEY = "first_token_from_prefill"
# Prefill leg: sent before the transfer's PlanTransfer returned (module docstring).
PLAN_IN_FLIGHT_KEY = "plan_in_flight"
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
    # Prefill leg: report the sampled token with the transfer's completion. Decode leg: wait for it with the
    # completion and sample it first.
    first_token_from_prefill: bool = False
    plan_in_flight: bool = False  # prefill leg: the directory may learn of the transfer after its readiness


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
    from_prefill = params.get(FIRST_TOKEN_FROM_PREFILL_KEY, False)
    if not isinstance(from_prefill, bool):
        raise TransferParamsError(f"kv_transfer_params.{FIRST_TOKEN_FROM_PREFILL_KEY} must be a boolean, "
                                  f"got {str(from_prefill)[:32]!r}")
    plan_in_flight = params.get(PLAN_IN_FLIGHT_KEY, False)
    if not isinstance(plan_in_flight, bool):
        raise TransferParamsError(f"kv_transfer_params.{PLAN_IN_FLIGHT_KEY} must be a boolean, "
                                  f"got {str(plan_in_flight)[:32]!r}")
    if plan_in_flight and not prefill_leg:
        raise TransferParamsError(f"kv_transfer_params.{PLAN_IN_FLIGHT_KEY} belongs on the prefill leg only")
    return TransferParams(transfer_id=transfer_id, is_prefill_leg=prefill_leg, traceparent=traceparent,
                          first_token_id=first_token_id, first_token_from_prefill=from_prefill,
                          plan_in_flight=plan_in_flight)
