"""Descriptor maths: which bytes a push moves, as indices into prepared NIXL descriptor tables.

Pure functions, no NIXL: everything here is unit-tested on its own and runs before anything is posted,
so bad input is refused (`WriteRequestError`) with nothing in flight.

Tables (prepared once per layout, `prep_xfer_dlist` with compressed Nx5 rows
`(address, length, device, stride, count)`; NIXL keeps them compressed, so even millions of entries
prepare in milliseconds):

* **block table** of a layout: one entry per (layer, plane, block), a whole plane-block. Entry index
  `(layer * planes + plane) * block_count + block`; one Nx5 row per (layer, plane).
* **chunk table** of a layout at granule `g` tokens (g divides the block size): one entry per
  (layer, plane, segment, chunk-in-block, block), `g` tokens of one segment. Entry index
  `row(layer, plane, segment, chunk) * block_count + block`; one Nx5 row per (layer, plane, segment,
  chunk), striding over blocks.

A write of tokens [token_start, token_end) of some layers, from source blocks to destination blocks:

1. `g = gcd(src block size, dst block size)`. Equal block sizes use the block tables (one descriptor
   per plane-block, merged by NIXL when neighbours are contiguous on both sides); different sizes
   (e.g. prefill 16, decode 128) use both sides' chunk tables at `g`, so every source granule lands
   at the right token offset of the right destination block.
2. Granules fully inside the token range go through the tables; the partial granules at either end
   (a partial last block, a start that is not granule-aligned) become explicit token-exact
   descriptors, so a write never touches a token outside its range: another write of the same
   transfer may be in flight for those tokens, and NIXL does not order handles.
   Block-atomic layouts (vLLM CPU: tokens tiled inside a block) round the range out to whole
   blocks instead; partially covered blocks are listed in `shared_blocks` and the writer holds a
   later write that shares one until the earlier is done, so a stale copy never lands last.
3. Pairs are sorted by source address so that NIXL's merge of adjacent, contiguous descriptors
   finds every run (blocks-first layouts merge K and V of consecutive blocks, for instance);
   `descriptor_count` is the count after that merge, computed here the way NIXL merges.

Tensor parallelism: prefill TP = decode TP pairs rank r with rank r and everything above holds
per rank. TP sizes differing: a write carries a head slice (`writer.WriteRequest.head_slice`) and is planned
here between both layouts cut to those heads (`layout.slice_heads`: HND segments, or the heads' contiguous run
of a vLLM CPU block), with tables prepared for the cut layouts; NHD layouts (heads inside each token) are not cut.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from kvpush.dataplane.layout import KVLayoutSpec, LayoutError, StateGroupSpec, check_compatible

TABLE_BLOCK = "block"
TABLE_CHUNK = "chunk"
# NIXL takes int32 indices.
_MAX_TABLE_ENTRIES = 2**31 - 1

# Table rows (address, length, device, stride, count), as `prep_xfer_dlist` takes them.
TableRows = NDArray[np.uint64]
# Table entry numbers, as `make_prepped_xfer` takes them.
TableIndices = NDArray[np.int32]
# Ids, addresses, lengths, layer numbers: the planning arithmetic's arrays.
_Ints = NDArray[np.int64]
# Pairs of table entries: (local index, remote index, local address, remote address, length, layer), aligned.
_Pairs = tuple[_Ints, _Ints, _Ints, _Ints, _Ints, _Ints]


class WriteRequestError(ValueError):
    """A write cannot be planned: ids, layers or token range out of range or inconsistent."""


# ---- tables ----------------------------------------------------------------------------------
def block_table_rows(layout: KVLayoutSpec) -> TableRows:
    """Nx5 rows (address, length, device, stride, count) of the block table of `layout`."""
    rows = []
    for layer in range(layout.layer_count):
        for plane_index, plane in enumerate(layout.planes):
            rows.append(
                (
                    layout.plane_block_address(layer, 0, plane_index),
                    plane.block_bytes,
                    layout.device_id,
                    plane.block_stride_bytes,
                    layout.block_count,
                )
            )
    _check_table_size(layout.layer_count * len(layout.planes) * layout.block_count)
    return np.array(rows, dtype=np.uint64)


def _chunk_row_bases(layout: KVLayoutSpec, granule: int) -> _Ints:
    """Row number of (layer, plane, segment 0, chunk 0), shape (layers, planes)."""
    chunks = layout.block_size_tokens // granule
    per_plane = np.array([p.segment_count * chunks for p in layout.planes], dtype=np.int64)
    plane_prefix = np.cumsum(per_plane) - per_plane  # rows before each plane
    rows_per_layer = int(per_plane.sum())
    return np.arange(layout.layer_count, dtype=np.int64)[:, None] * rows_per_layer + plane_prefix[None, :]


def chunk_table_rows(layout: KVLayoutSpec, granule: int) -> TableRows:
    """Nx5 rows of the chunk table of `layout` at `granule` tokens per entry."""
    if granule <= 0 or layout.block_size_tokens % granule:
        raise LayoutError(f"granule {granule} does not divide block size {layout.block_size_tokens}")
    chunks = layout.block_size_tokens // granule
    rows = []
    for layer in range(layout.layer_count):
        for plane_index, plane in enumerate(layout.planes):
            if granule > 1 and not plane.tokens_contiguous:
                raise LayoutError("a chunk table with granule > 1 needs token-contiguous segments")
            base = layout.plane_block_address(layer, 0, plane_index)
            for segment in range(plane.segment_count):
                for chunk in range(chunks):
                    rows.append(
                        (
                            base + segment * plane.segment_stride_bytes + chunk * granule * plane.token_stride_bytes,
                            granule * plane.segment_bytes_per_token,
                            layout.device_id,
                            plane.block_stride_bytes,
                            layout.block_count,
                        )
                    )
    _check_table_size(len(rows) * layout.block_count)
    return np.array(rows, dtype=np.uint64)


def _check_table_size(entries: int) -> None:
    if entries > _MAX_TABLE_ENTRIES:
        raise LayoutError(f"descriptor table of {entries} entries exceeds NIXL's int32 index range")


def granule_tokens(src: KVLayoutSpec, dst: KVLayoutSpec) -> int:
    """Tokens per table entry for a (src, dst) pair: the gcd of the two block sizes."""
    return math.gcd(src.block_size_tokens, dst.block_size_tokens)


# ---- the plan --------------------------------------------------------------------------------
@dataclass(frozen=True)
class WritePlan:
    """What one write moves: table indices plus token-exact edge descriptors.

    `table` is "block" or "chunk" (with `granule` tokens); `local_indices[i]` in the source table
    pairs with `remote_indices[i]` in the destination table. `explicit` rows are
    (source address, destination address, length) for the partial granules at the edges.
    """

    table: str
    granule: int
    local_indices: TableIndices
    remote_indices: TableIndices
    explicit: _Ints
    total_bytes: int
    descriptor_count: int
    # Block-atomic layouts only: (layer, destination block) of partially covered blocks, which
    # this write copies whole; a later write sharing one must wait until this one is done.
    shared_blocks: frozenset[tuple[int, int]] = frozenset()

    @property
    def table_descriptor_count(self) -> int:
        """Table entries before merging."""
        return int(self.local_indices.size)


def _check_ids(name: str, ids: Sequence[int], needed: int, block_count: int, first: int = 0) -> _Ints:
    """The ids as an array; refuses too few, and ids out of range or repeated among the written blocks [first,
    needed). Blocks before `first` are never read or written: a sliding-window group's there may all be one null
    block."""
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    if arr.size < needed:
        raise WriteRequestError(f"{name} has {arr.size} block ids but the token range needs {needed}")
    used = arr[:needed]
    bad = used[(used < 0) | (used >= block_count)]
    if bad.size:
        raise WriteRequestError(f"{name} block id {int(bad[0])} out of range [0, {block_count})")
    written = used[first:]
    if np.unique(written).size != written.size:
        raise WriteRequestError(f"{name} repeats a block id within the written range")
    return used


def _check_layers(layers: Sequence[int], src: KVLayoutSpec, dst: KVLayoutSpec) -> _Ints:
    arr = np.asarray(list(layers), dtype=np.int64)
    if arr.size == 0:
        raise WriteRequestError("layers is empty")
    limit = min(src.layer_count, dst.layer_count)
    bad = arr[(arr < 0) | (arr >= limit)]
    if bad.size:
        raise _layer_out_of_range(int(bad[0]), src, dst)
    if np.unique(arr).size != arr.size:
        raise WriteRequestError("layers repeats a layer")
    return arr


def _layer_out_of_range(layer: int, src: KVLayoutSpec, dst: KVLayoutSpec) -> WriteRequestError:
    limit = min(src.layer_count, dst.layer_count)
    return WriteRequestError(
        f"layer {layer} out of range [0, {limit}) (source {src.layer_count}, destination {dst.layer_count})"
    )


def validate_write(
    src: KVLayoutSpec,
    dst: KVLayoutSpec,
    layers: Sequence[int],
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
    token_start: int,
    token_end: int,
) -> tuple[_Ints, _Ints, _Ints]:
    """Refuse a bad write (WriteRequestError); return (layers, used src ids, used dst ids).

    `src_block_ids` and `dst_block_ids` list blocks in token order from token 0; each must cover
    [0, token_end); entries past that are ignored.
    """
    try:
        check_compatible(src, dst)
    except LayoutError as exc:
        raise WriteRequestError(f"layouts cannot exchange KV: {exc}") from exc
    if not 0 <= token_start < token_end:
        raise WriteRequestError(f"token range [{token_start}, {token_end}) is empty or negative")
    layer_arr = _check_layers(layers, src, dst)
    src_ids = _check_ids("src_block_ids", src_block_ids, -(-token_end // src.block_size_tokens), src.block_count,
                         token_start // src.block_size_tokens)
    dst_ids = _check_ids("dst_block_ids", dst_block_ids, -(-token_end // dst.block_size_tokens), dst.block_count,
                         token_start // dst.block_size_tokens)
    return layer_arr, src_ids, dst_ids


def plan_write(
    src: KVLayoutSpec,
    dst: KVLayoutSpec,
    layers: Sequence[int],
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
    token_start: int,
    token_end: int,
) -> WritePlan:
    """Plan the write of tokens [token_start, token_end) of `layers` from `src` blocks to `dst` blocks."""
    layer_arr, src_ids, dst_ids = validate_write(
        src, dst, layers, src_block_ids, dst_block_ids, token_start, token_end
    )
    g = granule_tokens(src, dst)
    shared: frozenset[tuple[int, int]] = frozenset()
    if src.block_atomic:
        # Tokens have no address: round out to whole blocks (equal sizes, checked above).
        first_full = token_start // g
        end_full = -(-token_end // g)
        partial = [k for k, cut in ((first_full, token_start), (end_full - 1, token_end)) if cut % g]
        shared = frozenset((int(layer), int(dst_ids[k])) for layer in layer_arr for k in partial)
    else:
        first_full = -(-token_start // g)
        end_full = token_end // g
    table = TABLE_BLOCK if src.block_size_tokens == dst.block_size_tokens else TABLE_CHUNK

    local_idx = np.empty(0, dtype=np.int64)
    remote_idx = np.empty(0, dtype=np.int64)
    local_addr = np.empty(0, dtype=np.int64)
    remote_addr = np.empty(0, dtype=np.int64)
    lengths = np.empty(0, dtype=np.int64)
    layer_of = np.empty(0, dtype=np.int64)
    if end_full > first_full:
        granules = np.arange(first_full, end_full, dtype=np.int64)
        parts = (
            _block_pairs(src, dst, layer_arr, src_ids, dst_ids, granules)
            if table == TABLE_BLOCK
            else _chunk_pairs(src, dst, layer_arr, src_ids, dst_ids, granules, g)
        )
        local_idx, remote_idx, local_addr, remote_addr, lengths, layer_of = parts
        order = np.lexsort((local_addr, layer_of))
        local_idx, remote_idx = local_idx[order], remote_idx[order]
        local_addr, remote_addr = local_addr[order], remote_addr[order]
        lengths, layer_of = lengths[order], layer_of[order]

    edges: list[tuple[int, int]] = []
    if src.block_atomic:
        pass
    elif end_full <= first_full:
        edges.append((token_start, token_end))
    else:
        if token_start < first_full * g:
            edges.append((token_start, first_full * g))
        if end_full * g < token_end:
            edges.append((end_full * g, token_end))
    explicit = _explicit_pairs(src, dst, layer_arr, src_ids, dst_ids, edges)

    table_merged = _merged_count(local_addr, remote_addr, lengths, layer_of)
    total = int(lengths.sum()) + int(explicit[:, 2].sum()) if explicit.size else int(lengths.sum())
    return WritePlan(
        table=table,
        granule=g,
        local_indices=local_idx.astype(np.int32),
        remote_indices=remote_idx.astype(np.int32),
        explicit=explicit,
        total_bytes=total,
        descriptor_count=table_merged + int(explicit.shape[0]),
        shared_blocks=shared,
    )


def plan_state_write(src: KVLayoutSpec, dst: KVLayoutSpec, layer: int, src_block: int, dst_block: int) -> WritePlan:
    """Plan the write of one state layer's state block whole (hybrid models): every state byte of `src_block` into
    `dst_block`, nothing of the block's padding, as explicit descriptors (a state block is one or two ranges, so no
    table is prepared for it). Both sides' groups of `layer` must hold the same state ranges."""
    src_group, dst_group = src.state_group_of(layer), dst.state_group_of(layer)
    if src_group is None or dst_group is None:
        raise WriteRequestError(f"layer {layer} is not a state layer on "
                                f"{'both sides' if src_group is None and dst_group is None else 'both sides alike'}")
    if src_group.state_ranges != dst_group.state_ranges:
        raise WriteRequestError(f"layer {layer}: state ranges {src_group.state_ranges} differ from decode's "
                                f"{dst_group.state_ranges}")
    for name, block, layout in (("src_block", src_block, src), ("dst_block", dst_block, dst)):
        if not 0 <= block < layout.block_count:
            raise WriteRequestError(f"{name} {block} out of range [0, {layout.block_count})")
    rows = [(s_addr, d_addr, length) for (s_addr, length), (d_addr, _) in zip(
        _state_spans(src, src_group, layer, src_block), _state_spans(dst, dst_group, layer, dst_block), strict=True)]
    explicit = np.array(rows, dtype=np.int64).reshape(-1, 3)
    empty = np.empty(0, dtype=np.int32)
    return WritePlan(table=TABLE_BLOCK, granule=0, local_indices=empty, remote_indices=empty, explicit=explicit,
                     total_bytes=int(explicit[:, 2].sum()), descriptor_count=int(explicit.shape[0]))


