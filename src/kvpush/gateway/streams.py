"""The client's side of a streamed answer: writes that survive a client going away, and a watch over passed events.

A client may close its connection at any time. Before the last byte that is a disconnect (499: the legs stop and the
transfer is cancelled if its KV has not landed); after the last byte (its [DONE]) it is a normal end, so closing the
stream (`end`) ignores it. aiohttp reports either as ConnectionResetError ("Cannot write to closing transport").
"""

from __future__ import annotations

import orjson
from aiohttp import web


class ClientGone(Exception):
    """The client closed its connection before its stream ended; `response` is the stream already begun."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("client disconnected")
        self.response = response


async def open_client(out: web.StreamResponse, http_request: web.Request) -> None:
    """Send the stream's headers."""
    try:
        await out.prepare(http_request)
    except ConnectionResetError as error:
        raise ClientGone(out) from error


async def send(out: web.StreamResponse, data: bytes) -> None:
    """Write `data` to the client; ClientGone when it has closed its connection."""
    try:
        await out.write(data)
    except ConnectionResetError as error:
        raise ClientGone(out) from error


async def end(out: web.StreamResponse) -> None:
    """End the stream. Everything was written: a client that closed first (having read its [DONE]) is no failure."""
    try:
        await out.write_eof()
    except ConnectionResetError:
        pass


def error_event(message: str, code: int, error_type: str = "bad_gateway") -> bytes:
    """An OpenAI-style SSE error event (the way to fail a stream after its headers; no [DONE] follows it)."""
    return b"data: " + orjson.dumps({"error": {"message": message[:500], "type": error_type, "code": code}}) + b"\n\n"


def event_error_status(error: object) -> int:
    """The status of a stream an engine's error event broke: its `code` when a 4xx (the client's fault), else 502."""
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, int) and 400 <= code < 500 else 502


def event_token_count(event: dict) -> int:
    """Tokens an event carries: its choices' token ids when it has them, else one per choice with text."""
    count = 0
    for choice in event.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            count += len(ids)
            continue
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if text:
            count += 1
    return count


# `StreamWatch._parse`'s answer for the [DONE] event.
_DONE: dict = {}


class StreamWatch:
    """Reads an engine's SSE stream as it is passed to the client, unchanged, and says what it carried.

    `feed(chunk)` returns the bytes to send on: the chunk, cut after an error event (what the engine sends after
    one, its [DONE], must not follow it). `token_count` of the last feed, the first `error` seen and whether the
    stream's [DONE] passed (`done`) are kept.
    Events may span chunks.
    """

    def __init__(self) -> None:
        self._partial = b""
        self.error: object | None = None  # the first error event's `error` value
        self.token_count = 0  # tokens in the events the last `feed` completed
        self.done = False

    def feed(self, chunk: bytes) -> bytes:
        """The part of `chunk` to send on (empty once an error event went out)."""
        if self.error is not None:
            return b""
        self.token_count = 0
        carried = len(self._partial)  # bytes of `data` sent with an earlier chunk
        data = self._partial + chunk
        start = 0
        while True:
            cut = data.find(b"\n\n", start)
            if cut < 0:
                break
            event = self._parse(data[start:cut])
            start = cut + 2
            if event is None:
                continue
            if event is _DONE:
                self.done = True
                continue
            if "error" in event:
                self.error = event["error"]
                self._partial = b""
                return chunk[:max(0, start - carried)]
            self.token_count += event_token_count(event)
        self._partial = data[start:]
        return chunk

    @staticmethod
    def _parse(raw: bytes) -> dict | None:
        for line in raw.split(b"\n"):
            line = line.strip()
            if line.startswith(b"data:"):
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    return _DONE
                try:
                    event = orjson.loads(payload)
                except ValueError:
                    return None
                return event if isinstance(event, dict) else None
        return None
