"""Logging and tracing set-up shared by every kvpush process (directory, gateway, engines)."""

from kvpush.observability.logs import configure_logging, get_logger
from kvpush.observability.tracing import configure_tracing, get_tracer, shutdown_tracing

__all__ = ["configure_logging", "configure_tracing", "get_logger", "get_tracer", "shutdown_tracing"]
