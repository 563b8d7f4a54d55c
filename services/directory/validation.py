"""Wire-input checks run by the servicer before any state call.

Each function raises `errors.InvalidArgument` with a precise message (naming the field) and
returns nothing, so a refused request never reaches `state` and changes nothing. The checks are
structural (presence, lengths, ranges, caps); checks that need the state (a layer index against
the engine's layer count, block ids against its block count) live in `state`.
"""

from __future__ import annotations

from kvpush.services.directory.errors import InvalidArgument
from kvpush.services.directory.state import Limits
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb

MAX_LAYERS = 4096
MAX_AGENT_METADATA_BYTES = 4 * 1024 * 1024
MAX_TEXT_LENGTH = 1024


def require_id(value: str, name: str, limits: Limits, required: bool = True) -> None:
    """An identifier: present when required, at most `max_id_length` characters."""
    if not value:
        if required:
            raise InvalidArgument(f"{name} is required")
        return
    if len(value) > limits.max_id_length:
        raise InvalidArgument(f"{name} is {len(value)} characters; at most {limits.max_id_length}")


def require_text(value: str, name: str) -> None:
    """Free text (reasons, trace context, endpoints): bounded length."""
    if len(value) > MAX_TEXT_LENGTH:
        raise InvalidArgument(f"{name} is {len(value)} characters; at most {MAX_TEXT_LENGTH}")


def _positive(value: int, name: str) -> None:
    if value <= 0:
        raise InvalidArgument(f"{name} must be positive, got {value}")


def _non_negative(value: int, name: str) -> None:
    if value < 0:
        raise InvalidArgument(f"{name} must not be negative, got {value}")


def check_layout(layout: tpb.KVLayout) -> None:
    """A KV layout a peer can compute descriptors from."""
    _positive(layout.layer_count, "layout.layer_count")
    if layout.layer_count > MAX_LAYERS:
        raise InvalidArgument(f"layout.layer_count {layout.layer_count} is over {MAX_LAYERS}")
    _positive(layout.block_size_tokens, "layout.block_size_tokens")
    _positive(layout.block_count, "layout.block_count")
    _positive(layout.block_bytes_per_layer, "layout.block_bytes_per_layer")
    _positive(layout.layer_region_bytes, "layout.layer_region_bytes")
    _non_negative(layout.device_id, "layout.device_id")
    if not layout.dtype:
        raise InvalidArgument("layout.dtype is required")
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
    if layout.layer_names and len(layout.layer_names) != layout.layer_count:
        raise InvalidArgument(
            f"layout.layer_names has {len(layout.layer_names)} entries; layer_count is {layout.layer_count}")


def check_register(request: dpb.RegisterEngineRequest, limits: Limits) -> None:
    """RegisterEngineRequest: ids, role, rank range, decode metadata, layout."""
    require_id(request.engine_id, "engine_id", limits)
    require_id(request.agent_name, "agent_name", limits)
    require_text(request.endpoint, "endpoint")
    if request.role not in (tpb.ENGINE_ROLE_PREFILL, tpb.ENGINE_ROLE_DECODE):
        raise InvalidArgument("role must be ENGINE_ROLE_PREFILL or ENGINE_ROLE_DECODE")
    _positive(request.tp_size, "tp_size")
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
    _non_negative(request.prompt_token_count, "prompt_token_count")
    if not request.HasField("ttl"):
        return None
    ttl = request.ttl.ToNanoseconds() / 1e9
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


def check_layer_ready(event: dpb.LayerReady, limits: Limits) -> None:
    """One LayerReady event (its layer index against the engine's layer count is checked by state)."""
    require_id(event.transfer_id, "transfer_id", limits)
    _non_negative(event.first_layer, "first_layer")
    if event.last_layer < event.first_layer:
        raise InvalidArgument(f"last_layer {event.last_layer} is before first_layer {event.first_layer}")
    _non_negative(event.token_start, "token_start")
    if event.token_end <= event.token_start:
        raise InvalidArgument(f"token_end {event.token_end} is not after token_start {event.token_start}")
    _positive(event.prompt_token_count, "prompt_token_count")
    if event.token_end > event.prompt_token_count:
        raise InvalidArgument(
            f"token_end {event.token_end} is past prompt_token_count {event.prompt_token_count}")
    if len(event.source_block_ids) > limits.max_block_ids:
        raise InvalidArgument(f"source_block_ids is over the cap of {limits.max_block_ids}")


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
    if result.status not in dpb.WriteResultStatus.values() or result.status == dpb.WRITE_RESULT_STATUS_UNSPECIFIED:
        raise InvalidArgument(f"status {result.status} is not a known WriteResultStatus other than UNSPECIFIED")


def check_hello(hello: dpb.Hello, limits: Limits) -> None:
    """The Hello that opens a StreamPrefill session."""
    require_id(hello.engine_id, "hello.engine_id", limits)
    require_id(hello.lease_id, "hello.lease_id", limits)
    _non_negative(hello.tp_rank, "hello.tp_rank")


def check_page(page_size: int, limits: Limits) -> int:
    """A page size: 0 means 100; negative or over the cap is refused. Returns the effective size."""
    if page_size < 0 or page_size > limits.max_page_size:
        raise InvalidArgument(f"page_size {page_size} is outside [0, {limits.max_page_size}]")
    return page_size or 100
