"""Planning: which prefill and which decode engine take a new transfer.

Rule: among engines with every rank registered, serving the request's model (when it names one) and below
their transfer cap, decode engines need room for the prompt in their KV cache (their block count: the free blocks
they last reported are a load signal, stale while an engine idles); prefill engines are tried fewest active
transfers first, then fewest queued (running + waiting) requests; decode engines most free blocks first, then
fewest queued requests, then fewest active transfers (engine id breaks ties, so a plan is deterministic). The
first pair whose layouts are compatible wins (`incompatibility`): equal layer count, dtype, block atomicity, plane
token shape and compatibility hash, block sizes the data plane can map (`_block_size_mapping`; different sizes only
with `Limits.pair_block_sizes`, the directory's --pair-block-sizes), and equal TP sizes
or different ones that split: engines of different TP sizes pair when both registered their KV head counts, vLLM
splits the model's KV heads over both sizes and one head's KV has the same shape on both sides (HND or CPU attention
layouts): `head_routes` then says which heads each prefill rank writes to which decode rank. When none is, the
refusal names the first pair tried, the field that differs and both values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpush.directory.errors import FailedPrecondition, ResourceExhausted
from kvpush.directory.records import EngineGroup, Worker
from kvpush.v1 import types_pb2 as tpb


def choose_pair(prefills: list[EngineGroup], decodes: list[EngineGroup], prompt_token_count: int,
                max_active_transfers: int, model: str = "",
                pair_block_sizes: bool = False) -> tuple[EngineGroup, EngineGroup]:
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
    first_why = ""
    for prefill in prefills:
        for decode in decodes:
            why = incompatibility(prefill, decode, pair_block_sizes=pair_block_sizes)
            if not why:
                return prefill, decode
            first_why = first_why or why
    pair_count = len(prefills) * len(decodes)
    tried = "" if pair_count == 1 else f" (the first of {pair_count} pairs tried)"
    raise FailedPrecondition(f"no compatible prefill/decode pair: {first_why}{tried}")


def incompatibility(prefill: EngineGroup, decode: EngineGroup, *, pair_block_sizes: bool = False) -> str:
    """Why two engines cannot be paired ("" when they can): the first field that differs, with both values.
    pair_block_sizes: engines of different block sizes may pair (`Limits.pair_block_sizes`)."""
    if prefill.tp_size != decode.tp_size:
        return _head_split_incompatibility(prefill.layout(), decode.layout(), prefill.tp_size, decode.tp_size,
                                           prefill.engine_id, decode.engine_id, prefill.model, decode.model,
                                           pair_block_sizes=pair_block_sizes)
    return _layout_incompatibility(prefill.layout(), decode.layout(), prefill.engine_id, decode.engine_id,
                                   prefill.model, decode.model, pair_block_sizes=pair_block_sizes)


def can_push_to(prefill: Worker, decode: Worker, *, pair_block_sizes: bool = False) -> bool:
    """True when a plan could send `prefill`'s instructions to `decode`: the same rank of engines of one TP size
    that pair, or, TP sizes differing, a decode rank that holds a KV head this prefill rank writes."""
    if prefill.tp_size == decode.tp_size:
        return (prefill.tp_rank == decode.tp_rank
                and not _layout_incompatibility(prefill.layout, decode.layout, prefill.engine_id, decode.engine_id,
                                                prefill.model, decode.model, pair_block_sizes=pair_block_sizes))
    if _head_split_incompatibility(prefill.layout, decode.layout, prefill.tp_size, decode.tp_size,
                                   prefill.engine_id, decode.engine_id, prefill.model, decode.model,
                                   pair_block_sizes=pair_block_sizes):
        return False
    routes = head_routes(prefill.layout.model_kv_head_count, prefill.tp_size, decode.tp_size)
    return any(r.prefill_rank == prefill.tp_rank and r.decode_rank == decode.tp_rank for r in routes)


# ---- different TP sizes: which heads of which prefill rank go to which decode rank -----------------------------
@dataclass(frozen=True)
class HeadRoute:
    """Heads [source_head_start, +head_count) of prefill rank `prefill_rank` (its own head order) are written into
    heads [destination_head_start, +head_count) of decode rank `decode_rank`."""

    prefill_rank: int
    decode_rank: int
    source_head_start: int
    destination_head_start: int
    head_count: int


def rank_heads(model_heads: int, tp_size: int, rank: int) -> range:
    """The model's KV heads rank `rank` holds (vLLM's split: consecutive runs of model_heads / tp_size, or, with
    fewer heads than ranks, head rank * model_heads // tp_size replicated on tp_size / model_heads ranks)."""
    if model_heads >= tp_size:
        per_rank = model_heads // tp_size
        return range(rank * per_rank, (rank + 1) * per_rank)
    head = rank * model_heads // tp_size
    return range(head, head + 1)


