"""HTTP legs to the engines: one POST each, bounded, with backend errors mapped to gateway errors.

Mapping (the leg name is always in the message):
- cannot connect                    -> 503
- no complete answer within bound   -> 504
- engine 4xx (bad input)            -> the same 4xx with the engine's message (the client's fault)
- engine 5xx or a non-JSON 200      -> 502
Cancelling a leg's task closes its connection, which makes vLLM abort the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import aiohttp

from kvpush.services.gateway.errors import GatewayError, bad_gateway, timeout, unavailable


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


@contextlib.contextmanager
def _transport_errors(engine: str, url: str, total_s: float):
    """Map aiohttp's connection and timeout failures towards `engine` ("prefill engine", "engine", ...)
    to the gateway's 503 / 504 / 502 errors."""
    try:
        yield
    except aiohttp.ClientConnectorError as error:
        raise unavailable(f"{engine} at {url} is unreachable: {error.os_error or error}") from error
    except asyncio.TimeoutError as error:
        raise timeout(f"{engine} at {url} did not answer within {total_s:.0f} s") from error
    except aiohttp.ClientError as error:
        raise bad_gateway(f"{engine} at {url}: connection failed: {error!r}") from error


async def post_json(session: aiohttp.ClientSession, leg: str, url: str, body: dict, headers: dict[str, str],
                    total_s: float, connect_s: float) -> dict[str, Any]:
    """POST `body` and return the JSON object answered with 200; raise a GatewayError otherwise."""
    client_timeout = aiohttp.ClientTimeout(total=total_s, connect=connect_s)
    with _transport_errors(f"{leg} engine", url, total_s):
        async with session.post(url, json=body, headers=headers, timeout=client_timeout) as response:
            text = await response.text()
            if response.status != 200:
                raise _status_error(leg, url, response.status, text)
    try:
        parsed = json.loads(text)
    except ValueError as error:
        raise bad_gateway(f"{leg} engine at {url} answered 200 with non-JSON: {text[:200]!r}") from error
    if not isinstance(parsed, dict):
        raise bad_gateway(f"{leg} engine at {url} answered 200 with a non-object JSON body")
    return parsed


async def open_stream(session: aiohttp.ClientSession, leg: str, url: str, body: dict, headers: dict[str, str],
                      total_s: float, connect_s: float) -> aiohttp.ClientResponse:
    """POST a streaming request; return the open 200 response (the caller must release it)."""
    client_timeout = aiohttp.ClientTimeout(total=total_s, connect=connect_s)
    with _transport_errors(f"{leg} engine", url, total_s):
        response = await session.post(url, json=body, headers=headers, timeout=client_timeout)
    if response.status != 200:
        try:
            text = await response.text()
        finally:
            response.release()
        raise _status_error(leg, url, response.status, text)
    return response


async def get_json(session: aiohttp.ClientSession, url: str, total_s: float) -> tuple[int, Any]:
    """GET a JSON document; (status, body). Connection problems raise GatewayError (503/504)."""
    with _transport_errors("engine", url, total_s):
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=total_s)) as response:
            text = await response.text()
    try:
        return response.status, json.loads(text)
    except ValueError:
        return response.status, {"error": {"message": text[:500]}}
