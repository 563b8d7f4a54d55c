import datetime

from google.api import field_behavior_pb2 as _field_behavior_pb2
from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_ROLE_UNSPECIFIED: _ClassVar[EngineRole]
    ENGINE_ROLE_PREFILL: _ClassVar[EngineRole]
    ENGINE_ROLE_DECODE: _ClassVar[EngineRole]

class MemoryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMORY_KIND_UNSPECIFIED: _ClassVar[MemoryKind]
    MEMORY_KIND_DRAM: _ClassVar[MemoryKind]
    MEMORY_KIND_VRAM: _ClassVar[MemoryKind]

class KVCacheGroupKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_CACHE_GROUP_KIND_UNSPECIFIED: _ClassVar[KVCacheGroupKind]
    KV_CACHE_GROUP_KIND_ATTENTION: _ClassVar[KVCacheGroupKind]
    KV_CACHE_GROUP_KIND_STATE: _ClassVar[KVCacheGroupKind]

class TransferState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_STATE_UNSPECIFIED: _ClassVar[TransferState]
    TRANSFER_STATE_PLANNED: _ClassVar[TransferState]
    TRANSFER_STATE_ALLOCATED: _ClassVar[TransferState]
    TRANSFER_STATE_STREAMING: _ClassVar[TransferState]
    TRANSFER_STATE_COMPLETE: _ClassVar[TransferState]
    TRANSFER_STATE_FAILED: _ClassVar[TransferState]
    TRANSFER_STATE_CANCELLED: _ClassVar[TransferState]
    TRANSFER_STATE_EXPIRED: _ClassVar[TransferState]
ENGINE_ROLE_UNSPECIFIED: EngineRole
ENGINE_ROLE_PREFILL: EngineRole
ENGINE_ROLE_DECODE: EngineRole
MEMORY_KIND_UNSPECIFIED: MemoryKind
MEMORY_KIND_DRAM: MemoryKind
MEMORY_KIND_VRAM: MemoryKind
KV_CACHE_GROUP_KIND_UNSPECIFIED: KVCacheGroupKind
KV_CACHE_GROUP_KIND_ATTENTION: KVCacheGroupKind
KV_CACHE_GROUP_KIND_STATE: KVCacheGroupKind
TRANSFER_STATE_UNSPECIFIED: TransferState
TRANSFER_STATE_PLANNED: TransferState
TRANSFER_STATE_ALLOCATED: TransferState
TRANSFER_STATE_STREAMING: TransferState
TRANSFER_STATE_COMPLETE: TransferState
TRANSFER_STATE_FAILED: TransferState
TRANSFER_STATE_CANCELLED: TransferState
TRANSFER_STATE_EXPIRED: TransferState