def head_split_error(model_heads: int, tp_size: int) -> str:
    """Why vLLM cannot split `model_heads` KV heads over `tp_size` ranks ("" when it can)."""
    if model_heads <= 0:
        return "the model's KV head count is not known"
    if model_heads % tp_size and tp_size % model_heads:
        return f"{model_heads} KV heads do not split over {tp_size} ranks (neither divides the other)"
    return ""


def head_routes(model_heads: int, prefill_tp: int, decode_tp: int) -> list[HeadRoute]:
    """Every head of every decode rank written exactly once: per decode rank, its heads' runs by source rank.

    A head several prefill ranks hold (fewer KV heads than prefill ranks) is taken from one of them, the
    holders taking turns over the decode ranks that need it, so their writes spread. Ordered by decode rank,
    then head. The caller checked `head_split_error` for both sizes.
    """
    routes: list[HeadRoute] = []
    prefill_heads = [rank_heads(model_heads, prefill_tp, r) for r in range(prefill_tp)]
    for decode_rank in range(decode_tp):
        wanted = rank_heads(model_heads, decode_tp, decode_rank)
        for head in wanted:
            holders = [r for r, held in enumerate(prefill_heads) if head in held]
            source = holders[decode_rank % len(holders)]
            last = routes[-1] if routes else None
            if (last is not None and last.decode_rank == decode_rank and last.prefill_rank == source
                    and last.destination_head_start + last.head_count == head - wanted.start):
                routes[-1] = HeadRoute(source, decode_rank, last.source_head_start, last.destination_head_start,
                                       last.head_count + 1)
            else:
                routes.append(HeadRoute(source, decode_rank, head - prefill_heads[source].start,
                                        head - wanted.start, 1))
    return routes


def _head_split_incompatibility(p: tpb.KVLayout, d: tpb.KVLayout, prefill_tp: int, decode_tp: int,
                                prefill_engine_id: str, decode_engine_id: str, prefill_model: str = "",
                                decode_model: str = "", *, pair_block_sizes: bool = False) -> str:
    """Why engines of different TP sizes cannot pair by head slices ("" when they can).

    Both must register their KV head counts (workers that predate head slices do not, and would write every
    head), split the same model heads the way vLLM does, cut by head (HND, or CPU attention's blocks), and
    agree on every field one head's KV depends on.
    """
    ids = (prefill_engine_id, decode_engine_id)
    sizes = f"tp_size {prefill_tp} of prefill {prefill_engine_id!r} and {decode_tp} of decode {decode_engine_id!r}"
    for role, engine_id, layout in (("prefill", prefill_engine_id, p), ("decode", decode_engine_id, d)):
        if not (layout.kv_head_count and layout.model_kv_head_count):
            return (f"{sizes} differ and {role} {engine_id!r} registered no layout.kv_head_count / "
                    "layout.model_kv_head_count (a kvpush without head slices): equal TP sizes only")
    if p.model_kv_head_count != d.model_kv_head_count:
        return _differs("model_kv_head_count", p.model_kv_head_count, d.model_kv_head_count, *ids,
                        "different models' KV heads")
    model_heads = p.model_kv_head_count
    for role, engine_id, layout, tp in (("prefill", prefill_engine_id, p, prefill_tp),
                                        ("decode", decode_engine_id, d, decode_tp)):
        why = head_split_error(model_heads, tp)
        if why:
            return f"{sizes}: tp_size {tp} of {role} {engine_id!r} cannot hold the model's KV heads: {why}"
        expected = len(rank_heads(model_heads, tp, 0))
        if layout.kv_head_count != expected:
            return (f"{sizes}: kv_head_count {layout.kv_head_count} of {role} {engine_id!r} is not the model's "
                    f"{model_heads} KV heads over {tp} ranks ({expected})")
        for i, plane in enumerate(layout.planes):
            heads = layout.kv_head_count
            if heads > 1 and plane.segment_count != heads and not (layout.block_atomic and plane.segment_count == 1):
                return (f"{sizes}: planes[{i}].segment_count {plane.segment_count} of {role} {engine_id!r} holds "
                        f"{heads} KV heads in every token's segment (NHD): different TP sizes need an HND layout "
                        "(one segment per head; vLLM's NixlConfig needs HND for heterogeneous TP too)")
    if p.block_size_tokens != d.block_size_tokens:
        # Head slices and block-size mapping each work alone; together they have not been built or tested.
        return _differs("block_size_tokens", p.block_size_tokens, d.block_size_tokens, *ids,
                        "engines of different TP sizes need one block size: start both with one --block-size")
    if any(g.kind == tpb.KV_CACHE_GROUP_KIND_STATE for g in (*p.kv_cache_groups, *d.kv_cache_groups)):
        # Attention groups cut by head; a Mamba layer's state is split over the ranks by SSM heads and groups (some
        # replicated), which no head slice describes.
        return _differs("kv_cache_groups", _kv_cache_groups(p) or "(one group)",
                        _kv_cache_groups(d) or "(one group)", *ids,
                        "engines of different TP sizes need attention-only KV-cache groups: a state group (Mamba "
                        "layers) is split over the ranks in a way head slices do not describe")
    return _layout_incompatibility(_one_head(p), _one_head(d), *ids, prefill_model, decode_model,
                                   pair_block_sizes=pair_block_sizes)


