import datetime

from google.api import field_behavior_pb2 as _field_behavior_pb2
from google.protobuf import duration_pb2 as _duration_pb2
from google.rpc import status_pb2 as _status_pb2
from kvpush.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WriteResultStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WRITE_RESULT_STATUS_UNSPECIFIED: _ClassVar[WriteResultStatus]
    WRITE_RESULT_STATUS_PROGRESS: _ClassVar[WriteResultStatus]
    WRITE_RESULT_STATUS_DONE: _ClassVar[WriteResultStatus]
    WRITE_RESULT_STATUS_FAILED: _ClassVar[WriteResultStatus]
    WRITE_RESULT_STATUS_CANCELLED: _ClassVar[WriteResultStatus]
WRITE_RESULT_STATUS_UNSPECIFIED: WriteResultStatus
WRITE_RESULT_STATUS_PROGRESS: WriteResultStatus
WRITE_RESULT_STATUS_DONE: WriteResultStatus
WRITE_RESULT_STATUS_FAILED: WriteResultStatus
WRITE_RESULT_STATUS_CANCELLED: WriteResultStatus

class ResponseHeader(_message.Message):
    __slots__ = ("directory_incarnation_id", "replica_id")
    DIRECTORY_INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    directory_incarnation_id: str
    replica_id: str
    def __init__(self, directory_incarnation_id: _Optional[str] = ..., replica_id: _Optional[str] = ...) -> None: ...

class GetReplicasRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DirectoryReplica(_message.Message):
    __slots__ = ("replica_id", "address")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class GetReplicasResponse(_message.Message):
    __slots__ = ("replicas", "shard_count", "shard_owner_replica_ids", "replica_id", "directory_incarnation_id", "header")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    SHARD_OWNER_REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[DirectoryReplica]
    shard_count: int
    shard_owner_replica_ids: _containers.RepeatedScalarFieldContainer[str]
    replica_id: str
    directory_incarnation_id: str
    header: ResponseHeader
    def __init__(self, replicas: _Optional[_Iterable[_Union[DirectoryReplica, _Mapping]]] = ..., shard_count: _Optional[int] = ..., shard_owner_replica_ids: _Optional[_Iterable[str]] = ..., replica_id: _Optional[str] = ..., directory_incarnation_id: _Optional[str] = ..., header: _Optional[_Union[ResponseHeader, _Mapping]] = ...) -> None: ...

class RegisterEngineRequest(_message.Message):
    __slots__ = ("engine_id", "role", "tp_rank", "tp_size", "agent_name", "agent_metadata", "layout", "endpoint", "model", "forces_first_token")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FORCES_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    role: _types_pb2.EngineRole
    tp_rank: int
    tp_size: int
    agent_name: str
    agent_metadata: bytes
    layout: _types_pb2.KVLayout
    endpoint: str
    model: str
    forces_first_token: bool
    def __init__(self, engine_id: _Optional[str] = ..., role: _Optional[_Union[_types_pb2.EngineRole, str]] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., layout: _Optional[_Union[_types_pb2.KVLayout, _Mapping]] = ..., endpoint: _Optional[str] = ..., model: _Optional[str] = ..., forces_first_token: _Optional[bool] = ...) -> None: ...

class RegisterEngineResponse(_message.Message):
    __slots__ = ("lease_id", "ttl", "directory_incarnation_id", "header")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    ttl: _duration_pb2.Duration
    directory_incarnation_id: str
    header: ResponseHeader
    def __init__(self, lease_id: _Optional[str] = ..., ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., directory_incarnation_id: _Optional[str] = ..., header: _Optional[_Union[ResponseHeader, _Mapping]] = ...) -> None: ...

class DeregisterEngineRequest(_message.Message):
    __slots__ = ("engine_id", "tp_rank", "lease_id")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    tp_rank: int
    lease_id: str
    def __init__(self, engine_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., lease_id: _Optional[str] = ...) -> None: ...

class DeregisterEngineResponse(_message.Message):
    __slots__ = ("directory_incarnation_id", "header")
    DIRECTORY_INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    directory_incarnation_id: str
    header: ResponseHeader
    def __init__(self, directory_incarnation_id: _Optional[str] = ..., header: _Optional[_Union[ResponseHeader, _Mapping]] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "load")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    load: _types_pb2.EngineLoad
    def __init__(self, lease_id: _Optional[str] = ..., load: _Optional[_Union[_types_pb2.EngineLoad, _Mapping]] = ...) -> None: ...

