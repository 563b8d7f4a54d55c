"""The `kv_transfer_params` of a kvpush request: one record for both legs, the only home of its keys.

The gateway builds each leg with `TransferParams` and sends `to_dict()`; a kvpush engine reads what arrives with
`parse()`, which is strict: a malformed value raises `TransferParamsError` naming the field.

Prefill leg: {"transfer_id": T, "do_remote_decode": true, "do_remote_prefill": false, "traceparent": "00-...",
              "first_token_from_prefill": true, "plan_in_flight": true} (max_tokens=1).
Decode leg:  {"transfer_id": T, "do_remote_prefill": true, "do_remote_decode": false, "traceparent": "00-...",
              "first_token_from_prefill": true} or {..., "first_token_id": 17}.

Both legs carry the same transfer id, minted by the directory's PlanTransfer or named by the gateway in it.
First token from prefill (docs/gateway.md): the token the prefill leg sampled, which the client already has,
becomes the decode request's first sampled token (the decode engine's `ForcePrefillFirstToken` logits processor,
kvpush.connector.first_token, forces it). Two ways to name it:
- `first_token_from_prefill: true` on both legs (both legs sent at once): prefill's workers report the token with
  the transfer's DONE result, the directory passes it to decode with the COMPLETE event, and decode's scheduler
  half writes it into the request's `first_token_id` (`write_first_token_id`) before the request's first step.
- `first_token_id` (decode leg): the token itself, for a decode leg sent after the prefill leg returned.
`plan_in_flight: true` (prefill leg): the gateway sent this leg before its PlanTransfer returned, so the directory
may not know the transfer yet; the workers mark their readiness so, and the directory holds it for the plan
(LayerReady.plan_in_flight). A request without these params is an ordinary local request: `parse()` returns None.

The prefill engine answers with its own params (`prefill_response_params`): the transfer id and the push timeline.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from dataclasses import dataclass

# The keys, here and nowhere else.
_TRANSFER_ID = "transfer_id"
_DO_REMOTE_DECODE = "do_remote_decode"    # vLLM's name: this request is the prefill leg (decode is remote)
_DO_REMOTE_PREFILL = "do_remote_prefill"  # vLLM's name: this request is the decode leg (prefill is remote)
_TRACEPARENT = "traceparent"
_FIRST_TOKEN_ID = "first_token_id"
_FIRST_TOKEN_FROM_PREFILL = "first_token_from_prefill"
_PLAN_IN_FLIGHT = "plan_in_flight"
_PUSH_TIMELINE = "push_timeline"

# Transfer ids are minted by the directory; bound them so a bad client cannot make us log megabytes.
MAX_TRANSFER_ID_CHARS = 128
_TRACEPARENT_FORMAT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


class TransferParamsError(ValueError):
    """kv_transfer_params ask for a kvpush transfer but are malformed; the message names the field."""


class Leg(enum.Enum):
    """Which of a transfer's two requests the params belong to."""

    PREFILL = "prefill"  # computes the prompt and pushes its KV (max_tokens=1)
    DECODE = "decode"    # receives the KV and produces the answer


@dataclass(frozen=True, slots=True)
class TransferParams:
    """One leg's transfer parameters: which transfer, which side, the W3C trace context, first-token handling."""

    transfer_id: str
    leg: Leg
    traceparent: str = ""
    first_token_id: int | None = None  # decode leg: the token its first step must sample (None: sample freely)
    # Prefill leg: report the sampled token with the transfer's completion. Decode leg: wait for it with the
    # completion and sample it first.
    first_token_from_prefill: bool = False
    plan_in_flight: bool = False  # prefill leg: the directory may learn of the transfer after its readiness

    @classmethod
    def prefill(cls, transfer_id: str, traceparent: str = "", *, plan_in_flight: bool = False) -> TransferParams:
        """The prefill leg of `transfer_id`."""
        return cls(transfer_id, Leg.PREFILL, traceparent, plan_in_flight=plan_in_flight)

    @classmethod
    def decode(cls, transfer_id: str, traceparent: str = "") -> TransferParams:
        """The decode leg of `transfer_id`."""
        return cls(transfer_id, Leg.DECODE, traceparent)

    @property
    def is_prefill_leg(self) -> bool:
        """True for the prefill leg."""
        return self.leg is Leg.PREFILL

    def replace(self, *, traceparent: str | None = None, first_token_id: int | None = None,
                first_token_from_prefill: bool | None = None) -> TransferParams:
        """A copy with the given fields changed (None: kept)."""
        return dataclasses.replace(
            self, traceparent=self.traceparent if traceparent is None else traceparent,
            first_token_id=self.first_token_id if first_token_id is None else first_token_id,
            first_token_from_prefill=(self.first_token_from_prefill if first_token_from_prefill is None
                                      else first_token_from_prefill))

    def to_dict(self) -> dict[str, object]:
        """The JSON object the gateway sends as the leg's `kv_transfer_params` (only the options that are set)."""
        prefill = self.is_prefill_leg
        params: dict[str, object] = {_TRANSFER_ID: self.transfer_id, _TRACEPARENT: self.traceparent,
                                     _DO_REMOTE_DECODE: prefill, _DO_REMOTE_PREFILL: not prefill}
        if self.first_token_id is not None:
            params[_FIRST_TOKEN_ID] = self.first_token_id
        if self.first_token_from_prefill:
            params[_FIRST_TOKEN_FROM_PREFILL] = True
        if self.plan_in_flight:
            params[_PLAN_IN_FLIGHT] = True
        return params


