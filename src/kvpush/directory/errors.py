"""Domain errors of the KV-directory.

`state` raises these; `servicer` maps each class to one gRPC status code through a single table
(`servicer.STATUS_BY_ERROR`). A raised error always means the call changed nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpush.api.shards import ShardRedirect


class DirectoryError(Exception):
    """Base class: a request the directory refuses, with a message fit for the caller.

    `limit`: for a refusal because a configured limit was reached, its name (a metric label, bounded).
    """

    def __init__(self, message: str = "", limit: str = "") -> None:
        super().__init__(message)
        self.limit = limit


class InvalidArgument(DirectoryError):
    """Malformed input: missing field, bad range, over a size cap (INVALID_ARGUMENT)."""


class NotFound(DirectoryError):
    """Unknown engine, rank, lease or transfer (NOT_FOUND)."""


class AlreadyExists(DirectoryError):
    """A live registration with another agent name holds this engine id and rank (ALREADY_EXISTS)."""


class FailedPrecondition(DirectoryError):
    """Valid input the current state refuses: terminal transfer, conflicting allocation (FAILED_PRECONDITION)."""


class PermissionDenied(DirectoryError):
    """The caller is not the party this transfer names (PERMISSION_DENIED)."""


class ResourceExhausted(DirectoryError):
    """A configured cap is reached: transfers per engine, engines, chunks (RESOURCE_EXHAUSTED)."""


class OutOfRange(DirectoryError):
    """A watch resumes from a sequence number the directory no longer retains (OUT_OF_RANGE)."""


class Unavailable(DirectoryError):
    """A replica cannot serve the call now: etcd unreachable, no shard to mint in (UNAVAILABLE: retry, elsewhere)."""


class ShardMoved(DirectoryError):
    """The transfer's shard is another replica's, or between owners (FAILED_PRECONDITION / UNAVAILABLE with
    a google.rpc.ErrorInfo naming the owner: `kvpush.api.shards.ShardRedirect`)."""

    def __init__(self, message: str, redirect: ShardRedirect) -> None:
        super().__init__(message)
        self.redirect = redirect