class RenewLeaseResponse(_message.Message):
    __slots__ = ("lease_id", "ttl", "directory_incarnation_id", "header")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    ttl: _duration_pb2.Duration
    directory_incarnation_id: str
    header: ResponseHeader
    def __init__(self, lease_id: _Optional[str] = ..., ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., directory_incarnation_id: _Optional[str] = ..., header: _Optional[_Union[ResponseHeader, _Mapping]] = ...) -> None: ...

class PlanTransferRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_count", "prefill_engine_id", "decode_engine_id", "trace_context", "ttl", "model", "transfer_id", "client_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_count: int
    prefill_engine_id: str
    decode_engine_id: str
    trace_context: str
    ttl: _duration_pb2.Duration
    model: str
    transfer_id: str
    client_id: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_count: _Optional[int] = ..., prefill_engine_id: _Optional[str] = ..., decode_engine_id: _Optional[str] = ..., trace_context: _Optional[str] = ..., ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., model: _Optional[str] = ..., transfer_id: _Optional[str] = ..., client_id: _Optional[str] = ...) -> None: ...

class PlanTransferResponse(_message.Message):
    __slots__ = ("transfer", "prefill_endpoint", "decode_endpoint", "decode_forces_first_token", "directory_incarnation_id", "header")
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DECODE_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DECODE_FORCES_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    transfer: _types_pb2.Transfer
    prefill_endpoint: str
    decode_endpoint: str
    decode_forces_first_token: bool
    directory_incarnation_id: str
    header: ResponseHeader
    def __init__(self, transfer: _Optional[_Union[_types_pb2.Transfer, _Mapping]] = ..., prefill_endpoint: _Optional[str] = ..., decode_endpoint: _Optional[str] = ..., decode_forces_first_token: _Optional[bool] = ..., directory_incarnation_id: _Optional[str] = ..., header: _Optional[_Union[ResponseHeader, _Mapping]] = ...) -> None: ...

class ReportAllocationRequest(_message.Message):
    __slots__ = ("transfer_id", "engine_id", "block_ids", "prompt_token_count", "prefix_hit_token_count", "block_groups")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_GROUPS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    engine_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_token_count: int
    prefix_hit_token_count: int
    block_groups: _containers.RepeatedCompositeFieldContainer[_types_pb2.BlockGroup]
    def __init__(self, transfer_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., prompt_token_count: _Optional[int] = ..., prefix_hit_token_count: _Optional[int] = ..., block_groups: _Optional[_Iterable[_Union[_types_pb2.BlockGroup, _Mapping]]] = ...) -> None: ...

class ReportAllocationResponse(_message.Message):
    __slots__ = ("transfer", "directory_incarnation_id", "header")
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    transfer: _types_pb2.Transfer
    directory_incarnation_id: str
    header: ResponseHeader
    def __init__(self, transfer: _Optional[_Union[_types_pb2.Transfer, _Mapping]] = ..., directory_incarnation_id: _Optional[str] = ..., header: _Optional[_Union[ResponseHeader, _Mapping]] = ...) -> None: ...

class LayerReady(_message.Message):
    __slots__ = ("transfer_id", "layer_start", "layer_end", "token_start", "token_end", "source_block_ids", "prompt_token_count", "plan_in_flight", "source_block_groups")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_END_FIELD_NUMBER: _ClassVar[int]
    SOURCE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    PLAN_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_BLOCK_GROUPS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    layer_start: int
    layer_end: int
    token_start: int
    token_end: int
    source_block_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_token_count: int
    plan_in_flight: bool
    source_block_groups: _containers.RepeatedCompositeFieldContainer[_types_pb2.BlockGroup]
    def __init__(self, transfer_id: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., token_start: _Optional[int] = ..., token_end: _Optional[int] = ..., source_block_ids: _Optional[_Iterable[int]] = ..., prompt_token_count: _Optional[int] = ..., plan_in_flight: _Optional[bool] = ..., source_block_groups: _Optional[_Iterable[_Union[_types_pb2.BlockGroup, _Mapping]]] = ...) -> None: ...

