"""KV layout descriptions: where every (layer, block, plane, segment, token) of a worker's KV lies.

Life cycle: a worker builds a `KVLayoutSpec` from its KV tensors (`describe.describe_kv_caches`),
validates it, sends it to the directory (the connector turns it into the wire's `KVLayout`:
`kvpush.connector.worker.layout_wire`), and the directory forwards it to the peers that will write into that
worker; they rebuild it and derive NIXL descriptors from it (`plan`). The spec is immutable and pure data: no
NIXL, no torch, no protobuf.

Addressing (same as the proto's `KVPlane` comment): token t of block b in plane p, segment s starts at

    layer_base + p.offset_bytes + b * p.block_stride_bytes + s * p.segment_stride_bytes
               + t * p.token_stride_bytes

and is `p.segment_bytes_per_token` long. NHD layouts have one segment per token (all heads); HND
layouts one segment per KV head; vLLM CPU's fused block has 2 segments per head (K rows, V rows).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

MEMORY_DRAM = "DRAM"
MEMORY_VRAM = "VRAM"
MEMORY_KINDS = (MEMORY_DRAM, MEMORY_VRAM)


class LayoutError(ValueError):
    """A KV layout is malformed, or two layouts cannot exchange KV."""


def _require_positive(spec: object, prefix: str, *names: str) -> None:
    """Raise LayoutError naming the first of `names` whose value on `spec` is not positive."""
    for name in names:
        value = getattr(spec, name)
        if value <= 0:
            raise LayoutError(f"{prefix}{name} must be positive, got {value}")


@dataclass(frozen=True)
class KVPlaneSpec:
    """One plane (K, V, or fused KV) of every block of a layer; mirrors the wire's `KVPlane`."""

    offset_bytes: int
    block_stride_bytes: int
    block_bytes: int
    segment_count: int
    segment_stride_bytes: int
    token_stride_bytes: int
    segment_bytes_per_token: int

    def validate(self, block_size_tokens: int) -> None:
        """Raise LayoutError unless the plane is self-consistent for blocks of `block_size_tokens`."""
        if self.offset_bytes < 0:
            raise LayoutError(f"plane offset_bytes must be >= 0, got {self.offset_bytes}")
        _require_positive(self, "plane ", "block_stride_bytes", "block_bytes", "token_stride_bytes",
                          "segment_bytes_per_token")
        if self.segment_count < 1:
            raise LayoutError(f"plane segment_count must be >= 1, got {self.segment_count}")
        if self.segment_count == 1 and self.segment_stride_bytes != 0:
            raise LayoutError("plane segment_stride_bytes must be 0 when segment_count is 1")
        if self.segment_count > 1 and self.segment_stride_bytes <= 0:
            raise LayoutError("plane segment_stride_bytes must be positive when segment_count > 1")
        if self.token_stride_bytes < self.segment_bytes_per_token:
            raise LayoutError(
                f"plane token_stride_bytes {self.token_stride_bytes} < segment_bytes_per_token "
                f"{self.segment_bytes_per_token}: tokens would overlap"
            )
        if self.block_stride_bytes < self.block_bytes:
            raise LayoutError(
                f"plane block_stride_bytes {self.block_stride_bytes} < block_bytes {self.block_bytes}: blocks overlap"
            )
        extent = self.extent_bytes(block_size_tokens)
        if extent > self.block_bytes:
            raise LayoutError(
                f"plane block_bytes {self.block_bytes} is smaller than the {extent} bytes its "
                f"{self.segment_count} segment(s) of {block_size_tokens} tokens span"
            )

    def extent_bytes(self, block_size_tokens: int) -> int:
        """Bytes from a block's plane start to the end of its last token's last segment."""
        return (
            (self.segment_count - 1) * self.segment_stride_bytes
            + (block_size_tokens - 1) * self.token_stride_bytes
            + self.segment_bytes_per_token
        )

    @property
    def tokens_contiguous(self) -> bool:
        """True when consecutive tokens of one segment are adjacent, so a token run is one descriptor."""
        return self.token_stride_bytes == self.segment_bytes_per_token