def _one_head(layout: tpb.KVLayout) -> tpb.KVLayout:
    """The layout's fields as one KV head of it has them (what two workers of different head counts share)."""
    one = tpb.KVLayout()
    one.CopyFrom(layout)
    heads = layout.kv_head_count
    for plane in one.planes:
        if plane.segment_count == heads:
            plane.segment_count = 1
        elif heads > 1:  # block-atomic: one segment holds every head's bytes of a token
            plane.segment_bytes_per_token //= heads
    return one


# What the compatibility hash covers (src/kvpush/connector/metadata.py) that no registered field carries.
_HASH_ONLY_FACTORS = "model path, cache dtype, KV layout name (NHD/HND, plane order) or vLLM release"


def _kv_cache_groups(layout: tpb.KVLayout) -> list[tuple[object, ...]]:
    """A layout's KV-cache groups as (layers, sliding window) in group order, a state group as (layers, "state",
    tokens per block, block stride, state ranges): a state block moves whole, so both sides need the same; [] for one
    group."""
    groups: list[tuple[object, ...]] = []
    for group in layout.kv_cache_groups:
        if group.kind == tpb.KV_CACHE_GROUP_KIND_STATE:
            groups.append((list(group.layers), "state", group.block_size_tokens, group.state_block_stride_bytes,
                           [(r.offset_bytes, r.length_bytes) for r in group.state_ranges]))
        else:
            groups.append((list(group.layers), group.sliding_window_tokens))
    return groups


def _differs(field_name: str, prefill_value: object, decode_value: object, prefill_engine_id: str,
             decode_engine_id: str, why: str) -> str:
    return (f"{field_name} {prefill_value} of prefill {prefill_engine_id!r} differs from {decode_value} of decode "
            f"{decode_engine_id!r} ({why})")


# Pairing different block sizes can be turned off (`Limits.pair_block_sizes`, the directory's --no-pair-block-sizes).
_BLOCK_SIZES_OPT_IN = "engines of different block sizes pair only when the directory runs with --pair-block-sizes"

# NIXL indexes a prepared descriptor table with int32 (kvpush.dataplane.plan._MAX_TABLE_ENTRIES).
_MAX_TABLE_ENTRIES = 2**31 - 1


