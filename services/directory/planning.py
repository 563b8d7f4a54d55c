"""Planning: which prefill and which decode engine take a new transfer.

Rule: among engines with every rank registered and below their transfer cap, decode engines need
enough free blocks for the prompt (from their last EngineLoad, else their block count); prefill
engines are tried fewest active transfers first, decode engines most free blocks first, then
fewest active transfers (engine id breaks ties, so a plan is deterministic). The first pair
whose layouts are compatible wins (`incompatibility`).
"""

from __future__ import annotations

import math

from kvpush.services.directory.errors import FailedPrecondition, ResourceExhausted
from kvpush.services.directory.records import EngineGroup


def choose_pair(prefills: list[EngineGroup], decodes: list[EngineGroup], prompt_token_count: int,
                max_active_transfers: int) -> tuple[EngineGroup, EngineGroup]:
    """The (prefill, decode) pair for a new transfer from complete candidate engines; raises why none fits."""
    prefills = [g for g in prefills if len(g.active_transfers) < max_active_transfers]
    decodes = [g for g in decodes if len(g.active_transfers) < max_active_transfers]
    if not prefills or not decodes:
        raise ResourceExhausted("every candidate engine is at its transfer cap")
    if prompt_token_count > 0:
        decodes = [g for g in decodes
                   if g.free_blocks() >= math.ceil(prompt_token_count / g.layout().block_size_tokens)]
        if not decodes:
            raise ResourceExhausted(f"no decode engine has free blocks for {prompt_token_count} tokens")
    prefills.sort(key=lambda g: (len(g.active_transfers), g.engine_id))
    decodes.sort(key=lambda g: (-g.free_blocks(), len(g.active_transfers), g.engine_id))
    why = ""
    for prefill in prefills:
        for decode in decodes:
            why = incompatibility(prefill, decode)
            if not why:
                return prefill, decode
    raise FailedPrecondition(f"no compatible prefill/decode pair: {why}")


def incompatibility(prefill: EngineGroup, decode: EngineGroup) -> str:
    """Why two engines cannot be paired ("" when they can)."""
    p, d = prefill.layout(), decode.layout()
    if prefill.tp_size != decode.tp_size:
        return (f"tp_size {prefill.tp_size} of {prefill.engine_id} differs from {decode.tp_size} of "
                f"{decode.engine_id} (heterogeneous TP is not supported yet)")
    if p.layer_count != d.layer_count:
        return f"layer_count {p.layer_count} differs from {d.layer_count}"
    if p.dtype != d.dtype:
        return f"dtype {p.dtype!r} differs from {d.dtype!r}"
    if p.compatibility_hash and d.compatibility_hash and p.compatibility_hash != d.compatibility_hash:
        return "compatibility_hash differs"
    return ""
