"""The wire form of a worker's KV layout: `kvpush.dataplane.KVLayoutSpec` <-> the API's `KVLayout`.

The data plane describes memory and imports no protobuf; a worker registers its layout with the directory
(`layout_to_proto`) and rebuilds a decode worker's from an instruction or a peer announcement
(`layout_from_proto`, validated).
"""

from __future__ import annotations

from kvpush.dataplane.layout import MEMORY_DRAM, MEMORY_VRAM, KVLayoutSpec, KVPlaneSpec, LayoutError, StateGroupSpec
from kvpush.v1 import types_pb2 as tpb

_MEMORY_TO_PROTO: dict[str, tpb.MemoryKind] = {MEMORY_DRAM: tpb.MEMORY_KIND_DRAM, MEMORY_VRAM: tpb.MEMORY_KIND_VRAM}
_PROTO_TO_MEMORY: dict[tpb.MemoryKind, str] = {v: k for k, v in _MEMORY_TO_PROTO.items()}


def plane_to_proto(plane: KVPlaneSpec) -> tpb.KVPlane:
    """The wire form of one plane."""
    return tpb.KVPlane(
        offset_bytes=plane.offset_bytes,
        block_stride_bytes=plane.block_stride_bytes,
        block_bytes=plane.block_bytes,
        segment_count=plane.segment_count,
        segment_stride_bytes=plane.segment_stride_bytes,
        token_stride_bytes=plane.token_stride_bytes,
        segment_bytes_per_token=plane.segment_bytes_per_token,
    )


def plane_from_proto(msg: tpb.KVPlane) -> KVPlaneSpec:
    """One plane from its wire form (not validated: `layout_from_proto` validates the whole layout)."""
    return KVPlaneSpec(
        offset_bytes=msg.offset_bytes,
        block_stride_bytes=msg.block_stride_bytes,
        block_bytes=msg.block_bytes,
        segment_count=msg.segment_count,
        segment_stride_bytes=msg.segment_stride_bytes,
        token_stride_bytes=msg.token_stride_bytes,
        segment_bytes_per_token=msg.segment_bytes_per_token,
    )


def layout_to_proto(layout: KVLayoutSpec) -> tpb.KVLayout:
    """The wire form sent to the directory."""
    return tpb.KVLayout(
        layer_count=layout.layer_count,
        block_size_tokens=layout.block_size_tokens,
        block_count=layout.block_count,
        block_bytes_per_layer=layout.block_bytes_per_layer,
        dtype=layout.dtype,
        memory_kind=_MEMORY_TO_PROTO[layout.memory_kind],
        device_id=layout.device_id,
        planes=[plane_to_proto(p) for p in layout.planes],
        layer_base_addresses=list(layout.layer_base_addresses),
        layer_region_bytes=layout.layer_region_bytes,
        layer_names=list(layout.layer_names),
        compatibility_hash=layout.compatibility_hash,
        block_atomic=layout.block_atomic,
        kv_head_count=layout.kv_head_count,
        model_kv_head_count=layout.model_kv_head_count,
    )


def state_group_to_proto(group: StateGroupSpec, msg: tpb.KVCacheGroup) -> None:
    """Fill a registered `KVCacheGroup` (index and layers set by the caller) with a state group's fields."""
    msg.kind = tpb.KV_CACHE_GROUP_KIND_STATE
    msg.block_size_tokens = group.block_size_tokens
    msg.state_block_stride_bytes = group.block_stride_bytes
    msg.state_ranges.extend(tpb.ByteRange(offset_bytes=offset, length_bytes=length)
                            for offset, length in group.state_ranges)


def state_groups_from_proto(msg: tpb.KVLayout) -> tuple[StateGroupSpec, ...]:
    """The layout's STATE groups (not validated: `layout_from_proto` validates them with the layout)."""
    return tuple(StateGroupSpec(group_index=group.group_index, layers=tuple(group.layers),
                                block_size_tokens=group.block_size_tokens,
                                block_stride_bytes=group.state_block_stride_bytes,
                                state_ranges=tuple((r.offset_bytes, r.length_bytes) for r in group.state_ranges))
                 for group in msg.kv_cache_groups if group.kind == tpb.KV_CACHE_GROUP_KIND_STATE)


def layout_from_proto(msg: tpb.KVLayout) -> KVLayoutSpec:
    """A layout from its wire form, validated (LayoutError on anything malformed)."""
    if msg.memory_kind not in _PROTO_TO_MEMORY:
        raise LayoutError(f"memory_kind {msg.memory_kind} is not DRAM or VRAM")
    return KVLayoutSpec(
        layer_count=msg.layer_count,
        block_size_tokens=msg.block_size_tokens,
        block_count=msg.block_count,
        block_bytes_per_layer=msg.block_bytes_per_layer,
        dtype=msg.dtype,
        memory_kind=_PROTO_TO_MEMORY[msg.memory_kind],
        device_id=msg.device_id,
        planes=tuple(plane_from_proto(p) for p in msg.planes),
        layer_base_addresses=tuple(msg.layer_base_addresses),
        layer_region_bytes=msg.layer_region_bytes,
        layer_names=tuple(msg.layer_names),
        compatibility_hash=msg.compatibility_hash,
        block_atomic=msg.block_atomic,
        kv_head_count=msg.kv_head_count,
        model_kv_head_count=msg.model_kv_head_count,
        state_groups=state_groups_from_proto(msg),
    ).validate()