def parse(params: object) -> TransferParams | None:
    """The leg's TransferParams; None for a request that is no kvpush leg; TransferParamsError if malformed."""
    if not params or not isinstance(params, dict):
        return None
    prefill_leg = bool(params.get(_DO_REMOTE_DECODE))
    decode_leg = bool(params.get(_DO_REMOTE_PREFILL))
    if not prefill_leg and not decode_leg:
        return None
    if prefill_leg and decode_leg:
        raise TransferParamsError(f"kv_transfer_params sets both {_DO_REMOTE_DECODE} and {_DO_REMOTE_PREFILL}")
    transfer_id = params.get(_TRANSFER_ID)
    if not isinstance(transfer_id, str) or not transfer_id or len(transfer_id) > MAX_TRANSFER_ID_CHARS:
        raise TransferParamsError(
            f"kv_transfer_params.{_TRANSFER_ID} must be a non-empty string of at most {MAX_TRANSFER_ID_CHARS} "
            f"characters, got {str(transfer_id)[:64]!r}")
    traceparent = params.get(_TRACEPARENT) or ""
    if not isinstance(traceparent, str) or (traceparent and not _TRACEPARENT_FORMAT.match(traceparent)):
        traceparent = ""  # tracing is best effort: a bad traceparent starts a new trace, it fails nothing
    first_token_id = _token_id(params)
    if first_token_id is not None and prefill_leg:
        raise TransferParamsError(f"kv_transfer_params.{_FIRST_TOKEN_ID} belongs on the decode leg only")
    from_prefill = _flag(params, _FIRST_TOKEN_FROM_PREFILL)
    plan_in_flight = _flag(params, _PLAN_IN_FLIGHT)
    if plan_in_flight and not prefill_leg:
        raise TransferParamsError(f"kv_transfer_params.{_PLAN_IN_FLIGHT} belongs on the prefill leg only")
    return TransferParams(transfer_id=transfer_id, leg=Leg.PREFILL if prefill_leg else Leg.DECODE,
                          traceparent=traceparent, first_token_id=first_token_id,
                          first_token_from_prefill=from_prefill, plan_in_flight=plan_in_flight)


def first_token_id_of(params: object) -> int | None:
    """The `first_token_id` in a request's kv_transfer_params, whichever leg; None if unset.

    For the logits processor, which sees the params of every request: TransferParamsError for a value that is
    not a non-negative integer.
    """
    return _token_id(params) if isinstance(params, dict) else None


def write_first_token_id(params: dict[str, object], token_id: int) -> None:
    """Set a decode request's `first_token_id` in place (the dict vLLM hands the logits processor)."""
    params[_FIRST_TOKEN_ID] = token_id


def prefill_response_params(transfer_id: str, push_timeline: dict[str, object]) -> dict[str, object]:
    """The kv_transfer_params a prefill engine answers with: the transfer and its push timeline (the dict itself,
    so the timeline can still be filled in before vLLM serializes the response)."""
    return {_TRANSFER_ID: transfer_id, _PUSH_TIMELINE: push_timeline}


def _token_id(params: dict[object, object]) -> int | None:
    token = params.get(_FIRST_TOKEN_ID)
    if token is None:
        return None
    if isinstance(token, bool) or not isinstance(token, int) or token < 0:
        raise TransferParamsError(
            f"kv_transfer_params.{_FIRST_TOKEN_ID} must be a non-negative token id, got {str(token)[:32]!r}")
    return token


def _flag(params: dict[object, object], key: str) -> bool:
    value = params.get(key, False)
    if not isinstance(value, bool):
        raise TransferParamsError(f"kv_transfer_params.{key} must be a boolean, got {str(value)[:32]!r}")
    return value


__all__ = ["MAX_TRANSFER_ID_CHARS", "Leg", "TransferParams", "TransferParamsError", "first_token_id_of", "parse",
           "prefill_response_params", "write_first_token_id"]
