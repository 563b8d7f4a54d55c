"""One OpenTelemetry span per transfer on each engine: "kvpush.push" on prefill, "kvpush.receive" on decode.

Life cycle: `TransferSpan.start(name, transfer_id, traceparent, attributes)` opens the span as a child
of the request's W3C trace context (a new trace when there is none); `event()` adds timestamped events
(prefill: one per layer write); `end(ok, reason)` sets the status and closes it. Spans are exported by
whatever `kvpush.observability.configure_tracing` installed (OTLP when OTEL_* is set), in batches from
a background thread, so no caller waits on the collector. Every method is safe to call after `end`.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import Attributes, AttributeValue

from kvpush.observability import configure_tracing, get_tracer
from kvpush.observability.logs import remember_transfer

_PROPAGATOR = TraceContextTextMapPropagator()


def configure_engine_tracing(role: str) -> None:
    """Install the OTLP exporter in this engine process if the environment asks for it (idempotent)."""
    configure_tracing(f"kvpush-{role}-engine")


class TransferSpan:
    """A transfer's span on one engine (see the module docstring)."""

    def __init__(self, span: trace.Span) -> None:
        self._span = span
        self._ended = False

    @classmethod
    def start(cls, name: str, transfer_id: str, traceparent: str = "", attributes: Attributes | None = None,
              start_time_s: float | None = None) -> TransferSpan:
        """Open the span under the request's trace context."""
        context = _PROPAGATOR.extract({"traceparent": traceparent}) if traceparent else None
        span = get_tracer("kvpush.connector").start_span(
            name, context=context, kind=trace.SpanKind.INTERNAL,
            attributes={"kvpush.transfer_id": transfer_id, **(attributes or {})},
            start_time=int(start_time_s * 1e9) if start_time_s is not None else None)
        # Log lines naming this transfer (even after the span ended) carry its trace and span ids.
        remember_transfer(transfer_id, str((attributes or {}).get("kvpush.request_id", "")), span)
        return cls(span)

    def traceparent(self) -> str:
        """This span's W3C traceparent ('' when tracing is off), for work done on its behalf elsewhere."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(self._span))
        return carrier.get("traceparent", "")

    def event(self, name: str, attributes: Attributes | None = None, time_s: float | None = None) -> None:
        """Add a timestamped event."""
        if not self._ended:
            self._span.add_event(name, attributes=attributes or {},
                                 timestamp=int(time_s * 1e9) if time_s is not None else None)

    def set_attributes(self, attributes: Mapping[str, AttributeValue | None]) -> None:
        """Set attributes (None values are skipped)."""
        if not self._ended:
            self._span.set_attributes({k: v for k, v in attributes.items() if v is not None})

    def end(self, ok: bool, reason: str = "") -> None:
        """Set the status and close the span (once)."""
        if self._ended:
            return
        self._ended = True
        self._span.set_status(Status(StatusCode.OK) if ok else Status(StatusCode.ERROR, reason or "failed"))
        self._span.end()