@dataclass(frozen=True)
class StateGroupSpec:
    """A KV-cache group of state layers (vLLM's MambaSpec) inside a layout; mirrors a STATE `KVCacheGroup`.

    Block b of each of its layers starts at `layer_base_addresses[layer] + b * block_stride_bytes` (memory vLLM
    shares with attention layers of other groups) and holds the request's state at `state_ranges` (offset from the
    block's start, length), the rest padding. One block covers `block_size_tokens` tokens of a request.
    """

    group_index: int
    layers: tuple[int, ...]
    block_size_tokens: int
    block_stride_bytes: int
    state_ranges: tuple[tuple[int, int], ...]

    @property
    def state_bytes_per_block(self) -> int:
        """Bytes of state in one block of one layer: what a push of one layer's state moves."""
        return sum(length for _, length in self.state_ranges)

    def validate(self, layer_count: int, block_count: int, layer_region_bytes: int) -> None:
        """Raise LayoutError unless the group fits the layout it belongs to."""
        where = f"state group {self.group_index}"
        if not self.layers or any(not 0 <= layer < layer_count for layer in self.layers):
            raise LayoutError(f"{where}: layers {self.layers} must be non-empty and in [0, {layer_count})")
        if self.block_size_tokens <= 0 or self.block_stride_bytes <= 0 or not self.state_ranges:
            raise LayoutError(f"{where}: block_size_tokens, block_stride_bytes and state_ranges must be set")
        end = 0
        for offset, length in self.state_ranges:
            if offset < end or length <= 0:
                raise LayoutError(f"{where}: state ranges {self.state_ranges} must be ordered, positive and apart")
            end = offset + length
        if end > self.block_stride_bytes:
            raise LayoutError(f"{where}: state ends at byte {end} of a {self.block_stride_bytes}-byte block")
        if (block_count - 1) * self.block_stride_bytes + end > layer_region_bytes:
            raise LayoutError(f"{where}: {block_count} blocks of {self.block_stride_bytes} B pass "
                              f"layer_region_bytes {layer_region_bytes}")

    def state_descriptors(self, base_address: int, block: int) -> list[tuple[int, int]]:
        """(address, length) of one block's state of a layer based at `base_address`, adjacent ranges merged."""
        block_start = base_address + block * self.block_stride_bytes
        spans: list[list[int]] = []
        for offset, length in self.state_ranges:
            if spans and spans[-1][0] + spans[-1][1] == block_start + offset:
                spans[-1][1] += length
            else:
                spans.append([block_start + offset, length])
        return [(address, length) for address, length in spans]