class KVPlane(_message.Message):
    __slots__ = ("offset_bytes", "block_stride_bytes", "block_bytes", "segment_count", "segment_stride_bytes", "token_stride_bytes", "segment_bytes_per_token")
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_COUNT_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    offset_bytes: int
    block_stride_bytes: int
    block_bytes: int
    segment_count: int
    segment_stride_bytes: int
    token_stride_bytes: int
    segment_bytes_per_token: int
    def __init__(self, offset_bytes: _Optional[int] = ..., block_stride_bytes: _Optional[int] = ..., block_bytes: _Optional[int] = ..., segment_count: _Optional[int] = ..., segment_stride_bytes: _Optional[int] = ..., token_stride_bytes: _Optional[int] = ..., segment_bytes_per_token: _Optional[int] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("layer_count", "block_size_tokens", "block_count", "block_bytes_per_layer", "dtype", "memory_kind", "device_id", "planes", "layer_base_addresses", "layer_region_bytes", "layer_names", "compatibility_hash", "block_atomic", "kv_head_count", "model_kv_head_count", "kv_cache_groups")
    LAYER_COUNT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_COUNT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_PER_LAYER_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    PLANES_FIELD_NUMBER: _ClassVar[int]
    LAYER_BASE_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    LAYER_REGION_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYER_NAMES_FIELD_NUMBER: _ClassVar[int]
    COMPATIBILITY_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ATOMIC_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_COUNT_FIELD_NUMBER: _ClassVar[int]
    MODEL_KV_HEAD_COUNT_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    layer_count: int
    block_size_tokens: int
    block_count: int
    block_bytes_per_layer: int
    dtype: str
    memory_kind: MemoryKind
    device_id: int
    planes: _containers.RepeatedCompositeFieldContainer[KVPlane]
    layer_base_addresses: _containers.RepeatedScalarFieldContainer[int]
    layer_region_bytes: int
    layer_names: _containers.RepeatedScalarFieldContainer[str]
    compatibility_hash: str
    block_atomic: bool
    kv_head_count: int
    model_kv_head_count: int
    kv_cache_groups: _containers.RepeatedCompositeFieldContainer[KVCacheGroup]
    def __init__(self, layer_count: _Optional[int] = ..., block_size_tokens: _Optional[int] = ..., block_count: _Optional[int] = ..., block_bytes_per_layer: _Optional[int] = ..., dtype: _Optional[str] = ..., memory_kind: _Optional[_Union[MemoryKind, str]] = ..., device_id: _Optional[int] = ..., planes: _Optional[_Iterable[_Union[KVPlane, _Mapping]]] = ..., layer_base_addresses: _Optional[_Iterable[int]] = ..., layer_region_bytes: _Optional[int] = ..., layer_names: _Optional[_Iterable[str]] = ..., compatibility_hash: _Optional[str] = ..., block_atomic: _Optional[bool] = ..., kv_head_count: _Optional[int] = ..., model_kv_head_count: _Optional[int] = ..., kv_cache_groups: _Optional[_Iterable[_Union[KVCacheGroup, _Mapping]]] = ...) -> None: ...

class KVCacheGroup(_message.Message):
    __slots__ = ("group_index", "layers", "sliding_window_tokens", "kind", "block_size_tokens", "state_ranges", "state_block_stride_bytes")
    GROUP_INDEX_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATE_RANGES_FIELD_NUMBER: _ClassVar[int]
    STATE_BLOCK_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    group_index: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    sliding_window_tokens: int
    kind: KVCacheGroupKind
    block_size_tokens: int
    state_ranges: _containers.RepeatedCompositeFieldContainer[ByteRange]
    state_block_stride_bytes: int
    def __init__(self, group_index: _Optional[int] = ..., layers: _Optional[_Iterable[int]] = ..., sliding_window_tokens: _Optional[int] = ..., kind: _Optional[_Union[KVCacheGroupKind, str]] = ..., block_size_tokens: _Optional[int] = ..., state_ranges: _Optional[_Iterable[_Union[ByteRange, _Mapping]]] = ..., state_block_stride_bytes: _Optional[int] = ...) -> None: ...

class ByteRange(_message.Message):
    __slots__ = ("offset_bytes", "length_bytes")
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    LENGTH_BYTES_FIELD_NUMBER: _ClassVar[int]
    offset_bytes: int
    length_bytes: int
    def __init__(self, offset_bytes: _Optional[int] = ..., length_bytes: _Optional[int] = ...) -> None: ...

class BlockGroup(_message.Message):
    __slots__ = ("group_index", "block_ids", "first_token")
    GROUP_INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    group_index: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token: int
    def __init__(self, group_index: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., first_token: _Optional[int] = ...) -> None: ...

class EngineLoad(_message.Message):
    __slots__ = ("free_block_count", "running_request_count", "waiting_request_count")
    FREE_BLOCK_COUNT_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUEST_COUNT_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUEST_COUNT_FIELD_NUMBER: _ClassVar[int]
    free_block_count: int
    running_request_count: int
    waiting_request_count: int
    def __init__(self, free_block_count: _Optional[int] = ..., running_request_count: _Optional[int] = ..., waiting_request_count: _Optional[int] = ...) -> None: ...

class EngineWorker(_message.Message):
    __slots__ = ("engine_id", "role", "tp_rank", "tp_size", "agent_name", "agent_metadata", "layout", "endpoint", "lease_id", "lease_expire_time", "load", "active_transfer_count", "register_time", "model", "unreachable_time", "unreachable_reason", "forces_first_token")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_TRANSFER_COUNT_FIELD_NUMBER: _ClassVar[int]
    REGISTER_TIME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_TIME_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_REASON_FIELD_NUMBER: _ClassVar[int]
    FORCES_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    role: EngineRole
    tp_rank: int
    tp_size: int
    agent_name: str
    agent_metadata: bytes
    layout: KVLayout
    endpoint: str
    lease_id: str
    lease_expire_time: _timestamp_pb2.Timestamp
    load: EngineLoad
    active_transfer_count: int
    register_time: _timestamp_pb2.Timestamp
    model: str
    unreachable_time: _timestamp_pb2.Timestamp
    unreachable_reason: str
    forces_first_token: bool
    def __init__(self, engine_id: _Optional[str] = ..., role: _Optional[_Union[EngineRole, str]] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., endpoint: _Optional[str] = ..., lease_id: _Optional[str] = ..., lease_expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., load: _Optional[_Union[EngineLoad, _Mapping]] = ..., active_transfer_count: _Optional[int] = ..., register_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., model: _Optional[str] = ..., unreachable_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., unreachable_reason: _Optional[str] = ..., forces_first_token: _Optional[bool] = ...) -> None: ...

class Transfer(_message.Message):
    __slots__ = ("transfer_id", "request_id", "state", "prefill_engine_id", "decode_engine_id", "prompt_token_count", "prefix_hit_token_count", "decode_block_ids", "layers_written_count", "bytes_written", "failure_reason", "create_time", "allocate_time", "first_ready_time", "dispatch_time", "end_time", "deadline", "trace_context", "rank_timings", "layer_timings", "first_token_id", "decode_block_groups")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    DECODE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_WRITTEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    FAILURE_REASON_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    ALLOCATE_TIME_FIELD_NUMBER: _ClassVar[int]
    FIRST_READY_TIME_FIELD_NUMBER: _ClassVar[int]
    DISPATCH_TIME_FIELD_NUMBER: _ClassVar[int]
    END_TIME_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    RANK_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    LAYER_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_BLOCK_GROUPS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    request_id: str
    state: TransferState
    prefill_engine_id: str
    decode_engine_id: str
    prompt_token_count: int
    prefix_hit_token_count: int
    decode_block_ids: _containers.RepeatedScalarFieldContainer[int]
    layers_written_count: int
    bytes_written: int
    failure_reason: str
    create_time: _timestamp_pb2.Timestamp
    allocate_time: _timestamp_pb2.Timestamp
    first_ready_time: _timestamp_pb2.Timestamp
    dispatch_time: _timestamp_pb2.Timestamp
    end_time: _timestamp_pb2.Timestamp
    deadline: _timestamp_pb2.Timestamp
    trace_context: str
    rank_timings: _containers.RepeatedCompositeFieldContainer[RankTiming]
    layer_timings: _containers.RepeatedCompositeFieldContainer[LayerTiming]
    first_token_id: int
    decode_block_groups: _containers.RepeatedCompositeFieldContainer[BlockGroup]
    def __init__(self, transfer_id: _Optional[str] = ..., request_id: _Optional[str] = ..., state: _Optional[_Union[TransferState, str]] = ..., prefill_engine_id: _Optional[str] = ..., decode_engine_id: _Optional[str] = ..., prompt_token_count: _Optional[int] = ..., prefix_hit_token_count: _Optional[int] = ..., decode_block_ids: _Optional[_Iterable[int]] = ..., layers_written_count: _Optional[int] = ..., bytes_written: _Optional[int] = ..., failure_reason: _Optional[str] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., allocate_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., first_ready_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., dispatch_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., end_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., trace_context: _Optional[str] = ..., rank_timings: _Optional[_Iterable[_Union[RankTiming, _Mapping]]] = ..., layer_timings: _Optional[_Iterable[_Union[LayerTiming, _Mapping]]] = ..., first_token_id: _Optional[int] = ..., decode_block_groups: _Optional[_Iterable[_Union[BlockGroup, _Mapping]]] = ...) -> None: ...

class LayerTiming(_message.Message):
    __slots__ = ("layer", "ready_time", "written_time")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    READY_TIME_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_TIME_FIELD_NUMBER: _ClassVar[int]
    layer: int
    ready_time: _timestamp_pb2.Timestamp
    written_time: _timestamp_pb2.Timestamp
    def __init__(self, layer: _Optional[int] = ..., ready_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., written_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class RankTiming(_message.Message):
    __slots__ = ("tp_rank", "timing")
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    tp_rank: int
    timing: TransferTiming
    def __init__(self, tp_rank: _Optional[int] = ..., timing: _Optional[_Union[TransferTiming, _Mapping]] = ...) -> None: ...

class TransferTiming(_message.Message):
    __slots__ = ("first_write_start_time", "last_write_end_time", "prefill_end_time", "post_duration", "write_count", "descriptor_count", "layers_written_before_prefill_end_count", "writes_before_prefill_end_count", "bytes_written", "layer_writes")
    FIRST_WRITE_START_TIME_FIELD_NUMBER: _ClassVar[int]
    LAST_WRITE_END_TIME_FIELD_NUMBER: _ClassVar[int]
    PREFILL_END_TIME_FIELD_NUMBER: _ClassVar[int]
    POST_DURATION_FIELD_NUMBER: _ClassVar[int]
    WRITE_COUNT_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    LAYERS_WRITTEN_BEFORE_PREFILL_END_COUNT_FIELD_NUMBER: _ClassVar[int]
    WRITES_BEFORE_PREFILL_END_COUNT_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    LAYER_WRITES_FIELD_NUMBER: _ClassVar[int]
    first_write_start_time: _timestamp_pb2.Timestamp
    last_write_end_time: _timestamp_pb2.Timestamp
    prefill_end_time: _timestamp_pb2.Timestamp
    post_duration: _duration_pb2.Duration
    write_count: int
    descriptor_count: int
    layers_written_before_prefill_end_count: int
    writes_before_prefill_end_count: int
    bytes_written: int
    layer_writes: _containers.RepeatedCompositeFieldContainer[LayerWrite]
    def __init__(self, first_write_start_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_write_end_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., prefill_end_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., post_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., write_count: _Optional[int] = ..., descriptor_count: _Optional[int] = ..., layers_written_before_prefill_end_count: _Optional[int] = ..., writes_before_prefill_end_count: _Optional[int] = ..., bytes_written: _Optional[int] = ..., layer_writes: _Optional[_Iterable[_Union[LayerWrite, _Mapping]]] = ...) -> None: ...

class LayerWrite(_message.Message):
    __slots__ = ("layer", "end_time", "post_time")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    END_TIME_FIELD_NUMBER: _ClassVar[int]
    POST_TIME_FIELD_NUMBER: _ClassVar[int]
    layer: int
    end_time: _timestamp_pb2.Timestamp
    post_time: _timestamp_pb2.Timestamp
    def __init__(self, layer: _Optional[int] = ..., end_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., post_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...
