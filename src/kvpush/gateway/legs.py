"""HTTP legs to the engines: one POST each, bounded, with backend errors mapped to gateway errors.

Mapping (the leg name is always in the message):
- cannot connect, or the connection
  reset/closed before any response  -> 503 EngineUnreachable (the dispatcher may plan the request again)
- no complete answer within bound   -> 504 (also while reading a streamed answer's first chunk)
- a streamed leg's headers not within
  its first-byte bound              -> 504 EngineUnresponsive (a frozen engine: planned again like unreachable)
- a non-streamed leg's answer not
  within its first-byte bound and
  the engine's /health silent for
  that long again                   -> 504 EngineUnresponsive (the same: vLLM sends a non-streamed answer's headers
                                       with its body, so only a probe tells a frozen engine from a slow one)
- engine 4xx (bad input)            -> the same 4xx with the engine's message (the client's fault)
- engine 5xx or a non-JSON 200      -> 502
Cancelling a leg's task closes its connection, which makes vLLM abort the request.

JSON goes through orjson on this path: on the H200 host the standard library's encoder and decoder took ~2 ms of an
8,192-token prompt's time to first token (the leg's body, prefill's token event), orjson a fraction of it
(docs/performance-log.md, 2026-12-04).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

from kvpush.gateway.errors import EngineUnreachable, EngineUnresponsive, GatewayError, LegTimeout, bad_gateway

if TYPE_CHECKING:
    from kvpush.gateway.in_process import InProcessSession

    # Where a leg is sent: over HTTP, or into the hosting API server's own app (in_process.py).
    LegSession = aiohttp.ClientSession | InProcessSession

# The engine's liveness endpoint (vLLM's OpenAI server answers it from its own event loop, while a request computes).
HEALTH_PATH = "/health"


def _engine_message(text: str) -> str:
    """The message of a vLLM / OpenAI error body, else the start of the raw text."""
    try:
        body = json.loads(text)
    except ValueError:
        return text[:500]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:1000]
        if body.get("message"):
            return str(body["message"])[:1000]
    return text[:500]


def _status_error(leg: str, url: str, status: int, text: str) -> GatewayError:
    message = _engine_message(text)
    if 400 <= status < 500:
        return GatewayError(status, f"{leg} engine refused the request: {message}", "invalid_request_error")
    return bad_gateway(f"{leg} engine at {url} failed with HTTP {status}: {message}")


def _unreachable(leg: str, url: str, why: object) -> EngineUnreachable:
    return EngineUnreachable(503, f"{leg} engine at {url} is unreachable: {why}", "service_unavailable",
                             leg=leg, url=url)


@contextlib.contextmanager
def transport_errors(leg: str, url: str, total_s: float, *, before_response: bool = False):
    """Map aiohttp's connection and timeout failures towards `leg`'s engine ("prefill", "decode", "tokenize")
    to the gateway's 503 / 504 / 502 errors. `before_response`: no response byte came yet, so a connection
    refused, reset or closed is the engine being unreachable (EngineUnreachable)."""
    try:
        yield
    except aiohttp.ClientConnectorError as error:
        raise _unreachable(leg, url, error.os_error or error) from error
    except TimeoutError as error:  # aiohttp's ServerTimeoutError too (it is a TimeoutError)
        raise LegTimeout(504, f"{leg} engine at {url} did not answer within {total_s:.0f} s", "gateway_timeout",
                         leg=leg) from error
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as error:
        if before_response:
            raise _unreachable(leg, url, f"connection lost before any response: {error!r}") from error
        raise bad_gateway(f"{leg} engine at {url}: connection failed: {error!r}") from error
    except aiohttp.ClientError as error:
        raise bad_gateway(f"{leg} engine at {url}: connection failed: {error!r}") from error


def _post(session: LegSession, url: str, body: dict, headers: dict[str, str],
          timeout: aiohttp.ClientTimeout):
    """`session.post` with `body` encoded as JSON (by orjson; aiohttp's `json=` would use the standard library's)."""
    return session.post(url, data=orjson.dumps(body), headers={**headers, "Content-Type": "application/json"},
                        timeout=timeout)


async def post_json(session: LegSession, leg: str, url: str, body: dict, headers: dict[str, str],
                    total_s: float, connect_s: float, first_byte_s: float = 0.0,
                    health_url: str = "") -> dict[str, Any]:
    """POST `body` and return the JSON object answered with 200; raise a GatewayError otherwise.

    `first_byte_s` with `health_url` (0 or "": none): each time the answer has not come for `first_byte_s`, the
    engine's health endpoint is asked; one that does not answer within `first_byte_s` either is frozen or hung, so
    the leg is given up (its connection closed) as EngineUnresponsive. An engine that answers it is slow, and waited
    for up to `total_s`.
    """
    if not first_byte_s or not health_url:
        return await _post_json(session, leg, url, body, headers, total_s, connect_s)
    answer = asyncio.ensure_future(_post_json(session, leg, url, body, headers, total_s, connect_s))
    try:
        while True:
            done, _ = await asyncio.wait({answer}, timeout=first_byte_s)
            if done:
                return answer.result()
            # A health URL is given only for an engine reached over HTTP (an in-process leg has none).
            if isinstance(session, aiohttp.ClientSession) and not await _answers_health(session, health_url,
                                                                                         first_byte_s):
                raise EngineUnresponsive(
                    504, f"{leg} engine at {url} sent no answer within {first_byte_s:g} s and its health endpoint "
                    f"none within {first_byte_s:g} s more", "gateway_timeout", leg=leg, url=url)
    finally:
        if not answer.done():
            answer.cancel()
            await asyncio.gather(answer, return_exceptions=True)


async def _answers_health(session: aiohttp.ClientSession, url: str, bound_s: float) -> bool:
    """True when the engine at `url` answers at all (any status: its server runs) within `bound_s`."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=bound_s)) as response:
            await response.read()
    except (aiohttp.ClientError, TimeoutError):
        return False
    return True


