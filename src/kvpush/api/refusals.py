"""Words in the directory's refusals that a caller acts on: one home for both sides, as long as refusals carry no
structured reason on the wire (a gRPC status code and a message only)."""

from __future__ import annotations

# FAILED_PRECONDITION of ReportAllocation: a block the decode engine names is still owned by a live transfer. It
# ends as soon as prefill's result reaches the directory, so a decode engine retries (connector.directory_link).
BLOCK_STILL_OWNED = "is already allocated to live transfer"


def block_still_owned(block_id: int, transfer_id: str) -> str:
    """The refusal's message for `block_id`, owned by the live transfer `transfer_id`."""
    return f"block {block_id} {BLOCK_STILL_OWNED} {transfer_id}"
