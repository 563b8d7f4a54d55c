"""A stand-in engine for gateway unit tests: a real aiohttp server on 127.0.0.1 that records every leg.

vLLM engines are too slow to make fail on cue (a 500, a hang, a leg that must wait for its sibling),
so these tests put a scripted HTTP server where an engine would be; the same paths run against real
vLLM engines in tests/integration/localstack. Each instance runs its own event loop thread.

`behaviour(leg)` is called for every POST with the recorded leg and returns (status, body, delay_s);
a `stream: true` request is answered with SSE events: `stream_events` (whole events) or `stream_tokens` (paced by
`token_delay_s`, the first after `first_event_delay_s`) and an optional leading `stream_error`; `done_linger_s` keeps
the stream open that long after its [DONE]; `no_done` leaves the [DONE] out. A body with
`drop_connection` closes the connection without answering (a killed engine), after `delay_s`.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class RecordedLeg:
    """One request an engine received (header names in lower case)."""

    path: str
    headers: dict[str, str]
    body: dict
    arrived_at: float
    stream_ended: bool = False  # a streamed answer was written to its end ([DONE]) without a reset


@dataclass
class StandInEngine:
    """An HTTP server that answers like a vLLM OpenAI server would, as scripted."""

    name: str
    behaviour: Callable[[RecordedLeg], tuple[int, dict, float]] | None = None
    legs: list[RecordedLeg] = field(default_factory=list)
    arrived: threading.Event = field(default_factory=threading.Event)
    tokenized: list[dict] = field(default_factory=list)  # /tokenize request bodies
    tokenize_status: int = 200
    health_delay_s: float = 0.0  # GET /health answers 200 after this long (a frozen engine: longer than any bound)
    health_probes: int = 0
    port: int = 0
    _loop: asyncio.AbstractEventLoop | None = None
    _runner: web.AppRunner | None = None
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Base URL."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> StandInEngine:
        """Serve on a free port from a private loop thread."""
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        async def serve() -> None:
            app = web.Application()
            app.router.add_post("/v1/completions", self._handle)
            app.router.add_post("/v1/chat/completions", self._handle)
            app.router.add_get("/v1/models", self._models)
            app.router.add_post("/tokenize", self._tokenize)
            app.router.add_get("/health", self._health)
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", self.port)  # 0: a free port
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]
            ready.set()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(serve())
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name=f"standin-{self.name}", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("stand-in engine did not start")
        return self

    def stop(self) -> None:
        """Stop serving (bounded)."""
        if self._loop is None:
            return
        future = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        future.result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop = None  # stopping twice is a no-op

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize, with one token per whitespace-separated word (chat: every message's words + 3)."""
        body = await request.json()
        self.tokenized.append(body)
        if self.tokenize_status != 200:
            return web.json_response({"error": {"message": "tokenizer broke"}}, status=self.tokenize_status)
        if "messages" in body:
            count = sum(len(str(m.get("content", "")).split()) + 3 for m in body["messages"])
        else:
            count = len(str(body.get("prompt", "")).split())
        return web.json_response({"count": count, "max_model_len": 4096, "tokens": list(range(count))})

    async def _health(self, request: web.Request) -> web.Response:
        self.health_probes += 1
        if self.health_delay_s:
            await asyncio.sleep(self.health_delay_s)
        return web.Response()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        leg = RecordedLeg(request.path, {k.lower(): v for k, v in request.headers.items()}, await request.json(),
                          time.monotonic())
        self.legs.append(leg)
        self.arrived.set()
        status, body, delay_s = (self.behaviour or default_behaviour)(leg)
        if delay_s:
            await asyncio.sleep(delay_s)
        if body.get("drop_connection"):
            request.transport.close()
            raise ConnectionResetError("stand-in dropped the connection")
        if status == 200 and leg.body.get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            if body.get("first_event_delay_s"):
                await asyncio.sleep(body["first_event_delay_s"])
            if "stream_error" in body:  # vLLM fails a started stream with an error event after a 200
                await response.write(f"data: {json.dumps({'error': body['stream_error']})}\n\n".encode())
            for index, event in enumerate(body.get("stream_events", ())):  # whole events, as vLLM would send them
                if index and body.get("token_delay_s"):
                    await asyncio.sleep(body["token_delay_s"])
                await response.write(f"data: {json.dumps(event)}\n\n".encode())
            for index, token in enumerate(body.get("stream_tokens", ["a", "b"] if "stream_events" not in body else [])):
                if index and body.get("token_delay_s"):
                    await asyncio.sleep(body["token_delay_s"])
                await response.write(f"data: {json.dumps({'choices': [{'index': 0, 'text': token}]})}\n\n".encode())
            if not body.get("no_done"):  # a stream that just stops, as an engine dying between events may
                await response.write(b"data: [DONE]\n\n")
            if body.get("done_linger_s"):  # the stream stays open a while after its last event
                await asyncio.sleep(body["done_linger_s"])
            await response.write_eof()
            leg.stream_ended = True
            return response
        return web.json_response(body, status=status)


def default_behaviour(leg: RecordedLeg) -> tuple[int, dict, float]:
    """200 with one choice echoing the leg's max_tokens and kv_transfer_params."""
    return 200, {"id": "cmpl-standin", "object": "text_completion",
                 "choices": [{"index": 0, "text": f"max_tokens={leg.body.get('max_tokens')}"}],
                 "kv_transfer_params": {"echo": leg.body.get("kv_transfer_params")}}, 0.0
