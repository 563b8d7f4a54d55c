"""One OpenTelemetry span per transfer at the directory, plus one log line when it ends.

Life cycle: the span starts when the transfer is planned (parent: the request's W3C traceparent
when the gateway gave one), gets the events `allocation`, `first_readiness`, `instruction`, and
ends when the transfer becomes terminal (`completion` event for COMPLETE, error status
otherwise). With tracing off (no OTEL_* variables) the tracer is a no-op and this costs little.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvpush.directory.state import TransferObserver, TransferRecord
from kvpush.observability import get_logger, get_tracer
from kvpush.observability.logs import remember_transfer
from kvpush.v1 import types_pb2 as tpb

_propagator = TraceContextTextMapPropagator()
log = get_logger("directory.transfers")


class TransferSpans(TransferObserver):
    """A `TransferObserver` that keeps one span open per live transfer."""

    def __init__(self, tracer: trace.Tracer | None = None) -> None:
        self._tracer = tracer or get_tracer("kvpush.directory")
        self._spans: dict[str, Span] = {}

    def on_planned(self, transfer: TransferRecord) -> None:
        """Start the transfer's span under the request's trace context."""
        parent = _propagator.extract({"traceparent": transfer.trace_context}) if transfer.trace_context else None
        span = self._tracer.start_span(
            "kvpush.directory.transfer",
            context=parent,
            kind=trace.SpanKind.INTERNAL,
            attributes={
                "kvpush.transfer_id": transfer.transfer_id,
                "kvpush.request_id": transfer.request_id,
                "kvpush.prefill_engine_id": transfer.prefill_engine_id,
                "kvpush.decode_engine_id": transfer.decode_engine_id,
                "kvpush.tp_size": transfer.tp_size,
            },
        )
        self._spans[transfer.transfer_id] = span
        remember_transfer(transfer.transfer_id, transfer.request_id, span)  # its log lines carry the trace id
        log.debug("transfer planned", transfer_id=transfer.transfer_id,
                  prefill_engine_id=transfer.prefill_engine_id, decode_engine_id=transfer.decode_engine_id)

    def _event(self, transfer: TransferRecord, name: str, **attributes: str | int | float | bool) -> None:
        span = self._spans.get(transfer.transfer_id)
        if span is not None:
            span.add_event(name, attributes=attributes)

    def on_allocated(self, transfer: TransferRecord) -> None:
        """Add the `allocation` event with the block and token counts."""
        allocation = transfer.allocation
        if allocation is None:  # called once decode's blocks are known
            return
        self._event(transfer, "allocation", **{
            "kvpush.decode_block_count": len(allocation.block_ids),
            "kvpush.prompt_token_count": allocation.prompt_token_count,
            "kvpush.prefix_hit_token_count": allocation.skip_token_count,
        })

    def on_first_ready(self, transfer: TransferRecord) -> None:
        """Add the `first_readiness` event."""
        self._event(transfer, "first_readiness")

    def on_dispatched(self, transfer: TransferRecord) -> None:
        """Add the `instruction` event (one instruction per prefill rank went out)."""
        self._event(transfer, "instruction", **{"kvpush.instruction_count": transfer.tp_size})

    def on_ended(self, transfer: TransferRecord) -> None:
        """End the span: `completion` event and OK for COMPLETE, error status otherwise."""
        span = self._spans.pop(transfer.transfer_id, None)
        state = tpb.TransferState.Name(transfer.state)
        fields = dict(transfer_id=transfer.transfer_id, state=state, reason=transfer.failure_reason,
                      bytes_written=transfer.total_bytes_written(),
                      prefill_engine_id=transfer.prefill_engine_id, decode_engine_id=transfer.decode_engine_id)
        # One canonical line per transfer (trace-linked by its transfer id): grep a trace id or transfer id.
        log.info("transfer ended", **fields)
        if span is None:
            return
        span.set_attribute("kvpush.state", state)
        span.set_attribute("kvpush.bytes_written", transfer.total_bytes_written())
        if transfer.state == tpb.TRANSFER_STATE_COMPLETE:
            span.add_event("completion")
            span.set_status(Status(StatusCode.OK))
        else:
            span.set_attribute("kvpush.failure_reason", transfer.failure_reason)
            span.set_status(Status(StatusCode.ERROR, f"{state}: {transfer.failure_reason}"))
        span.end()
