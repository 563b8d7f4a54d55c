"""A hosted gateway's prefill legs to its own engine, as ASGI calls into vLLM's app instead of HTTP over loopback.

`InProcessSession.post` looks to the leg code (`legs.post_json`, `legs.open_stream`, `legs.sse_events`) like aiohttp's
`session.post`: it returns once the app has started its response (status and headers), and the response reads the
body as the app sends it. What it saves is the gateway's HTTP client and vLLM's HTTP server parse of each leg, both
on the one event loop they share (docs/gateway.md, hosted).

What HTTP gave the legs, kept here:
- bounds: the leg's total (`aiohttp.ClientTimeout.total`) covers the wait for the response start and every read;
  past it a read raises asyncio.TimeoutError, which `legs.transport_errors` maps to 504;
- abort: closing or releasing a response before its end, or cancelling the call, sends the app `http.disconnect`
  (what a closed connection sends), so vLLM aborts the request and frees its blocks;
- failures: an app that raises is a broken answer (502), never an unreachable engine: the engine runs in this very
  process, so reporting it to the directory and planning the request elsewhere would not help.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from urllib.parse import urlsplit

import aiohttp

from kvpush.gateway.errors import bad_gateway
from kvpush.observability import get_logger

_log = get_logger("gateway.in_process")


class _Body:
    """The response body as the app sends it; `readline` and `read` as aiohttp's StreamReader has them."""

    def __init__(self, deadline: float) -> None:
        self._deadline = deadline
        self._buffer = bytearray()
        self._ended = False
        self._error: BaseException | None = None
        self._more = asyncio.Event()

    def feed(self, chunk: bytes, more: bool) -> None:
        self._buffer += chunk
        self._ended = self._ended or not more
        self._more.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._more.set()

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError()
        self._more.clear()
        await asyncio.wait_for(self._more.wait(), remaining)

    async def readline(self) -> bytes:
        """The next line with its b"\\n" (the rest without one at the end); b"" once the body ended."""
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0 or self._ended:
                cut = end + 1 if end >= 0 else len(self._buffer)
                line = bytes(self._buffer[:cut])
                del self._buffer[:cut]
                return line
            await self._wait()

    async def read(self) -> bytes:
        """The whole rest of the body."""
        while not self._ended:
            await self._wait()
        data = bytes(self._buffer)
        self._buffer.clear()
        return data

    @property
    def ended(self) -> bool:
        return self._ended and not self._buffer


class InProcessResponse:
    """One in-process leg's response: `status`, `content`, `text()`, `release()`, `close()`."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.status = 0
        self.content = _Body(deadline)
        self.started = asyncio.get_running_loop().create_future()
        self.disconnected = asyncio.Event()

    async def text(self) -> str:
        """The whole body, decoded."""
        return (await self.content.read()).decode("utf-8", errors="replace")

    def release(self) -> None:
        """Done with the response: a body not read to its end is abandoned as `close` does."""
        if not self.content.ended:
            self.close()

    def close(self) -> None:
        """Abandon the response: the app gets `http.disconnect` (vLLM aborts the request)."""
        self.disconnected.set()


class InProcessSession:
    """Legs posted into `app` (vLLM's ASGI app below the hosting middleware) as aiohttp's `session.post` would send
    them; `lifespan_scope`: the lifespan's ASGI scope, whose `app` and `state` every leg's scope gets."""

    def __init__(self, app, lifespan_scope: dict | None = None) -> None:
        self._app = app
        # What the server and the outer app put in every scope, taken from the lifespan's: Starlette's `app` (vLLM's
        # handlers read request.app) and the lifespan state (uvicorn gives each request a copy).
        self._lifespan_scope = lifespan_scope or {}
        self._calls: set[asyncio.Task] = set()

    def post(self, url: str, *, data: bytes, headers: dict[str, str], timeout: aiohttp.ClientTimeout):
        """An awaitable of the started response (the leg code's `await session.post(...)`; `data`: the JSON body)."""
        return self._call(url, data, headers, timeout)

    async def _call(self, url: str, payload: bytes, headers: dict[str, str],
                    timeout: aiohttp.ClientTimeout) -> InProcessResponse:
        parts = urlsplit(url)
        response = InProcessResponse(time.monotonic() + (timeout.total or 600.0))
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": parts.path, "raw_path": parts.path.encode(),
            "query_string": parts.query.encode(), "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                        *((k.lower().encode(), v.encode()) for k, v in headers.items()
                          if k.lower() not in ("content-type", "content-length", "host"))],
            "client": ("127.0.0.1", 0), "server": (parts.hostname or "127.0.0.1", parts.port or 80),
        }
        if "app" in self._lifespan_scope:
            scope["app"] = self._lifespan_scope["app"]
        if "state" in self._lifespan_scope:
            scope["state"] = dict(self._lifespan_scope["state"])
        body_sent = False

        async def receive() -> dict:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": payload, "more_body": False}
            await response.disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                response.status = message["status"]
                if not response.started.done():
                    response.started.set_result(None)
            elif message["type"] == "http.response.body":
                response.content.feed(message.get("body", b""), message.get("more_body", False))

        async def run() -> None:
            try:
                await self._app(scope, receive, send)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                _log.warning("in-process leg failed in the app", url=url, error=repr(error))
                if not response.started.done():
                    response.started.set_exception(bad_gateway(f"prefill engine (in process) failed before "
                                                               f"answering: {error!r}"))
                else:
                    response.content.fail(bad_gateway(f"prefill engine (in process) failed while answering: "
                                                      f"{error!r}"))
                return
            if not response.started.done():
                response.started.set_exception(bad_gateway("prefill engine (in process) answered nothing"))
            elif not response.content.ended:
                response.content.feed(b"", False)

        task = asyncio.create_task(run())
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)
        try:
            await asyncio.wait_for(asyncio.shield(response.started), max(0.0, response.deadline - time.monotonic()))
        except BaseException:
            response.close()  # cancelled or timed out before the response started: the app aborts the request
            raise
        return response

    async def close_calls(self, timeout_s: float = 5.0) -> None:
        """At shutdown: disconnect nothing, but wait (bounded) for the calls still running to end."""
        if self._calls:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*self._calls, return_exceptions=True), timeout_s)


__all__ = ["InProcessResponse", "InProcessSession"]
