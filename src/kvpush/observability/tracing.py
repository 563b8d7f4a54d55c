"""OpenTelemetry set-up: OTLP export configured by the standard OTEL_* variables, off when unset.

Export is on when `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set and
`OTEL_SDK_DISABLED` is not "true". The OTLP gRPC exporter reads its own variables (endpoint,
headers, insecure, certificates); `OTEL_SERVICE_NAME` names the service. Spans are exported in
batches from a background thread, so no caller waits on the collector.
"""

from __future__ import annotations

import os
import threading

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

_lock = threading.Lock()
_provider: TracerProvider | None = None


def tracing_enabled_by_env() -> bool:
    """True when the OTEL_* variables ask for export."""
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def configure_tracing(service_name: str) -> TracerProvider | None:
    """Install an OTLP-exporting tracer provider for this process if the environment asks for one.

    Returns the provider, or None when export is off (spans are then no-ops). Idempotent.
    """
    global _provider
    with _lock:
        if _provider is not None:
            return _provider
        if not tracing_enabled_by_env():
            return None
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        name = os.environ.get("OTEL_SERVICE_NAME", service_name)
        provider = TracerProvider(resource=Resource.create({"service.name": name}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(), schedule_delay_millis=500))
        trace.set_tracer_provider(provider)
        _provider = provider
        return provider


def get_tracer(name: str) -> trace.Tracer:
    """Return a tracer from the installed provider (a no-op tracer when export is off)."""
    return trace.get_tracer(name)


def shutdown_tracing(timeout_millis: int = 5000) -> None:
    """Flush and stop the exporter; call before the process exits."""
    global _provider
    with _lock:
        if _provider is not None:
            _provider.force_flush(timeout_millis)
            _provider.shutdown()
            _provider = None
