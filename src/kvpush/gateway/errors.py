"""Gateway errors: one exception type carrying the HTTP status and an OpenAI-shaped error body.

Client mistakes are 4xx with a message that names the field; backend failures are 502 (a backend
answered badly), 503 (no backend reachable or none registered), 504 (a bound was exceeded).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Control characters (C0, DEL, C1): the directory refuses free text that holds any (a newline of an engine's message).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
# What the gateway sends the directory as a reason: short enough for any directory's bound (1,024 characters).
DIRECTORY_REASON_CHARS = 500


@dataclass
class GatewayError(Exception):
    """An error that ends a request with `status` and an OpenAI-compatible JSON error body."""

    status: int
    message: str
    error_type: str = "invalid_request_error"
    param: str | None = None
    # Response headers known when the error happened (X-Request-Id, X-KVPush-Transfer-Id).
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"HTTP {self.status}: {self.message}"

    def body(self) -> dict:
        """The response body: {"error": {"message", "type", "param", "code"}} as OpenAI sends it."""
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.status}}


@dataclass
class EngineUnreachable(GatewayError):
    """503: the `leg`'s engine at `url` could not be reached: connection refused, reset or closed before any
    response byte. Nothing reached that engine's model, so the request may be planned again elsewhere."""

    leg: str = ""
    url: str = ""


@dataclass
class EngineUnresponsive(EngineUnreachable):
    """504: the `leg`'s engine took the connection but sent no response headers within the leg's first-byte bound
    (a frozen or hung engine). Nothing reached the client, so the request is planned again as for an unreachable
    engine."""


@dataclass
class LegTimeout(GatewayError):
    """504: the `leg`'s engine did not answer within its bound."""

    leg: str = ""


def bad_request(message: str, param: str | None = None) -> GatewayError:
    """400 for malformed client input."""
    return GatewayError(400, message, "invalid_request_error", param)


def bad_gateway(message: str) -> GatewayError:
    """502: a backend (engine or directory) answered with an error or garbage."""
    return GatewayError(502, message, "bad_gateway")


def unavailable(message: str) -> GatewayError:
    """503: no backend could take the request now (unreachable, none registered, at capacity)."""
    return GatewayError(503, message, "service_unavailable")


def timeout(message: str) -> GatewayError:
    """504: a backend did not answer within its bound."""
    return GatewayError(504, message, "gateway_timeout")


def directory_reason(text: str) -> str:
    """`text` as a reason the directory takes (CancelTransfer, ReportEngineUnreachable): control characters and runs
    of white space as one space, at most DIRECTORY_REASON_CHARS characters."""
    return " ".join(_CONTROL.sub(" ", text).split())[:DIRECTORY_REASON_CHARS]