@dataclass(frozen=True)
class KVLayoutSpec:
    """How one worker's KV cache lies in memory; mirrors the wire's `KVLayout`.

    `memory_kind` is "DRAM" or "VRAM" (NIXL's names). `layer_base_addresses` are addresses in the
    owning process; a peer only uses them to build remote descriptors.
    """

    layer_count: int
    block_size_tokens: int
    block_count: int
    block_bytes_per_layer: int
    dtype: str
    memory_kind: str
    device_id: int
    planes: tuple[KVPlaneSpec, ...]
    layer_base_addresses: tuple[int, ...]
    layer_region_bytes: int
    layer_names: tuple[str, ...] = ()
    compatibility_hash: str = ""
    # Tokens inside a block are not addressable (vLLM CPU attention tiles them): whole blocks only.
    block_atomic: bool = False
    # KV heads this worker holds (0: unknown), and the model's before the TP split (0: unknown): head slices
    # (`slice_heads`) between workers of different TP sizes need the first.
    kv_head_count: int = 0
    model_kv_head_count: int = 0
    # Hybrid models: groups of state layers (their layers are among layer_base_addresses, but the planes describe
    # the attention layers only; a state layer moves its state block whole: `plan.plan_state_write`).
    state_groups: tuple[StateGroupSpec, ...] = ()
    # Not on the wire: which describer produced it (for logs and errors only).
    layout_name: str = field(default="", compare=False)

    # ---- validation -------------------------------------------------------------------------
    def validate(self) -> KVLayoutSpec:
        """Raise LayoutError unless every field is consistent; return self for chaining."""
        _require_positive(self, "", "layer_count", "block_size_tokens", "block_count", "block_bytes_per_layer",
                          "layer_region_bytes")
        if self.memory_kind not in MEMORY_KINDS:
            raise LayoutError(f"memory_kind must be DRAM or VRAM, got {self.memory_kind!r}")
        if self.device_id < 0:
            raise LayoutError(f"device_id must be >= 0, got {self.device_id}")
        if not self.dtype:
            raise LayoutError("dtype must be set")
        if not self.planes:
            raise LayoutError("a layout needs at least one plane")
        if len(self.layer_base_addresses) != self.layer_count:
            raise LayoutError(
                f"layer_base_addresses has {len(self.layer_base_addresses)} entries for {self.layer_count} layers"
            )
        if self.layer_names and len(self.layer_names) != self.layer_count:
            raise LayoutError(f"layer_names has {len(self.layer_names)} entries for {self.layer_count} layers")
        if self.kv_head_count < 0 or self.model_kv_head_count < 0:
            raise LayoutError("kv_head_count and model_kv_head_count must be >= 0")
        if any(addr <= 0 for addr in self.layer_base_addresses):
            raise LayoutError("layer_base_addresses must all be positive")
        plane_bytes = 0
        for plane in self.planes:
            plane.validate(self.block_size_tokens)
            end = plane.offset_bytes + (self.block_count - 1) * plane.block_stride_bytes + plane.block_bytes
            if end > self.layer_region_bytes:
                raise LayoutError(
                    f"plane at offset {plane.offset_bytes} ends at byte {end}, past layer_region_bytes "
                    f"{self.layer_region_bytes} for {self.block_count} blocks"
                )
            plane_bytes += plane.block_bytes
        if plane_bytes != self.block_bytes_per_layer:
            raise LayoutError(
                f"block_bytes_per_layer {self.block_bytes_per_layer} != sum of plane block_bytes {plane_bytes}"
            )
        state_layers: list[int] = []
        for group in self.state_groups:
            group.validate(self.layer_count, self.block_count, self.layer_region_bytes)
            state_layers.extend(group.layers)
        if len(set(state_layers)) != len(state_layers):
            raise LayoutError(f"a layer is in two state groups: {sorted(state_layers)}")
        return self

    def state_group_of(self, layer: int) -> StateGroupSpec | None:
        """The state group holding `layer`, None for an attention layer."""
        return next((group for group in self.state_groups if layer in group.layers), None)

    # ---- addressing -------------------------------------------------------------------------
    def check_layer(self, layer: int) -> None:
        """Raise LayoutError unless `layer` is a valid layer index."""
        if not 0 <= layer < self.layer_count:
            raise LayoutError(f"layer {layer} out of range [0, {self.layer_count})")

    def check_block(self, block: int) -> None:
        """Raise LayoutError unless `block` is a valid block id."""
        if not 0 <= block < self.block_count:
            raise LayoutError(f"block {block} out of range [0, {self.block_count})")

    def plane_block_address(self, layer: int, block: int, plane: int) -> int:
        """Address of the first byte of `plane` of `block` in `layer`."""
        p = self.planes[plane]
        return self.layer_base_addresses[layer] + p.offset_bytes + block * p.block_stride_bytes

    def block_descriptor(self, layer: int, block: int, plane: int) -> tuple[int, int]:
        """(address, length) of one whole block of one plane of one layer; bounds-checked."""
        self.check_layer(layer)
        self.check_block(block)
        if not 0 <= plane < len(self.planes):
            raise LayoutError(f"plane {plane} out of range [0, {len(self.planes)})")
        return self.plane_block_address(layer, block, plane), self.planes[plane].block_bytes

    def token_segment_descriptor(
        self, layer: int, block: int, plane: int, segment: int, token: int, token_count: int = 1
    ) -> tuple[int, int]:
        """(address, length) of `token_count` tokens of one segment, starting at `token` inside `block`.

        Only tokens-contiguous planes allow token_count > 1 (every vLLM layout is); block-atomic
        layouts have no token addresses at all.
        """
        if self.block_atomic:
            raise LayoutError(f"layout {self.layout_name or ''} is block-atomic: tokens inside a block have no address")
        self.check_layer(layer)
        self.check_block(block)
        p = self.planes[plane]
        if not 0 <= segment < p.segment_count:
            raise LayoutError(f"segment {segment} out of range [0, {p.segment_count})")
        if token < 0 or token_count < 1 or token + token_count > self.block_size_tokens:
            raise LayoutError(
                f"tokens [{token}, {token + token_count}) not inside a block of {self.block_size_tokens}"
            )
        if token_count > 1 and not p.tokens_contiguous:
            raise LayoutError("a multi-token run needs a plane whose tokens are contiguous")
        addr = (
            self.plane_block_address(layer, block, plane)
            + segment * p.segment_stride_bytes
            + token * p.token_stride_bytes
        )
        return addr, token_count * p.segment_bytes_per_token

    @property
    def total_bytes(self) -> int:
        """Bytes of KV the layout describes (all layers, all blocks, all planes)."""
        return self.layer_count * self.block_count * self.block_bytes_per_layer

    @property
    def bytes_per_token_per_layer(self) -> int:
        """Payload bytes one token occupies in one layer, all planes and segments together."""
        return sum(p.segment_count * p.segment_bytes_per_token for p in self.planes)

    def memory_regions(self) -> list[tuple[int, int]]:
        """Disjoint (address, length) spans covering every layer region, for NIXL registration.

        Layers that share storage (layer-inside-block layouts) overlap, and overlapping spans are
        merged so each byte is registered once. Spans that merely touch stay separate: on a GPU
        they are usually two allocations that happen to be adjacent, and one registration spanning
        both breaks CUDA IPC (measured on H200: cuMemcpyDtoDAsync "invalid argument").
        """
        spans = sorted((addr, addr + self.layer_region_bytes) for addr in self.layer_base_addresses)
        merged: list[list[int]] = []
        for start, end in spans:
            if merged and start < merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        return [(start, end - start) for start, end in merged]