class LayerReadyBatch(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[LayerReady]
    def __init__(self, events: _Optional[_Iterable[_Union[LayerReady, _Mapping]]] = ...) -> None: ...

class WriteResult(_message.Message):
    __slots__ = ("transfer_id", "status", "layers_written_count", "bytes_written", "error_message", "timing", "first_token_id", "dropped_decode_agent_name")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_WRITTEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    DROPPED_DECODE_AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    status: WriteResultStatus
    layers_written_count: int
    bytes_written: int
    error_message: str
    timing: _types_pb2.TransferTiming
    first_token_id: int
    dropped_decode_agent_name: str
    def __init__(self, transfer_id: _Optional[str] = ..., status: _Optional[_Union[WriteResultStatus, str]] = ..., layers_written_count: _Optional[int] = ..., bytes_written: _Optional[int] = ..., error_message: _Optional[str] = ..., timing: _Optional[_Union[_types_pb2.TransferTiming, _Mapping]] = ..., first_token_id: _Optional[int] = ..., dropped_decode_agent_name: _Optional[str] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("engine_id", "tp_rank", "lease_id", "directory_incarnation_id")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    tp_rank: int
    lease_id: str
    directory_incarnation_id: str
    def __init__(self, engine_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., lease_id: _Optional[str] = ..., directory_incarnation_id: _Optional[str] = ...) -> None: ...

class StreamPrefillRequest(_message.Message):
    __slots__ = ("hello", "ready", "result")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    ready: LayerReadyBatch
    result: WriteResult
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., ready: _Optional[_Union[LayerReadyBatch, _Mapping]] = ..., result: _Optional[_Union[WriteResult, _Mapping]] = ...) -> None: ...

class PushInstruction(_message.Message):
    __slots__ = ("transfer_id", "decode_engine_id", "decode_tp_rank", "decode_agent_name", "decode_agent_metadata", "decode_layout", "decode_block_ids", "skip_token_count", "prompt_token_count", "notification", "trace_context", "head_slice", "more_destinations", "decode_block_groups")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_TP_RANK_FIELD_NUMBER: _ClassVar[int]
    DECODE_AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    DECODE_AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    DECODE_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DECODE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    NOTIFICATION_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    HEAD_SLICE_FIELD_NUMBER: _ClassVar[int]
    MORE_DESTINATIONS_FIELD_NUMBER: _ClassVar[int]
    DECODE_BLOCK_GROUPS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    decode_engine_id: str
    decode_tp_rank: int
    decode_agent_name: str
    decode_agent_metadata: bytes
    decode_layout: _types_pb2.KVLayout
    decode_block_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_token_count: int
    prompt_token_count: int
    notification: bytes
    trace_context: str
    head_slice: KVHeadSlice
    more_destinations: _containers.RepeatedCompositeFieldContainer[PushDestination]
    decode_block_groups: _containers.RepeatedCompositeFieldContainer[_types_pb2.BlockGroup]
    def __init__(self, transfer_id: _Optional[str] = ..., decode_engine_id: _Optional[str] = ..., decode_tp_rank: _Optional[int] = ..., decode_agent_name: _Optional[str] = ..., decode_agent_metadata: _Optional[bytes] = ..., decode_layout: _Optional[_Union[_types_pb2.KVLayout, _Mapping]] = ..., decode_block_ids: _Optional[_Iterable[int]] = ..., skip_token_count: _Optional[int] = ..., prompt_token_count: _Optional[int] = ..., notification: _Optional[bytes] = ..., trace_context: _Optional[str] = ..., head_slice: _Optional[_Union[KVHeadSlice, _Mapping]] = ..., more_destinations: _Optional[_Iterable[_Union[PushDestination, _Mapping]]] = ..., decode_block_groups: _Optional[_Iterable[_Union[_types_pb2.BlockGroup, _Mapping]]] = ...) -> None: ...

class KVHeadSlice(_message.Message):
    __slots__ = ("source_head_start", "destination_head_start", "head_count")
    SOURCE_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    HEAD_COUNT_FIELD_NUMBER: _ClassVar[int]
    source_head_start: int
    destination_head_start: int
    head_count: int
    def __init__(self, source_head_start: _Optional[int] = ..., destination_head_start: _Optional[int] = ..., head_count: _Optional[int] = ...) -> None: ...

class PushDestination(_message.Message):
    __slots__ = ("decode_tp_rank", "decode_agent_name", "decode_agent_metadata", "decode_layout", "head_slice", "notification")
    DECODE_TP_RANK_FIELD_NUMBER: _ClassVar[int]
    DECODE_AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    DECODE_AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    DECODE_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    HEAD_SLICE_FIELD_NUMBER: _ClassVar[int]
    NOTIFICATION_FIELD_NUMBER: _ClassVar[int]
    decode_tp_rank: int
    decode_agent_name: str
    decode_agent_metadata: bytes
    decode_layout: _types_pb2.KVLayout
    head_slice: KVHeadSlice
    notification: bytes
    def __init__(self, decode_tp_rank: _Optional[int] = ..., decode_agent_name: _Optional[str] = ..., decode_agent_metadata: _Optional[bytes] = ..., decode_layout: _Optional[_Union[_types_pb2.KVLayout, _Mapping]] = ..., head_slice: _Optional[_Union[KVHeadSlice, _Mapping]] = ..., notification: _Optional[bytes] = ...) -> None: ...

class PeerAnnouncement(_message.Message):
    __slots__ = ("decode_engine_id", "decode_tp_rank", "decode_agent_name", "decode_agent_metadata", "decode_layout")
    DECODE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_TP_RANK_FIELD_NUMBER: _ClassVar[int]
    DECODE_AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    DECODE_AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    DECODE_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    decode_engine_id: str
    decode_tp_rank: int
    decode_agent_name: str
    decode_agent_metadata: bytes
    decode_layout: _types_pb2.KVLayout
    def __init__(self, decode_engine_id: _Optional[str] = ..., decode_tp_rank: _Optional[int] = ..., decode_agent_name: _Optional[str] = ..., decode_agent_metadata: _Optional[bytes] = ..., decode_layout: _Optional[_Union[_types_pb2.KVLayout, _Mapping]] = ...) -> None: ...

class Cancellation(_message.Message):
    __slots__ = ("transfer_id", "reason")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    reason: str
    def __init__(self, transfer_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class EventRejection(_message.Message):
    __slots__ = ("transfer_id", "status")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    status: _status_pb2.Status
    def __init__(self, transfer_id: _Optional[str] = ..., status: _Optional[_Union[_status_pb2.Status, _Mapping]] = ...) -> None: ...

class SessionOpened(_message.Message):
    __slots__ = ("directory_incarnation_id",)
    DIRECTORY_INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    directory_incarnation_id: str
    def __init__(self, directory_incarnation_id: _Optional[str] = ...) -> None: ...

class StreamPrefillResponse(_message.Message):
    __slots__ = ("instruction", "cancellation", "rejection", "opened", "peer", "directory_incarnation_id", "header")
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    CANCELLATION_FIELD_NUMBER: _ClassVar[int]
    REJECTION_FIELD_NUMBER: _ClassVar[int]
    OPENED_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    instruction: PushInstruction
    cancellation: Cancellation
    rejection: EventRejection
    opened: SessionOpened
    peer: PeerAnnouncement
    directory_incarnation_id: str
    header: ResponseHeader
    def __init__(self, instruction: _Optional[_Union[PushInstruction, _Mapping]] = ..., cancellation: _Optional[_Union[Cancellation, _Mapping]] = ..., rejection: _Optional[_Union[EventRejection, _Mapping]] = ..., opened: _Optional[_Union[SessionOpened, _Mapping]] = ..., peer: _Optional[_Union[PeerAnnouncement, _Mapping]] = ..., directory_incarnation_id: _Optional[str] = ..., header: _Optional[_Union[ResponseHeader, _Mapping]] = ...) -> None: ...

class WatchTransfersRequest(_message.Message):
    __slots__ = ("engine_id", "after_sequence_number", "directory_incarnation_id", "replay_retained")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    REPLAY_RETAINED_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    after_sequence_number: int
    directory_incarnation_id: str
    replay_retained: bool
    def __init__(self, engine_id: _Optional[str] = ..., after_sequence_number: _Optional[int] = ..., directory_incarnation_id: _Optional[str] = ..., replay_retained: _Optional[bool] = ...) -> None: ...

class TransferEvent(_message.Message):
    __slots__ = ("sequence_number", "transfer_id", "state", "reason", "bytes_written", "first_token_id")
    SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    sequence_number: int
    transfer_id: str
    state: _types_pb2.TransferState
    reason: str
    bytes_written: int
    first_token_id: int
    def __init__(self, sequence_number: _Optional[int] = ..., transfer_id: _Optional[str] = ..., state: _Optional[_Union[_types_pb2.TransferState, str]] = ..., reason: _Optional[str] = ..., bytes_written: _Optional[int] = ..., first_token_id: _Optional[int] = ...) -> None: ...

class WatchTransfersResponse(_message.Message):
    __slots__ = ("events", "directory_incarnation_id", "header")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[TransferEvent]
    directory_incarnation_id: str
    header: ResponseHeader
    def __init__(self, events: _Optional[_Iterable[_Union[TransferEvent, _Mapping]]] = ..., directory_incarnation_id: _Optional[str] = ..., header: _Optional[_Union[ResponseHeader, _Mapping]] = ...) -> None: ...

class CancelTransferRequest(_message.Message):
    __slots__ = ("transfer_id", "reason")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    reason: str
    def __init__(self, transfer_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelTransferResponse(_message.Message):
    __slots__ = ("transfer", "directory_incarnation_id", "header")
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    transfer: _types_pb2.Transfer
    directory_incarnation_id: str
    header: ResponseHeader
    def __init__(self, transfer: _Optional[_Union[_types_pb2.Transfer, _Mapping]] = ..., directory_incarnation_id: _Optional[str] = ..., header: _Optional[_Union[ResponseHeader, _Mapping]] = ...) -> None: ...

class GetTransferRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class GetTransferResponse(_message.Message):
    __slots__ = ("transfer", "directory_incarnation_id", "header")
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    transfer: _types_pb2.Transfer
    directory_incarnation_id: str
    header: ResponseHeader
    def __init__(self, transfer: _Optional[_Union[_types_pb2.Transfer, _Mapping]] = ..., directory_incarnation_id: _Optional[str] = ..., header: _Optional[_Union[ResponseHeader, _Mapping]] = ...) -> None: ...

class ListTransfersRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "state", "engine_id")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    state: _types_pb2.TransferState
    engine_id: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., state: _Optional[_Union[_types_pb2.TransferState, str]] = ..., engine_id: _Optional[str] = ...) -> None: ...

class ListTransfersResponse(_message.Message):
    __slots__ = ("transfers", "next_page_token", "directory_incarnation_id", "header")
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    transfers: _containers.RepeatedCompositeFieldContainer[_types_pb2.Transfer]
    next_page_token: str
    directory_incarnation_id: str
    header: ResponseHeader
    def __init__(self, transfers: _Optional[_Iterable[_Union[_types_pb2.Transfer, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., directory_incarnation_id: _Optional[str] = ..., header: _Optional[_Union[ResponseHeader, _Mapping]] = ...) -> None: ...

class GetEngineRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class GetEngineResponse(_message.Message):
    __slots__ = ("workers", "directory_incarnation_id", "header")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[_types_pb2.EngineWorker]
    directory_incarnation_id: str
    header: ResponseHeader
    def __init__(self, workers: _Optional[_Iterable[_Union[_types_pb2.EngineWorker, _Mapping]]] = ..., directory_incarnation_id: _Optional[str] = ..., header: _Optional[_Union[ResponseHeader, _Mapping]] = ...) -> None: ...

class ListEnginesRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "role")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    role: _types_pb2.EngineRole
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., role: _Optional[_Union[_types_pb2.EngineRole, str]] = ...) -> None: ...

class ListEnginesResponse(_message.Message):
    __slots__ = ("workers", "next_page_token", "directory_incarnation_id", "header")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[_types_pb2.EngineWorker]
    next_page_token: str
    directory_incarnation_id: str
    header: ResponseHeader
    def __init__(self, workers: _Optional[_Iterable[_Union[_types_pb2.EngineWorker, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., directory_incarnation_id: _Optional[str] = ..., header: _Optional[_Union[ResponseHeader, _Mapping]] = ...) -> None: ...

class ReportEngineUnreachableRequest(_message.Message):
    __slots__ = ("engine_id", "transfer_id", "reason")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    transfer_id: str
    reason: str
    def __init__(self, engine_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ReportEngineUnreachableResponse(_message.Message):
    __slots__ = ("marked", "directory_incarnation_id", "header")
    MARKED_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    marked: bool
    directory_incarnation_id: str
    header: ResponseHeader
    def __init__(self, marked: _Optional[bool] = ..., directory_incarnation_id: _Optional[str] = ..., header: _Optional[_Union[ResponseHeader, _Mapping]] = ...) -> None: ...
