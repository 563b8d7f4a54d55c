"""Transfer shards: which shard a transfer id falls in, and how a replica names a shard's owner.

Shared by the directory replicas (which answer with a redirect) and the client library (which follows it), so
the client imports nothing of the directory: no etcd, no gRPC server in here.

- `shard_of(transfer_id, shard_count)`: a stable hash (CRC-32 of the id) modulo the shard count;
  every replica and client computes the same shard for the same id.
- A replica asked about a transfer of a shard it does not own answers FAILED_PRECONDITION carrying a
  `google.rpc.ErrorInfo` (reason `SHARD_NOT_OWNED`, domain `kvpush.dev`, metadata `shard`,
  `shard_count`, `owner_replica_id`, `owner_address`) in the standard `grpc-status-details-bin`
  trailer; UNAVAILABLE with reason `SHARD_HAS_NO_OWNER` while the shard is between owners.
  `not_owner_trailer()` builds it, `shard_redirect()` reads it from a client's error.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

ERROR_DOMAIN = "kvpush.dev"
SHARD_NOT_OWNED = "SHARD_NOT_OWNED"
SHARD_HAS_NO_OWNER = "SHARD_HAS_NO_OWNER"
STATUS_DETAILS_KEY = "grpc-status-details-bin"


def shard_of(transfer_id: str, shard_count: int) -> int:
    """The shard of a transfer id, in [0, shard_count)."""
    return zlib.crc32(transfer_id.encode()) % shard_count


@dataclass(frozen=True)
class ShardRedirect:
    """What a replica said about a shard it does not own: who does (owner empty: nobody right now)."""

    reason: str
    shard: int
    shard_count: int
    owner_replica_id: str
    owner_address: str


def status_trailer(code: grpc.StatusCode, message: str, redirect: ShardRedirect) -> tuple[tuple[str, bytes], ...]:
    """The `grpc-status-details-bin` trailer of a google.rpc.Status carrying the redirect's ErrorInfo."""
    info = error_details_pb2.ErrorInfo(reason=redirect.reason, domain=ERROR_DOMAIN, metadata={
        "shard": str(redirect.shard), "shard_count": str(redirect.shard_count),
        "owner_replica_id": redirect.owner_replica_id, "owner_address": redirect.owner_address})
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(code=code.value[0], message=message, details=[detail])
    return ((STATUS_DETAILS_KEY, status.SerializeToString()),)


def redirect_of_status(status: status_pb2.Status) -> ShardRedirect | None:
    """The shard redirect inside a google.rpc.Status, if it carries one."""
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR) and detail.Unpack(info) \
                and info.domain == ERROR_DOMAIN and info.reason in (SHARD_NOT_OWNED, SHARD_HAS_NO_OWNER):
            meta = info.metadata
            try:
                return ShardRedirect(info.reason, int(meta.get("shard", "0")), int(meta.get("shard_count", "0")),
                                     meta.get("owner_replica_id", ""), meta.get("owner_address", ""))
            except ValueError:
                return None
    return None


def shard_redirect(error: grpc.aio.AioRpcError) -> ShardRedirect | None:
    """The shard redirect a replica attached to a refused call, if any."""
    for key, value in error.trailing_metadata() or ():
        if key == STATUS_DETAILS_KEY:
            status = status_pb2.Status()
            try:
                status.ParseFromString(value)
            except Exception:  # a malformed trailer is no redirect
                return None
            return redirect_of_status(status)
    return None