@dataclass(frozen=True)
class HeadSlice:
    """KV heads [source_start, source_start + count) of a source worker written into heads
    [destination_start, destination_start + count) of a destination worker (each worker's own head order)."""

    source_start: int
    destination_start: int
    count: int


def head_sliceable(layout: KVLayoutSpec) -> str:
    """Why heads of `layout` cannot be cut out as contiguous runs ("" when they can).

    HND planes hold one segment per head; vLLM CPU attention's block-atomic plane holds each head's K and V
    rows as one contiguous run inside a block (`describe` module docstring), so a head run of a block is one
    span. NHD planes interleave heads within every token: a head run would be one span per token.
    """
    heads = layout.kv_head_count
    if heads <= 0:
        return "kv_head_count is not set"
    for i, plane in enumerate(layout.planes):
        if plane.segment_count == heads or heads == 1:
            continue
        if layout.block_atomic and plane.segment_count == 1 and plane.block_bytes % heads == 0:
            continue
        return (f"planes[{i}].segment_count {plane.segment_count} does not give each of the {heads} KV heads its "
                "own segment (an NHD layout interleaves heads in every token; head slices need HND)")
    return ""


def slice_heads(layout: KVLayoutSpec, start: int, count: int) -> KVLayoutSpec:
    """`layout` restricted to its KV heads [start, start + count): the same blocks, tokens and tables, fewer bytes.

    Raises LayoutError for a range outside the worker's heads or a layout whose heads are not contiguous runs
    (`head_sliceable`). The whole range returns `layout` itself.
    """
    heads = layout.kv_head_count
    why = head_sliceable(layout)
    if why:
        raise LayoutError(f"layout {layout.layout_name or ''} cannot be cut by KV head: {why}".replace("  ", " "))
    if count < 1 or start < 0 or start + count > heads:
        raise LayoutError(f"heads [{start}, {start + count}) are not inside the worker's {heads} KV heads")
    if start == 0 and count == heads:
        return layout
    planes = []
    for plane in layout.planes:
        if plane.segment_count == heads:
            seg = plane.segment_stride_bytes
            cut = KVPlaneSpec(plane.offset_bytes + start * seg, plane.block_stride_bytes, 0, count,
                              seg if count > 1 else 0, plane.token_stride_bytes, plane.segment_bytes_per_token)
            cut = replace(cut, block_bytes=cut.extent_bytes(layout.block_size_tokens))
        else:  # block-atomic: each head a contiguous run of block_bytes / heads
            head_bytes = plane.block_bytes // heads
            token_bytes = count * head_bytes // layout.block_size_tokens
            cut = KVPlaneSpec(plane.offset_bytes + start * head_bytes, plane.block_stride_bytes, count * head_bytes,
                              1, 0, token_bytes, token_bytes)
        planes.append(cut)
    return replace(layout, planes=tuple(planes), block_bytes_per_layer=sum(p.block_bytes for p in planes),
                   kv_head_count=count, layout_name=f"{layout.layout_name}[heads {start}:{start + count}]").validate()


