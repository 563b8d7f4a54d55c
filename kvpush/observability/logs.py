"""structlog set-up: JSON lines in production, a console renderer for a person at a TTY.

`KVPUSH_LOG_FORMAT` = `json` | `console` overrides the TTY guess; `KVPUSH_LOG_LEVEL` sets the level.
Context (transfer_id, engine_id) is bound with `structlog.contextvars.bound_contextvars`; note that
asyncio tasks and threads each see their own context.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

_configured = False


def configure_logging(level: str | None = None, fmt: str | None = None, force: bool = False) -> None:
    """Configure structlog once per process (later calls are no-ops unless force)."""
    global _configured
    if _configured and not force:
        return
    level_name = (level or os.environ.get("KVPUSH_LOG_LEVEL", "INFO")).upper()
    level_no = logging.getLevelNamesMapping().get(level_name, logging.INFO)
    fmt = fmt or os.environ.get("KVPUSH_LOG_FORMAT") or ("console" if sys.stderr.isatty() else "json")
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if fmt == "console":
        renderer: structlog.typing.Processor = structlog.dev.ConsoleRenderer()
        processors = [*shared, renderer]
    else:
        processors = [*shared, structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()]
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
