"""Blocking HTTP helpers for the demo, tests and benchmarks: JSON calls and streamed completions with TTFT.

`stream_completion` measures time to first token as the time from sending the request to the first
SSE `data:` event (the first generated token on vLLM's completions stream), on one fresh connection,
with no proxy. Every call has a timeout.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any


@dataclass
class HttpResult:
    """A finished HTTP call: status, headers (lower-case names), parsed JSON body (or None)."""

    status: int
    headers: dict[str, str]
    body: Any
    text: str
    elapsed_s: float


@dataclass
class StreamResult:
    """A streamed completion: TTFT, the concatenated text, the raw events."""

    status: int
    headers: dict[str, str]
    ttft_s: float
    total_s: float
    text: str
    events: list[dict] = field(default_factory=list)
    error: str = ""


def _connection(url: str, timeout_s: float) -> tuple[http.client.HTTPConnection, str]:
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme != "http" or not parsed.hostname:
        raise ValueError(f"only http://host:port URLs are supported, got {url!r}")
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port or 80, timeout=timeout_s)
    path = parsed.path or "/"
    if parsed.query:
        path += "?" + parsed.query
    return conn, path


def call(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None,
         timeout_s: float = 60.0) -> HttpResult:
    """One HTTP request with a JSON body (if any); never raises for an HTTP error status."""
    conn, path = _connection(url, timeout_s)
    payload = json.dumps(body).encode() if body is not None else None
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    started = time.perf_counter()
    try:
        conn.request(method, path, body=payload, headers=all_headers)
        response = conn.getresponse()
        text = response.read().decode(errors="replace")
        elapsed = time.perf_counter() - started
        try:
            parsed: Any = json.loads(text) if text else None
        except ValueError:
            parsed = None
        return HttpResult(response.status, {k.lower(): v for k, v in response.getheaders()}, parsed, text, elapsed)
    finally:
        conn.close()


def stream_completion(url: str, body: dict, headers: dict[str, str] | None = None,
                      timeout_s: float = 300.0) -> StreamResult:
    """POST a streaming completion (stream=True is forced) and time its first event."""
    conn, path = _connection(url, timeout_s)
    payload = json.dumps({**body, "stream": True}).encode()
    all_headers = {"Content-Type": "application/json", "Accept": "text/event-stream", **(headers or {})}
    started = time.perf_counter()
    ttft = 0.0
    texts: list[str] = []
    events: list[dict] = []
    try:
        conn.request("POST", path, body=payload, headers=all_headers)
        response = conn.getresponse()
        response_headers = {k.lower(): v for k, v in response.getheaders()}
        if response.status != 200:
            text = response.read().decode(errors="replace")
            return StreamResult(response.status, response_headers, 0.0, time.perf_counter() - started, "",
                                error=text)
        error = ""
        while True:
            line = response.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            if not ttft:
                ttft = time.perf_counter() - started
            event = json.loads(data)
            events.append(event)
            if "error" in event:
                error = json.dumps(event["error"])
                continue
            for choice in event.get("choices", []):
                texts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
        return StreamResult(200, response_headers, ttft, time.perf_counter() - started, "".join(texts), events, error)
    finally:
        conn.close()
