"""Log lines inside a span or naming a transfer carry trace_id, span_id, transfer_id and request_id."""

from __future__ import annotations

import io
import json
import threading

import pytest
import structlog
from opentelemetry.sdk.trace import TracerProvider

from kvpush.observability import logs


@pytest.fixture
def lines(monkeypatch):
    """JSON log lines rendered through kvpush's real processors into a buffer."""
    buffer = io.StringIO()
    structlog.configure(processors=[*logs.shared_processors(), structlog.processors.JSONRenderer()],
                        logger_factory=structlog.PrintLoggerFactory(file=buffer), cache_logger_on_first_use=False)
    yield lambda: [json.loads(line) for line in buffer.getvalue().splitlines()]
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()


def _ids(span) -> tuple[str, str]:
    context = span.get_span_context()
    return f"{context.trace_id:032x}", f"{context.span_id:016x}"


def test_line_inside_a_span_carries_its_ids_and_bound_ids(lines):
    """Inside a span with request and transfer ids bound, a line carries all four."""
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("request") as span, \
            structlog.contextvars.bound_contextvars(request_id="req-1", transfer_id="t-1"):
        logs.get_logger("test").info("inside")
    (line,) = lines()
    assert (line["trace_id"], line["span_id"]) == _ids(span)
    assert (line["request_id"], line["transfer_id"]) == ("req-1", "t-1")


def test_line_naming_a_transfer_elsewhere_takes_the_transfer_span(lines):
    """On another thread, outside any span, a line naming a remembered transfer carries its trace and request."""
    span = TracerProvider().get_tracer("test").start_span("kvpush.push")
    logs.remember_transfer("t-2", "req-2", span)
    thread = threading.Thread(target=lambda: logs.get_logger("test").info("write done", transfer_id="t-2"))
    thread.start()
    thread.join()
    (line,) = lines()
    assert (line["trace_id"], line["span_id"]) == _ids(span)
    assert line["request_id"] == "req-2"


def test_line_without_span_or_transfer_has_no_ids(lines):
    """A line with neither a span nor a transfer gets no invented ids."""
    logs.get_logger("test").info("idle")
    (line,) = lines()
    assert "trace_id" not in line and "request_id" not in line


def test_remembered_transfers_are_bounded():
    """Only the most recent transfers are remembered (memory stays bounded)."""
    for index in range(logs._TRANSFERS_REMEMBERED + 10):
        logs.remember_transfer(f"bound-{index}", "", None)
    assert len(logs._transfers) == logs._TRANSFERS_REMEMBERED
    assert "bound-0" not in logs._transfers