def _block_size_mapping(p: tpb.KVLayout, d: tpb.KVLayout) -> str:
    """Why the data plane cannot map prefill's blocks onto decode's of another size ("" when it can).

    The rule of `kvpush.dataplane.plan`: any two sizes map through chunk tables of g = gcd(sizes) tokens per entry
    (16 and 128: g 16; 32 and 48: g 16), on both sides, when tokens have addresses (not block_atomic) and each
    segment's tokens are contiguous; each side's table of (layers x segments x block_size / g x blocks) entries must
    fit NIXL's int32 index.
    """
    for role, layout in (("prefill", p), ("decode", d)):
        if layout.block_atomic:
            return (f"{role}'s layout is block_atomic (vLLM CPU attention tiles tokens inside a block), so its KV "
                    "moves only as whole blocks between equal block sizes: start both with one --block-size")
    for role, layout in (("prefill", p), ("decode", d)):
        for i, plane in enumerate(layout.planes):
            if plane.token_stride_bytes != plane.segment_bytes_per_token:
                return (f"{role}'s planes[{i}] has gaps between tokens (token_stride_bytes "
                        f"{plane.token_stride_bytes} > segment_bytes_per_token {plane.segment_bytes_per_token}); "
                        "mapping block sizes needs token-contiguous segments")
    granule = math.gcd(p.block_size_tokens, d.block_size_tokens)
    for role, layout in (("prefill", p), ("decode", d)):
        entries = (layout.layer_count * sum(plane.segment_count for plane in layout.planes)
                   * (layout.block_size_tokens // granule) * layout.block_count)
        if entries > _MAX_TABLE_ENTRIES:
            return (f"mapping them needs {role} descriptor tables of {granule}-token chunks with {entries} entries, "
                    f"past NIXL's int32 index range: sizes with a larger common divisor, or fewer blocks")
    return ""


def _layout_incompatibility(p: tpb.KVLayout, d: tpb.KVLayout, prefill_engine_id: str, decode_engine_id: str,
                            prefill_model: str = "", decode_model: str = "", *, pair_block_sizes: bool = False) -> str:
    """The first registered layout field that differs, else a differing compatibility hash ("" when they pair).

    The fields come first so that a refusal names what to change; the hash still decides last, as it covers
    factors no registered field carries. Not compared, as before: the memory kind (each side's descriptors are
    prepared in its own kind) and the block count (decode bounds its own block ids).
    """
    ids = (prefill_engine_id, decode_engine_id)
    if p.layer_count != d.layer_count:
        return _differs("layer_count", p.layer_count, d.layer_count, *ids,
                        "a push writes each layer into the same layer of decode: different models or layer kinds?")
    if p.block_size_tokens != d.block_size_tokens:
        # What the data plane cannot map is named first: the switch would not help those.
        why = _block_size_mapping(p, d) or ("" if pair_block_sizes else _BLOCK_SIZES_OPT_IN)
        if not why and (len(p.kv_cache_groups) > 1 or len(d.kv_cache_groups) > 1):
            # Block-size mapping and per-group blocks each work alone; together they have not been tested.
            why = "engines with several KV-cache groups (the hybrid KV-cache manager) need one block size"
        if why:
            return _differs("block_size_tokens", p.block_size_tokens, d.block_size_tokens, *ids, why)
    if p.dtype != d.dtype:
        return _differs("dtype", repr(p.dtype), repr(d.dtype), *ids,
                        "KV elements are copied as bytes, so both must hold the same type")
    if p.block_atomic != d.block_atomic:
        return _differs("block_atomic", p.block_atomic, d.block_atomic, *ids,
                        "vLLM CPU attention stores blocks in tiles a GPU layout does not read")
    p_groups, d_groups = _kv_cache_groups(p), _kv_cache_groups(d)
    if p_groups != d_groups:
        return _differs("kv_cache_groups", p_groups or "(one group)", d_groups or "(one group)", *ids,
                        "each layer is written into its KV-cache group's blocks, so both sides need the same groups: "
                        "the hybrid KV-cache manager on one side only?")
    if len(p.planes) != len(d.planes):
        return _differs("plane count", len(p.planes), len(d.planes), *ids,
                        "K and V fused in one plane on one side and separate on the other")
    for i, (pp, dp) in enumerate(zip(p.planes, d.planes, strict=True)):
        if pp.segment_count != dp.segment_count:
            return _differs(f"planes[{i}].segment_count", pp.segment_count, dp.segment_count, *ids,
                            "the KV heads a rank holds in an HND layout, 1 in NHD: other heads or another layout")
        if pp.segment_bytes_per_token != dp.segment_bytes_per_token:
            return _differs(f"planes[{i}].segment_bytes_per_token", pp.segment_bytes_per_token,
                            dp.segment_bytes_per_token, *ids,
                            "one token's bytes per segment: other KV heads per rank or another head size")
    if p.compatibility_hash != d.compatibility_hash:
        if prefill_model and decode_model and prefill_model != decode_model:
            return _differs("compatibility hash", p.compatibility_hash or "(none)",
                            d.compatibility_hash or "(none)", *ids,
                            f"they serve different models: {prefill_model!r} and {decode_model!r}")
        return _differs("compatibility hash", p.compatibility_hash or "(none)", d.compatibility_hash or "(none)",
                        *ids, "every registered layout field is equal, so they differ in what only the hash "
                        f"covers: {_HASH_ONLY_FACTORS}")
    return ""