def _state_spans(layout: KVLayoutSpec, group: StateGroupSpec, layer: int, block: int) -> list[tuple[int, int]]:
    # Ranges are merged only where they touch; both sides hold the same ranges, so their spans pair one to one.
    return group.state_descriptors(layout.layer_base_addresses[layer], block)


def _block_pairs(
    src: KVLayoutSpec, dst: KVLayoutSpec, layers: _Ints, src_ids: _Ints, dst_ids: _Ints, blocks: _Ints
) -> _Pairs:
    """Block-table pairs for whole blocks `blocks` (request-relative block numbers) of `layers`."""
    n_planes = len(src.planes)
    sb = src_ids[blocks]
    db = dst_ids[blocks]
    lay = np.repeat(layers, n_planes)  # (layers*planes,)
    pl = np.tile(np.arange(n_planes, dtype=np.int64), layers.size)
    local = ((lay * n_planes + pl)[:, None] * src.block_count + sb[None, :]).ravel()
    remote = ((lay * n_planes + pl)[:, None] * dst.block_count + db[None, :]).ravel()
    s_base = np.array([src.layer_base_addresses[i] for i in layers], dtype=np.int64)
    d_base = np.array([dst.layer_base_addresses[i] for i in layers], dtype=np.int64)
    s_off = np.array([p.offset_bytes for p in src.planes], dtype=np.int64)
    d_off = np.array([p.offset_bytes for p in dst.planes], dtype=np.int64)
    s_bs = np.array([p.block_stride_bytes for p in src.planes], dtype=np.int64)
    d_bs = np.array([p.block_stride_bytes for p in dst.planes], dtype=np.int64)
    ln = np.array([p.block_bytes for p in src.planes], dtype=np.int64)
    li = np.repeat(np.arange(layers.size), n_planes)
    s_addr = ((s_base[li] + s_off[pl])[:, None] + s_bs[pl][:, None] * sb[None, :]).ravel()
    d_addr = ((d_base[li] + d_off[pl])[:, None] + d_bs[pl][:, None] * db[None, :]).ravel()
    lengths = np.repeat(ln[pl], blocks.size)
    layer_of = np.repeat(lay, blocks.size)
    return local, remote, s_addr, d_addr, lengths, layer_of