def check_compatible(src: KVLayoutSpec, dst: KVLayoutSpec) -> None:
    """Raise LayoutError unless KV can be written from `src` into `dst` token by token.

    Block sizes may differ; everything that shapes one token's bytes must match.
    """
    if src.dtype != dst.dtype:
        raise LayoutError(f"dtype differs: source {src.dtype}, destination {dst.dtype}")
    if src.compatibility_hash and dst.compatibility_hash and src.compatibility_hash != dst.compatibility_hash:
        raise LayoutError(
            f"compatibility_hash differs: source {src.compatibility_hash}, destination {dst.compatibility_hash}"
        )
    if len(src.planes) != len(dst.planes):
        raise LayoutError(f"plane count differs: source {len(src.planes)}, destination {len(dst.planes)}")
    for i, (sp, dp) in enumerate(zip(src.planes, dst.planes, strict=True)):
        if sp.segment_count != dp.segment_count or sp.segment_bytes_per_token != dp.segment_bytes_per_token:
            raise LayoutError(
                f"plane {i} token shape differs: source {sp.segment_count} x {sp.segment_bytes_per_token} B, "
                f"destination {dp.segment_count} x {dp.segment_bytes_per_token} B (NHD vs HND, or other heads)"
            )
    if src.block_atomic != dst.block_atomic:
        raise LayoutError("one layout is block-atomic (vLLM CPU tiles) and the other is not")
    if src.block_atomic and src.block_size_tokens != dst.block_size_tokens:
        raise LayoutError(
            f"block-atomic layouts need equal block sizes: source {src.block_size_tokens}, "
            f"destination {dst.block_size_tokens}"
        )
    if src.block_size_tokens != dst.block_size_tokens:
        for i, (sp, dp) in enumerate(zip(src.planes, dst.planes, strict=True)):
            if not (sp.tokens_contiguous and dp.tokens_contiguous):
                raise LayoutError(f"plane {i}: block-size mapping needs token-contiguous segments on both sides")


def check_head_compatible(src: KVLayoutSpec, dst: KVLayoutSpec) -> None:
    """Like `check_compatible`, but workers holding different numbers of KV heads (TP sizes differ) pass when
    one head of each is compatible with the other: they exchange KV by head slice only."""
    if src.kv_head_count == dst.kv_head_count or not (src.kv_head_count and dst.kv_head_count):
        check_compatible(src, dst)
        return
    for side, layout in (("source", src), ("destination", dst)):
        why = head_sliceable(layout)
        if why:
            raise LayoutError(f"{side} holds {layout.kv_head_count} KV heads, the other side "
                              f"{(dst if layout is src else src).kv_head_count}, and cannot be cut by head: {why}")
    check_compatible(slice_heads(src, 0, 1), slice_heads(dst, 0, 1))
