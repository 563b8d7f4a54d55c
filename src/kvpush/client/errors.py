"""The one exception type directory clients raise for a refused or failed call."""

from __future__ import annotations

import grpc


class DirectoryCallError(Exception):
    """A directory call ended with a non-OK status (after any retries).

    `code` is the grpc.StatusCode, `details` the server's message, `method` the RPC name.
    """

    def __init__(self, method: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{method}: {code.name}: {details}")
        self.method = method
        self.code = code
        self.details = details

    @classmethod
    def from_rpc_error(cls, method: str, error: grpc.RpcError) -> DirectoryCallError:
        """Wrap a grpc error."""
        return cls(method, error.code(), error.details() or "")