async def _post_json(session: LegSession, leg: str, url: str, body: dict, headers: dict[str, str],
                     total_s: float, connect_s: float) -> dict[str, Any]:
    client_timeout = aiohttp.ClientTimeout(total=total_s, connect=connect_s)
    with transport_errors(leg, url, total_s, before_response=True):
        response = await _post(session, url, body, headers, client_timeout)
    try:
        with transport_errors(leg, url, total_s):
            text = await response.text()
    finally:
        response.release()
    if response.status != 200:
        raise _status_error(leg, url, response.status, text)
    try:
        parsed = orjson.loads(text)
    except ValueError as error:
        raise bad_gateway(f"{leg} engine at {url} answered 200 with non-JSON: {text[:200]!r}") from error
    if not isinstance(parsed, dict):
        raise bad_gateway(f"{leg} engine at {url} answered 200 with a non-object JSON body")
    return parsed


async def open_stream(session: LegSession, leg: str, url: str, body: dict, headers: dict[str, str],
                      total_s: float, connect_s: float, first_byte_s: float = 0.0) -> aiohttp.ClientResponse:
    """POST a streaming request; return the open 200 response (the caller must release it). `first_byte_s` (0: none):
    the response headers' bound, past which the leg is given up (its connection closed) as EngineUnresponsive."""
    client_timeout = aiohttp.ClientTimeout(total=total_s, connect=connect_s)
    try:
        async with asyncio.timeout(first_byte_s or None):
            with transport_errors(leg, url, total_s, before_response=True):
                response = await _post(session, url, body, headers, client_timeout)
    except TimeoutError as error:  # only the bound's: transport_errors turns aiohttp's own timeouts into LegTimeout
        raise EngineUnresponsive(504, f"{leg} engine at {url} sent no response headers within {first_byte_s:g} s",
                                 "gateway_timeout", leg=leg, url=url) from error
    if response.status != 200:
        try:
            with transport_errors(leg, url, total_s):
                text = await response.text()
        finally:
            response.release()
        raise _status_error(leg, url, response.status, text)
    return response


# vLLM's `prompt_token_ids` array in a streamed event (integers only, so no "]" inside).
_PROMPT_TOKEN_IDS = re.compile(rb'"prompt_token_ids":\s*\[[^\]]*\]')


def without_prompt_token_ids(data: bytes) -> bytes:
    """An event's JSON with its `prompt_token_ids` arrays (the choice's, or chat's on the event) made null, in bytes:
    much cheaper than decoding a long prompt's ids only to drop them."""
    return _PROMPT_TOKEN_IDS.sub(b'"prompt_token_ids":null', data)


async def sse_events(response: aiohttp.ClientResponse, leg: str, url: str, total_s: float, *,
                     drop_prompt_token_ids: bool = False):
    """Yield each `data:` event of an open SSE response, parsed, until `[DONE]` or the end of the stream.

    An error event (vLLM streams `{"error": {...}}` after its 200 headers) raises its GatewayError: a 4xx
    code is the client's fault and keeps its status, anything else is 502. A non-JSON event is 502.
    The response's own timeout bounds the reads. `drop_prompt_token_ids`: an event's `prompt_token_ids` array is
    cut from its bytes before parsing (it reads as null): the first token's event of a leg that asked for token ids
    carries the whole prompt's, which the caller does not need.
    """
    with transport_errors(leg, url, total_s):
        while True:
            line = await response.content.readline()
            if not line:
                return
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            if drop_prompt_token_ids:
                data = without_prompt_token_ids(data)
            try:
                event = orjson.loads(data)
            except ValueError as error:
                raise bad_gateway(f"{leg} engine at {url} streamed a non-JSON event: {data[:200]!r}") from error
            if not isinstance(event, dict):
                raise bad_gateway(f"{leg} engine at {url} streamed a non-object event")
            reported = event.get("error")
            if reported is not None:
                code = reported.get("code") if isinstance(reported, dict) else None
                status = code if isinstance(code, int) and 400 <= code < 600 else 500
                raise _status_error(leg, url, status, json.dumps(event))
            yield event


async def get_json(session: aiohttp.ClientSession, url: str, total_s: float) -> tuple[int, Any]:
    """GET a JSON document; (status, body). Connection problems raise GatewayError (503/504)."""
    with transport_errors("decode", url, total_s):
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=total_s)) as response:
            text = await response.text()
    try:
        return response.status, json.loads(text)
    except ValueError:
        return response.status, {"error": {"message": text[:500]}}
