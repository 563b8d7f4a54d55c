"""Wire-input checks run by the servicer before any state call.

Each function raises `errors.InvalidArgument` with a precise message (naming the field) and
returns nothing, so a refused request never reaches `state` and changes nothing. The checks are
structural (presence, lengths, ranges, caps); checks that need the state (a layer index against
the engine's layer count, block ids against its block count) live in `state`.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from google.protobuf import duration_pb2, timestamp_pb2

from kvpush.directory.errors import InvalidArgument
from kvpush.directory.records import Limits
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb

# Sane maxima: every field of a request is bounded, so no input can make a response too big or a count overflow.
MAX_LAYERS = 1024
MAX_TP_SIZE = 64
MAX_BLOCK_COUNT = 1 << 24
MAX_BLOCK_SIZE_TOKENS = 4096
MAX_DEVICE_ID = 1024
MAX_PLANES = 8
MAX_AGENT_METADATA_BYTES = 4 * 1024 * 1024
# KV heads of a model (a bound for layout.model_kv_head_count; models have at most a few hundred).
MAX_KV_HEADS = 4096
# A whole layout (addresses, names, planes): 64 ranks of an engine fit one GetEngine answer.
MAX_LAYOUT_BYTES = 48 * 1024
MAX_TEXT_LENGTH = 1024
MAX_PAGE_TOKEN_LENGTH = 256
MAX_DTYPE_LENGTH = 32
MAX_HASH_LENGTH = 128
MAX_LAYER_NAME_LENGTH = 128
# Ids (engine, agent, transfer, lease, request): 1-128 of these characters (URI- and log-safe; no NUL,
# newline or space), so an engine id fits a certificate URI SAN as it is.
ID_CHARACTERS = "A-Za-z0-9._:@+=~-"
ID_PATTERN = re.compile(f"[{ID_CHARACTERS}]{{1,128}}")
_ID = re.compile(f"[{ID_CHARACTERS}]+")
# Free text (reasons, endpoints, trace context, dtype, hash): no control characters (NUL, newline, ...).
_CONTROL = re.compile("[\x00-\x1f\x7f]")
_DTYPE = re.compile("[a-z0-9_]+")
INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
# Duration.seconds' documented range (about 10,000 years).
_MAX_DURATION_SECONDS = 315_576_000_000


def require_id(value: str, name: str, limits: Limits, required: bool = True) -> None:
    """An identifier: present when required, at most `max_id_length` characters of ID_CHARACTERS."""
    if not value:
        if required:
            raise InvalidArgument(f"{name} is required")
        return
    if len(value) > limits.max_id_length:
        raise InvalidArgument(f"{name} is {len(value)} characters; at most {limits.max_id_length}")
    if not _ID.fullmatch(value):
        raise InvalidArgument(f"{name} may hold only the characters [{ID_CHARACTERS}]")


def require_text(value: str, name: str, max_length: int = MAX_TEXT_LENGTH) -> None:
    """Free text (reasons, trace context, endpoints): bounded length, no control characters."""
    if len(value) > max_length:
        raise InvalidArgument(f"{name} is {len(value)} characters; at most {max_length}")
    if _CONTROL.search(value):
        raise InvalidArgument(f"{name} contains a control character")


def sanitize_text(value: str, max_length: int = MAX_TEXT_LENGTH) -> str:
    """Free text made safe to keep and log, for fields whose content must never refuse the call (a cancel's
    reason: a malformed one must not leave a transfer live): control characters become spaces, and text over
    `max_length` characters is cut to it, ending in "..."."""
    value = _CONTROL.sub(" ", value)
    return value if len(value) <= max_length else value[:max_length - 3] + "..."


def _positive(value: int, name: str, maximum: int | None = None) -> None:
    if value <= 0:
        raise InvalidArgument(f"{name} must be positive, got {value}")
    if maximum is not None and value > maximum:
        raise InvalidArgument(f"{name} {value} is over the maximum {maximum}")


def _non_negative(value: int, name: str, maximum: int | None = None) -> None:
    if value < 0:
        raise InvalidArgument(f"{name} must not be negative, got {value}")
    if maximum is not None and value > maximum:
        raise InvalidArgument(f"{name} {value} is over the maximum {maximum}")


def duration_s(duration: duration_pb2.Duration, name: str) -> float:
    """A google.protobuf.Duration as seconds: well-formed (seconds and nanos in range, same sign), not negative."""
    if (not -_MAX_DURATION_SECONDS <= duration.seconds <= _MAX_DURATION_SECONDS
            or not -999_999_999 <= duration.nanos <= 999_999_999):
        raise InvalidArgument(f"{name} is not a valid Duration")
    if (duration.seconds > 0 and duration.nanos < 0) or (duration.seconds < 0 and duration.nanos > 0):
        raise InvalidArgument(f"{name} has seconds and nanos of different signs")
    if duration.seconds < 0 or duration.nanos < 0:
        raise InvalidArgument(f"{name} must not be negative")
    return float(duration.seconds + duration.nanos / 1e9)


def _timestamp(timestamp: timestamp_pb2.Timestamp, name: str) -> None:
    # Timestamp's documented range: 0001-01-01 to 9999-12-31.
    if not -62_135_596_800 <= timestamp.seconds <= 253_402_300_799 or not 0 <= timestamp.nanos <= 999_999_999:
        raise InvalidArgument(f"{name} is not a valid Timestamp")


def check_layout(layout: tpb.KVLayout) -> None:
    """A KV layout a peer can compute descriptors from."""
    _positive(layout.layer_count, "layout.layer_count")
    if layout.layer_count > MAX_LAYERS:
        raise InvalidArgument(f"layout.layer_count {layout.layer_count} is over {MAX_LAYERS}")
    _positive(layout.block_size_tokens, "layout.block_size_tokens", MAX_BLOCK_SIZE_TOKENS)
    _positive(layout.block_count, "layout.block_count", MAX_BLOCK_COUNT)
    _positive(layout.block_bytes_per_layer, "layout.block_bytes_per_layer")
    _positive(layout.layer_region_bytes, "layout.layer_region_bytes")
    _non_negative(layout.device_id, "layout.device_id", MAX_DEVICE_ID)
    if not layout.dtype:
        raise InvalidArgument("layout.dtype is required")
    if len(layout.dtype) > MAX_DTYPE_LENGTH or not _DTYPE.fullmatch(layout.dtype):
        raise InvalidArgument(f"layout.dtype must be 1-{MAX_DTYPE_LENGTH} characters of [a-z0-9_]")
    require_text(layout.compatibility_hash, "layout.compatibility_hash", MAX_HASH_LENGTH)
    _non_negative(layout.model_kv_head_count, "layout.model_kv_head_count", MAX_KV_HEADS)
    _non_negative(layout.kv_head_count, "layout.kv_head_count", layout.model_kv_head_count or MAX_KV_HEADS)
    if len(layout.planes) > MAX_PLANES:
        raise InvalidArgument(f"layout.planes has {len(layout.planes)} planes; at most {MAX_PLANES}")
    for index, name in enumerate(layout.layer_names):
        require_text(name, f"layout.layer_names[{index}]", MAX_LAYER_NAME_LENGTH)
    if layout.ByteSize() > MAX_LAYOUT_BYTES:
        raise InvalidArgument(f"layout is {layout.ByteSize()} bytes; at most {MAX_LAYOUT_BYTES}")
    if layout.memory_kind not in (tpb.MEMORY_KIND_DRAM, tpb.MEMORY_KIND_VRAM):
        raise InvalidArgument("layout.memory_kind must be MEMORY_KIND_DRAM or MEMORY_KIND_VRAM")
    if not layout.planes:
        raise InvalidArgument("layout.planes needs at least one plane")
    for index, plane in enumerate(layout.planes):
        where = f"layout.planes[{index}]"
        _non_negative(plane.offset_bytes, f"{where}.offset_bytes")
        _positive(plane.block_stride_bytes, f"{where}.block_stride_bytes")
        _positive(plane.block_bytes, f"{where}.block_bytes")
        _positive(plane.segment_count, f"{where}.segment_count")
        _non_negative(plane.segment_stride_bytes, f"{where}.segment_stride_bytes")
        _positive(plane.token_stride_bytes, f"{where}.token_stride_bytes")
        _positive(plane.segment_bytes_per_token, f"{where}.segment_bytes_per_token")
    if len(layout.layer_base_addresses) != layout.layer_count:
        raise InvalidArgument(
            f"layout.layer_base_addresses has {len(layout.layer_base_addresses)} entries; "
            f"layer_count is {layout.layer_count}")
    # An address is unsigned 64 bits carried in an int64: a region must neither start below 0 nor end past 2^64.
    for index, address in enumerate(layout.layer_base_addresses):
        if address < 0:
            raise InvalidArgument(f"layout.layer_base_addresses[{index}] is negative ({address})")
        if address + layout.layer_region_bytes > UINT64_MAX + 1:
            raise InvalidArgument(
                f"layout.layer_base_addresses[{index}] + layout.layer_region_bytes ({address} + "
                f"{layout.layer_region_bytes}) is past the 64-bit address space")
    if layout.layer_names and len(layout.layer_names) != layout.layer_count:
        raise InvalidArgument(
            f"layout.layer_names has {len(layout.layer_names)} entries; layer_count is {layout.layer_count}")
    _check_kv_cache_groups(layout)


def _check_kv_cache_groups(layout: tpb.KVLayout) -> None:
    """KV-cache groups, when declared: indices 0..n-1 in order, every layer in exactly one, windows >= 0."""
    if not layout.kv_cache_groups:
        return
    seen: list[int] = []
    for position, group in enumerate(layout.kv_cache_groups):
        where = f"layout.kv_cache_groups[{position}]"
        if group.group_index != position:
            raise InvalidArgument(f"{where}.group_index is {group.group_index}; groups come in order from 0")
        if not group.layers:
            raise InvalidArgument(f"{where}.layers is empty")
        _non_negative(group.sliding_window_tokens, f"{where}.sliding_window_tokens")
        _non_negative(group.block_size_tokens, f"{where}.block_size_tokens")
        _check_state_group(group, where)
        seen.extend(group.layers)
    if sorted(seen) != list(range(layout.layer_count)):
        raise InvalidArgument(f"layout.kv_cache_groups must hold every layer in [0, {layout.layer_count}) exactly "
                              "once")


def _check_state_group(group: tpb.KVCacheGroup, where: str) -> None:
    """A STATE group has ordered, positive state ranges inside a positive block stride and tokens per block; an
    attention group has none of those."""
    if group.kind != tpb.KV_CACHE_GROUP_KIND_STATE:
        if group.state_ranges or group.state_block_stride_bytes:
            raise InvalidArgument(f"{where} is an attention group with state_ranges or state_block_stride_bytes")
        return
    if group.sliding_window_tokens:
        raise InvalidArgument(f"{where} is a state group with a sliding window")
    if group.block_size_tokens <= 0 or group.state_block_stride_bytes <= 0 or not group.state_ranges:
        raise InvalidArgument(f"{where} is a state group: block_size_tokens, state_block_stride_bytes and "
                              "state_ranges must be set")
    end = 0
    for i, state_range in enumerate(group.state_ranges):
        if state_range.offset_bytes < end or state_range.length_bytes <= 0:
            raise InvalidArgument(f"{where}.state_ranges[{i}] overlaps the range before it or is empty")
        end = state_range.offset_bytes + state_range.length_bytes
    if end > group.state_block_stride_bytes:
        raise InvalidArgument(f"{where}.state_ranges end at byte {end}, past state_block_stride_bytes "
                              f"{group.state_block_stride_bytes}")


def check_register(request: dpb.RegisterEngineRequest, limits: Limits) -> None:
    """RegisterEngineRequest: ids, role, rank range, decode metadata, layout."""
    require_id(request.engine_id, "engine_id", limits)
    require_id(request.agent_name, "agent_name", limits)
    require_text(request.endpoint, "endpoint")
    require_text(request.model, "model")
    if request.role not in (tpb.ENGINE_ROLE_PREFILL, tpb.ENGINE_ROLE_DECODE):
        raise InvalidArgument("role must be ENGINE_ROLE_PREFILL or ENGINE_ROLE_DECODE")
    _positive(request.tp_size, "tp_size", MAX_TP_SIZE)
    if not 0 <= request.tp_rank < request.tp_size:
        raise InvalidArgument(f"tp_rank {request.tp_rank} is outside [0, {request.tp_size})")
    if request.role == tpb.ENGINE_ROLE_DECODE and not request.agent_metadata:
        raise InvalidArgument("agent_metadata is required for a decode worker")
    if len(request.agent_metadata) > MAX_AGENT_METADATA_BYTES:
        raise InvalidArgument(f"agent_metadata is over {MAX_AGENT_METADATA_BYTES} bytes")
    if not request.HasField("layout"):
        raise InvalidArgument("layout is required")
    check_layout(request.layout)


def check_plan(request: dpb.PlanTransferRequest, limits: Limits) -> float | None:
    """PlanTransferRequest; returns the requested ttl in seconds, None for the server default."""
    require_id(request.request_id, "request_id", limits, required=False)
    require_id(request.prefill_engine_id, "prefill_engine_id", limits, required=False)
    require_id(request.decode_engine_id, "decode_engine_id", limits, required=False)
    require_text(request.trace_context, "trace_context")
    require_text(request.model, "model")
    require_id(request.transfer_id, "transfer_id", limits, required=False)
    require_id(request.client_id, "client_id", limits, required=False)
    if request.transfer_id and not request.prefill_engine_id:
        raise InvalidArgument("transfer_id is set without prefill_engine_id: the caller that names the transfer "
                              "has already chosen its prefill engine")
    _non_negative(request.prompt_token_count, "prompt_token_count")
    if not request.HasField("ttl"):
        return None
    ttl = duration_s(request.ttl, "ttl")
    if ttl <= 0:
        raise InvalidArgument(f"ttl must be positive, got {ttl}s")
    return ttl


def check_allocation(request: dpb.ReportAllocationRequest, limits: Limits) -> None:
    """ReportAllocationRequest: ids, counts, block list size and values."""
    require_id(request.transfer_id, "transfer_id", limits)
    require_id(request.engine_id, "engine_id", limits)
    _positive(request.prompt_token_count, "prompt_token_count")
    if not 0 <= request.prefix_hit_token_count <= request.prompt_token_count:
        raise InvalidArgument(
            f"prefix_hit_token_count {request.prefix_hit_token_count} is outside [0, {request.prompt_token_count}]")
    if not request.block_ids:
        raise InvalidArgument("block_ids is empty")
    if len(request.block_ids) > limits.max_block_ids:
        raise InvalidArgument(f"block_ids has {len(request.block_ids)} entries; the cap is {limits.max_block_ids}")
    if min(request.block_ids) < 0:
        raise InvalidArgument("block_ids contains a negative id")
    group_ids = sum(len(group.block_ids) for group in request.block_groups)
    if group_ids > limits.max_block_ids:
        raise InvalidArgument(f"block_groups hold {group_ids} block ids; the cap is {limits.max_block_ids}")
    for position, group in enumerate(request.block_groups):
        if group.group_index != position:
            raise InvalidArgument(f"block_groups[{position}] has group_index {group.group_index}; groups must come "
                                  "in group order from 0")
        if not group.block_ids or min(group.block_ids) < 0:
            raise InvalidArgument(f"block_groups[{position}].block_ids is empty or has a negative id")


def check_layer_ready(event: dpb.LayerReady, limits: Limits) -> None:
    """One LayerReady event (its layer index against the engine's layer count is checked by state)."""
    require_id(event.transfer_id, "transfer_id", limits)
    _non_negative(event.layer_start, "layer_start", MAX_LAYERS)
    _non_negative(event.layer_end, "layer_end", MAX_LAYERS)
    if event.layer_end <= event.layer_start:
        raise InvalidArgument(f"layer_end {event.layer_end} is not after layer_start {event.layer_start}")
    _non_negative(event.token_start, "token_start")
    if event.token_end <= event.token_start:
        raise InvalidArgument(f"token_end {event.token_end} is not after token_start {event.token_start}")
    _positive(event.prompt_token_count, "prompt_token_count")
    if event.token_end > event.prompt_token_count:
        raise InvalidArgument(
            f"token_end {event.token_end} is past prompt_token_count {event.prompt_token_count}")
    if len(event.source_block_ids) > limits.max_block_ids:
        raise InvalidArgument(f"source_block_ids is over the cap of {limits.max_block_ids}")
    if event.source_block_ids and min(event.source_block_ids) < 0:
        raise InvalidArgument("source_block_ids contains a negative id")
    if sum(len(group.block_ids) for group in event.source_block_groups) > limits.max_block_ids:
        raise InvalidArgument(f"source_block_groups hold more block ids than the cap of {limits.max_block_ids}")
    if any(group.block_ids and min(group.block_ids) < 0 for group in event.source_block_groups):
        raise InvalidArgument("source_block_groups contain a negative id")


def check_batch(batch: dpb.LayerReadyBatch, limits: Limits) -> None:
    """A LayerReadyBatch: at least one event, at most the cap (a bad batch ends the stream)."""
    if not batch.events:
        raise InvalidArgument("ready batch has no events")
    if len(batch.events) > limits.max_events_per_batch:
        raise InvalidArgument(
            f"ready batch has {len(batch.events)} events; the cap is {limits.max_events_per_batch}")


def check_result(result: dpb.WriteResult, limits: Limits) -> None:
    """One WriteResult (its status against the transfer is checked by state)."""
    require_id(result.transfer_id, "transfer_id", limits)
    _non_negative(result.layers_written_count, "layers_written_count")
    _non_negative(result.bytes_written, "bytes_written")
    require_text(result.error_message, "error_message")
    require_id(result.dropped_decode_agent_name, "dropped_decode_agent_name", limits, required=False)
    if result.HasField("first_token_id"):
        _non_negative(result.first_token_id, "first_token_id")
    if result.HasField("timing"):
        check_timing(result.timing)
    if result.status not in dpb.WriteResultStatus.values() or result.status == dpb.WRITE_RESULT_STATUS_UNSPECIFIED:
        raise InvalidArgument(f"status {result.status} is not a known WriteResultStatus other than UNSPECIFIED")


def check_timing(timing: tpb.TransferTiming) -> None:
    """A rank's TransferTiming: valid timestamps, a non-negative duration and counts."""
    for name in ("first_write_start_time", "last_write_end_time", "prefill_end_time"):
        if timing.HasField(name):
            _timestamp(getattr(timing, name), f"timing.{name}")
    if timing.HasField("post_duration"):
        duration_s(timing.post_duration, "timing.post_duration")
    _non_negative(timing.write_count, "timing.write_count")
    _non_negative(timing.descriptor_count, "timing.descriptor_count")
    _non_negative(timing.layers_written_before_prefill_end_count, "timing.layers_written_before_prefill_end_count")


def check_load(load: tpb.EngineLoad) -> None:
    """An EngineLoad carried by a renewal: counts not negative."""
    _non_negative(load.free_block_count, "load.free_block_count")
    _non_negative(load.running_request_count, "load.running_request_count")


def check_hello(hello: dpb.Hello, limits: Limits) -> None:
    """The Hello that opens a StreamPrefill session."""
    require_id(hello.engine_id, "hello.engine_id", limits)
    require_id(hello.lease_id, "hello.lease_id", limits)
    require_id(hello.directory_incarnation_id, "hello.directory_incarnation_id", limits, required=False)
    _non_negative(hello.tp_rank, "hello.tp_rank", MAX_TP_SIZE)


def check_rank(tp_rank: int, name: str) -> None:
    """A TP rank: in [0, MAX_TP_SIZE)."""
    _non_negative(tp_rank, name, MAX_TP_SIZE - 1)


def check_page(page_size: int, limits: Limits) -> int:
    """A page size: 0 means 100; negative or over the cap is refused. Returns the effective size."""
    if page_size < 0 or page_size > limits.max_page_size:
        raise InvalidArgument(f"page_size {page_size} is outside [0, {limits.max_page_size}]")
    return page_size or 100


def same_layout_shape(a: tpb.KVLayout, b: tpb.KVLayout) -> str:
    """Why two ranks' layouts disagree on what a peer relies on ("" when they agree).

    Addresses, device and layer names are per rank; everything that sizes or places a block must match.
    """
    for name in ("layer_count", "block_size_tokens", "block_count", "block_bytes_per_layer", "dtype",
                 "memory_kind", "layer_region_bytes", "compatibility_hash", "block_atomic", "kv_head_count",
                 "model_kv_head_count"):
        if getattr(a, name) != getattr(b, name):
            return f"layout.{name} {getattr(b, name)!r} differs from the engine's {getattr(a, name)!r}"
    if list(a.planes) != list(b.planes):
        return "layout.planes differ from the engine's"
    return ""


class Undecodable:
    """What the guarded deserializer yields for bytes that are no message of the method's type."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


def decoding(deserializer: Callable[[bytes], object] | None) -> Callable[[bytes], object] | None:
    """Wrap a request deserializer so a body that does not decode becomes `Undecodable` (not an exception)."""
    if deserializer is None:
        return None

    def decode(raw: bytes) -> object:
        try:
            return deserializer(raw)
        except Exception as error:  # protobuf's DecodeError, or any parser failure: the caller's bytes are bad
            return Undecodable(type(error).__name__)

    return decode
