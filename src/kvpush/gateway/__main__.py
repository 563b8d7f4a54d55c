"""`python -m kvpush.gateway`: run the gateway until SIGINT/SIGTERM, then close cleanly."""

from __future__ import annotations

import sys

from aiohttp import web

from kvpush.gateway.app import create_app
from kvpush.gateway.config import parse_args
from kvpush.observability import configure_logging, configure_tracing, get_logger, shutdown_tracing


def main(argv: list[str] | None = None) -> int:
    """Parse flags, serve, and flush traces on the way out."""
    config = parse_args(argv)
    configure_logging()
    configure_tracing("kvpush-gateway")
    log = get_logger("gateway")
    log.info("gateway starting", host=config.host, port=config.port, mode=config.mode,
             directory=config.directory_address or None)
    loop = None
    if config.uvloop:
        try:
            import uvloop
        except ImportError:
            log.warning("uvloop is not installed; serving on asyncio's event loop")
        else:
            loop = uvloop.new_event_loop()
    try:
        # handler_cancellation: a client that disconnects cancels its legs and its transfer.
        web.run_app(create_app(config), host=config.host, port=config.port, print=None,
                    handler_cancellation=True, shutdown_timeout=10.0, access_log=None, loop=loop,
                    reuse_port=config.reuse_port or None)
    finally:
        shutdown_tracing()
    return 0


if __name__ == "__main__":
    sys.exit(main())