def _chunk_pairs(
    src: KVLayoutSpec, dst: KVLayoutSpec, layers: _Ints, src_ids: _Ints, dst_ids: _Ints, granules: _Ints, g: int
) -> _Pairs:
    """Chunk-table pairs for whole granules `granules` (request-relative granule numbers)."""
    tokens = granules * g
    sb = src_ids[tokens // src.block_size_tokens]
    sc = (tokens % src.block_size_tokens) // g
    db = dst_ids[tokens // dst.block_size_tokens]
    dc = (tokens % dst.block_size_tokens) // g
    s_rows = _chunk_row_bases(src, g)
    d_rows = _chunk_row_bases(dst, g)
    s_chunks = src.block_size_tokens // g
    d_chunks = dst.block_size_tokens // g
    local_parts: list[_Ints] = []
    remote_parts: list[_Ints] = []
    sa_parts: list[_Ints] = []
    da_parts: list[_Ints] = []
    len_parts: list[_Ints] = []
    layer_parts: list[_Ints] = []
    for layer in layers:
        for pi, (sp, dp) in enumerate(zip(src.planes, dst.planes, strict=True)):
            seg = np.arange(sp.segment_count, dtype=np.int64)[:, None]
            s_row = s_rows[layer, pi] + seg * s_chunks + sc[None, :]
            d_row = d_rows[layer, pi] + seg * d_chunks + dc[None, :]
            local_parts.append((s_row * src.block_count + sb[None, :]).ravel())
            remote_parts.append((d_row * dst.block_count + db[None, :]).ravel())
            s_base = src.layer_base_addresses[layer] + sp.offset_bytes
            d_base = dst.layer_base_addresses[layer] + dp.offset_bytes
            sa_parts.append(
                (s_base + sb[None, :] * sp.block_stride_bytes + seg * sp.segment_stride_bytes
                 + sc[None, :] * g * sp.token_stride_bytes).ravel()
            )
            da_parts.append(
                (d_base + db[None, :] * dp.block_stride_bytes + seg * dp.segment_stride_bytes
                 + dc[None, :] * g * dp.token_stride_bytes).ravel()
            )
            count = sp.segment_count * granules.size
            len_parts.append(np.full(count, g * sp.segment_bytes_per_token, dtype=np.int64))
            layer_parts.append(np.full(count, layer, dtype=np.int64))
    return (np.concatenate(local_parts), np.concatenate(remote_parts), np.concatenate(sa_parts),
            np.concatenate(da_parts), np.concatenate(len_parts), np.concatenate(layer_parts))


def _explicit_pairs(
    src: KVLayoutSpec, dst: KVLayoutSpec, layers: _Ints, src_ids: _Ints, dst_ids: _Ints, edges: list[tuple[int, int]]
) -> _Ints:
    """Token-exact (src addr, dst addr, length) rows for the token ranges in `edges`, merged."""
    rows: list[tuple[int, int, int]] = []
    for start, end in edges:
        # Split [start, end) where either side crosses a block boundary.
        cuts = sorted(
            {start, end}
            | set(range(-(-start // src.block_size_tokens) * src.block_size_tokens, end, src.block_size_tokens))
            | set(range(-(-start // dst.block_size_tokens) * dst.block_size_tokens, end, dst.block_size_tokens))
        )
        pieces = [(a, b) for a, b in itertools.pairwise(cuts) if a < b]
        for layer in layers:
            for pi, (sp, dp) in enumerate(zip(src.planes, dst.planes, strict=True)):
                for a, b in pieces:
                    s_block = int(src_ids[a // src.block_size_tokens])
                    d_block = int(dst_ids[a // dst.block_size_tokens])
                    s_tok = a % src.block_size_tokens
                    d_tok = a % dst.block_size_tokens
                    runs = [(0, b - a)] if sp.tokens_contiguous and dp.tokens_contiguous else [
                        (k, 1) for k in range(b - a)
                    ]
                    for seg in range(sp.segment_count):
                        for k, n in runs:
                            s_addr, length = src.token_segment_descriptor(int(layer), s_block, pi, seg, s_tok + k, n)
                            d_addr, _ = dst.token_segment_descriptor(int(layer), d_block, pi, seg, d_tok + k, n)
                            rows.append((s_addr, d_addr, length))
    if not rows:
        return np.zeros((0, 3), dtype=np.int64)
    rows.sort()
    merged = [list(rows[0])]
    for s, d, n in rows[1:]:
        last = merged[-1]
        if s == last[0] + last[2] and d == last[1] + last[2]:
            last[2] += n
        else:
            merged.append([s, d, n])
    return np.array(merged, dtype=np.int64)


def _merged_count(local_addr: _Ints, remote_addr: _Ints, lengths: _Ints, layer_of: _Ints) -> int:
    """Descriptors left after merging neighbours contiguous on both sides within one layer."""
    n = int(lengths.size)
    if n == 0:
        return 0
    contiguous = (
        (local_addr[1:] == local_addr[:-1] + lengths[:-1])
        & (remote_addr[1:] == remote_addr[:-1] + lengths[:-1])
        & (layer_of[1:] == layer_of[:-1])
    )
    return n - int(contiguous.sum())


# ---- the same write on another layer ---------------------------------------------------------
def _table_layer_stride(layout: KVLayoutSpec, table: str, granule: int) -> int:
    """How far one layer moves an entry index of `layout`'s table (rows per layer x blocks)."""
    if table == TABLE_BLOCK:
        rows_per_layer = len(layout.planes)
    else:
        rows_per_layer = sum(p.segment_count for p in layout.planes) * (layout.block_size_tokens // granule)
    return rows_per_layer * layout.block_count


def move_to_layer(plan: WritePlan, src: KVLayoutSpec, dst: KVLayoutSpec, from_layer: int, to_layer: int) -> WritePlan:
    """`plan` (a one-layer write of `from_layer`) for `to_layer`: same blocks, same tokens, shifted indices.

    Every layer has the same shape, so table indices move by a fixed stride per layer and explicit
    rows by the distance between the two layers' bases; descriptor count and bytes are unchanged.
    """
    if not 0 <= to_layer < min(src.layer_count, dst.layer_count):
        raise _layer_out_of_range(to_layer, src, dst)
    if from_layer == to_layer:
        return plan
    steps = to_layer - from_layer
    explicit = plan.explicit
    if explicit.size:
        shift = np.array([src.layer_base_addresses[to_layer] - src.layer_base_addresses[from_layer],
                          dst.layer_base_addresses[to_layer] - dst.layer_base_addresses[from_layer], 0],
                         dtype=np.int64)
        explicit = explicit + shift
    return WritePlan(
        table=plan.table,
        granule=plan.granule,
        local_indices=plan.local_indices + np.int32(steps * _table_layer_stride(src, plan.table, plan.granule)),
        remote_indices=plan.remote_indices + np.int32(steps * _table_layer_stride(dst, plan.table, plan.granule)),
        explicit=explicit,
        total_bytes=plan.total_bytes,
        descriptor_count=plan.descriptor_count,
        shared_blocks=frozenset((to_layer, block) for _layer, block in plan.shared_blocks),
    )


_PlanKey = tuple[str, int, int, tuple[int, ...], tuple[int, ...]]


class LayerPlanCache:
    """Plans each (peer, blocks, token range) once and moves the plan to other layers.

    A prefill worker writes the same blocks and tokens once per layer, from the forward thread; a full
    plan validates and computes every index again (~0.4 ms on a GPU host for 256 blocks), moving a
    cached one is a few array additions. Bounded: the oldest entries go first.
    """

    def __init__(self, capacity: int = 256) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        # (peer, token_start, token_end, src block ids, dst block ids) -> (src layout, dst layout, layer, plan)
        self._plans: dict[_PlanKey, tuple[KVLayoutSpec, KVLayoutSpec, int, WritePlan]] = {}

    def plan(self, src: KVLayoutSpec, dst: KVLayoutSpec, peer: str, layers: Sequence[int],
             src_block_ids: Sequence[int], dst_block_ids: Sequence[int], token_start: int, token_end: int) -> WritePlan:
        """Like `plan_write`; one-layer writes seen before (other layer, same peer/blocks/range) are moved."""
        if len(layers) != 1:
            return plan_write(src, dst, layers, src_block_ids, dst_block_ids, token_start, token_end)
        layer = int(layers[0])
        key = (peer, token_start, token_end, tuple(src_block_ids), tuple(dst_block_ids))
        with self._lock:
            cached = self._plans.get(key)
        # The entry holds the layouts it was planned for: a peer re-added under its name re-plans.
        if cached is not None and cached[0] is src and cached[1] is dst:
            return move_to_layer(cached[3], src, dst, cached[2], layer)
        plan = plan_write(src, dst, layers, src_block_ids, dst_block_ids, token_start, token_end)
        with self._lock:
            if key not in self._plans and len(self._plans) >= self._capacity:
                del self._plans[next(iter(self._plans))]
            self._plans[key] = (src, dst, layer, plan)
        return plan
