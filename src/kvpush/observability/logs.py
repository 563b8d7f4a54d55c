"""structlog set-up: JSON lines in production, a console renderer for a person at a TTY.

`KVPUSH_LOG_FORMAT` = `json` | `console` overrides the TTY guess; `KVPUSH_LOG_LEVEL` sets the level.
Context (transfer_id, request_id, engine_id) is bound with `structlog.contextvars.bound_contextvars`; note
that asyncio tasks and threads each see their own context.

Trace-linked lines (`add_trace_context`): a line logged inside a span, or naming a transfer, carries
`trace_id`, `span_id`, `transfer_id` and `request_id`. The current OpenTelemetry span gives the trace and span
ids; a line without one (a callback on another thread, a directory handler) takes them from the transfer it
names, whose span was registered with `remember_transfer` when it started (the directory's transfer span, an
engine's push or receive span). Paste a `trace_id` into Jaeger's search to open the request's trace.

Exceptions (`log.exception`, `exc_info=`) are rendered as their type, message and frames (file, line, function),
never with frame locals or source lines: locals hold prompts, completions and credentials (`render_exception`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback
from collections import OrderedDict

import structlog
from opentelemetry import trace

_configured = False
# transfer id -> (request id, trace id hex, span id hex): the most recent transfers of this process, bounded.
_TRANSFERS_REMEMBERED = 8192
_transfers: OrderedDict[str, tuple[str, str, str]] = OrderedDict()
_transfers_lock = threading.Lock()


def remember_transfer(transfer_id: str, request_id: str, span: trace.Span | None) -> None:
    """Let later log lines naming `transfer_id` carry its request id and its span's trace and span ids."""
    if not transfer_id:
        return
    context = span.get_span_context() if span is not None else None
    ids = ((f"{context.trace_id:032x}", f"{context.span_id:016x}") if context is not None and context.is_valid
           else ("", ""))
    with _transfers_lock:
        _transfers[transfer_id] = (request_id, *ids)
        _transfers.move_to_end(transfer_id)
        while len(_transfers) > _TRANSFERS_REMEMBERED:
            _transfers.popitem(last=False)


def add_trace_context(logger, method_name: str, event_dict: dict) -> dict:
    """structlog processor: fill trace_id, span_id, request_id from the current span and the named transfer."""
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event_dict.setdefault("trace_id", f"{context.trace_id:032x}")
        event_dict.setdefault("span_id", f"{context.span_id:016x}")
    transfer_id = event_dict.get("transfer_id")
    if transfer_id:
        with _transfers_lock:
            known = _transfers.get(transfer_id)
        if known is not None:
            request_id, trace_id, span_id = known
            if request_id:
                event_dict.setdefault("request_id", request_id)
            if trace_id:
                event_dict.setdefault("trace_id", trace_id)
                event_dict.setdefault("span_id", span_id)
    return event_dict


# Bounds of a rendered exception: its message, its frames (the innermost kept), its chain of causes.
_EXCEPTION_MESSAGE_CHARS = 1000
_EXCEPTION_FRAMES = 40
_EXCEPTION_CHAIN = 4


def exception_summary(error: BaseException) -> list[dict]:
    """`error` and the exceptions it was raised from or during, outermost first: each its type, message and frames
    as file, line and function only (no locals, no source text)."""
    chain: list[dict] = []
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen and len(chain) < _EXCEPTION_CHAIN:
        seen.add(id(current))
        frames = traceback.extract_tb(current.__traceback__)[-_EXCEPTION_FRAMES:]
        chain.append({"type": f"{type(current).__module__}.{type(current).__qualname__}",
                      "message": str(current)[:_EXCEPTION_MESSAGE_CHARS],
                      "frames": [{"file": f.filename, "line": f.lineno, "function": f.name} for f in frames]})
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return chain


def _logged_exception(exc_info) -> BaseException | None:
    """The exception an `exc_info` value names (True: the one being handled), else None."""
    if isinstance(exc_info, BaseException):
        return exc_info
    if isinstance(exc_info, tuple):
        return exc_info[1] if len(exc_info) == 3 and isinstance(exc_info[1], BaseException) else None
    return sys.exc_info()[1] if exc_info else None


def render_exception(logger, method_name: str, event_dict: dict) -> dict:
    """structlog processor: `exc_info` becomes `exception`, `exception_summary`'s list (frame locals never appear)."""
    error = _logged_exception(event_dict.pop("exc_info", None))
    if error is not None:
        event_dict["exception"] = exception_summary(error)
    return event_dict


def _exception_text(logger, method_name: str, event_dict: dict) -> dict:
    """structlog processor for the console: `exception` as a short traceback text, innermost frame last."""
    chain = event_dict.get("exception")
    if isinstance(chain, list):
        lines = []
        for error in reversed(chain):
            lines += [f'  File "{f["file"]}", line {f["line"]}, in {f["function"]}' for f in error["frames"]]
            lines.append(f"{error['type']}: {error['message']}")
        event_dict["exception"] = "\n".join(lines)
    return event_dict


def shared_processors() -> list:
    """The processors every kvpush process runs before rendering (contextvars first, then trace ids)."""
    return [
        structlog.contextvars.merge_contextvars,
        add_trace_context,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        render_exception,
    ]


def configure_logging(level: str | None = None, fmt: str | None = None, force: bool = False) -> None:
    """Configure structlog once per process (later calls are no-ops unless force)."""
    global _configured
    if _configured and not force:
        return
    level_name = (level or os.environ.get("KVPUSH_LOG_LEVEL", "INFO")).upper()
    level_no = logging.getLevelNamesMapping().get(level_name, logging.INFO)
    fmt = fmt or os.environ.get("KVPUSH_LOG_FORMAT") or ("console" if sys.stderr.isatty() else "json")
    shared = shared_processors()
    if fmt == "console":
        processors = [*shared, _exception_text, structlog.dev.ConsoleRenderer()]
    else:
        processors = [*shared, structlog.processors.JSONRenderer()]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    _configured = True


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    """Return a structlog logger tagged with the component name."""
    return structlog.get_logger(component=name)
