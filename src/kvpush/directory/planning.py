"""Planning: which prefill and which decode engine take a new transfer.

Rule: among engines with every rank registered, serving the request's model (when it names one) and below
their transfer cap, decode engines need room for the prompt in their KV cache (their block count: the free blocks
they last reported are a load signal, stale while an engine idles); prefill engines are tried fewest active
transfers first, then fewest queued (running + waiting) requests; decode engines most free blocks first, then
fewest queued requests, then fewest active transfers (engine id breaks ties, so a plan is deterministic). The
first pair whose layouts are compatible wins (`incompatibility`): equal TP size, layer count, dtype and
compatibility hash.
"""

from __future__ import annotations

import math

from kvpush.directory.errors import FailedPrecondition, ResourceExhausted
from kvpush.directory.records import EngineGroup, Worker
from kvpush.v1 import types_pb2 as tpb


def choose_pair(prefills: list[EngineGroup], decodes: list[EngineGroup], prompt_token_count: int,
                max_active_transfers: int, model: str = "") -> tuple[EngineGroup, EngineGroup]:
    """The (prefill, decode) pair for a new transfer from complete candidate engines; raises why none fits."""
    if model:
        served = sorted({g.model or "(none)" for g in prefills + decodes})
        prefills = [g for g in prefills if g.model == model]
        decodes = [g for g in decodes if g.model == model]
        for role, groups in (("prefill", prefills), ("decode", decodes)):
            if not groups:
                raise ResourceExhausted(f"no {role} engine serves model {model!r}; registered models: "
                                        f"{', '.join(served) or 'none'}")
    prefills = [g for g in prefills if len(g.active_transfers) < max_active_transfers]
    decodes = [g for g in decodes if len(g.active_transfers) < max_active_transfers]
    if not prefills or not decodes:
        raise ResourceExhausted("every candidate engine is at its transfer cap", limit="engine_transfer_cap")
    if prompt_token_count > 0:
        # Admitted by capacity, not by the last reported free blocks: an idle decode engine reports the blocks it
        # freed only at its next step or renewal, and such a stale report refused requests it could hold. An
        # engine that is full right now queues the request (as a colocated engine would); free blocks still order
        # the choice below.
        largest = max(g.layout().block_count * g.layout().block_size_tokens for g in decodes)
        decodes = [g for g in decodes
                   if g.layout().block_count >= math.ceil(prompt_token_count / g.layout().block_size_tokens)]
        if not decodes:
            raise ResourceExhausted(f"no decode engine has room for {prompt_token_count} tokens "
                                    f"(the largest holds {largest})")
    prefills.sort(key=lambda g: (len(g.active_transfers), g.queued_requests(), g.engine_id))
    decodes.sort(key=lambda g: (-g.free_blocks(), g.queued_requests(), len(g.active_transfers), g.engine_id))
    why = ""
    for prefill in prefills:
        for decode in decodes:
            why = incompatibility(prefill, decode)
            if not why:
                return prefill, decode
    raise FailedPrecondition(f"no compatible prefill/decode pair: {why}")


def incompatibility(prefill: EngineGroup, decode: EngineGroup) -> str:
    """Why two engines cannot be paired ("" when they can)."""
    if prefill.tp_size != decode.tp_size:
        return (f"tp_size {prefill.tp_size} of {prefill.engine_id} differs from {decode.tp_size} of "
                f"{decode.engine_id} (heterogeneous TP is not supported yet)")
    return _layout_incompatibility(prefill.layout(), decode.layout(), prefill.engine_id, decode.engine_id)


def can_push_to(prefill: Worker, decode: Worker) -> bool:
    """True when a plan could send `prefill`'s instructions to `decode`: the same rank of engines that pair."""
    return (prefill.tp_size == decode.tp_size and prefill.tp_rank == decode.tp_rank
            and not _layout_incompatibility(prefill.layout, decode.layout, prefill.engine_id, decode.engine_id))


def _layout_incompatibility(p: tpb.KVLayout, d: tpb.KVLayout, prefill_engine_id: str, decode_engine_id: str) -> str:
    names = f"prefill {prefill_engine_id!r} and decode {decode_engine_id!r}"
    if p.layer_count != d.layer_count:
        return f"layer_count {p.layer_count} differs from {d.layer_count} ({names})"
    if p.dtype != d.dtype:
        return f"dtype {p.dtype!r} differs from {d.dtype!r} ({names})"
    if p.compatibility_hash != d.compatibility_hash:
        return (f"compatibility hash {p.compatibility_hash or '(none)'} of prefill {prefill_engine_id!r} differs "
                f"from {d.compatibility_hash or '(none)'} of decode {decode_engine_id!r}: they differ in model, "
                "dtype, KV layout, block size or vLLM release")
    return ""
