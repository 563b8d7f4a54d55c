"""The gateway's optional API key (OpenAI style) on a real aiohttp server."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp.test_utils import TestServer

from kvpush.gateway.app import create_app
from kvpush.gateway.config import GatewayConfig, parse_args


async def _statuses(config: GatewayConfig, requests) -> list[tuple[int, dict | None]]:
    server = TestServer(create_app(config))
    await server.start_server()
    try:
        out = []
        async with aiohttp.ClientSession() as session:
            for method, path, headers in requests:
                async with session.request(method, server.make_url(path), headers=headers, json={}) as response:
                    body = await response.json() if response.content_type == "application/json" else None
                    out.append((response.status, body, response.headers.get("WWW-Authenticate")))
        return out
    finally:
        await server.close()


def test_api_key_guards_the_openai_routes_only():
    """Without or with a wrong key /v1/* is 401 with an OpenAI error body; the right key passes; probes stay open."""
    config = GatewayConfig(mode="nixl-pull", prefill_url="http://127.0.0.1:9", decode_url="http://127.0.0.1:9",
                           api_key="sk-test-key")
    results = asyncio.run(_statuses(config, [
        ("POST", "/v1/completions", {}),
        ("POST", "/v1/chat/completions", {"Authorization": "Bearer wrong"}),
        ("GET", "/v1/models", {"Authorization": "sk-test-key"}),
        ("POST", "/v1/completions", {"Authorization": "Bearer sk-test-key"}),
        ("GET", "/ping", {}),
    ]))
    for status, body, challenge in results[:3]:
        assert status == 401 and challenge == "Bearer"
        assert body["error"]["type"] == "invalid_request_error" and "API key" in body["error"]["message"]
    assert results[3][0] == 400  # past the key: the (empty) body is judged on its merits
    assert results[4][0] != 401


def test_no_api_key_configured_means_open_routes():
    """Without --api-key the routes answer as before (no 401)."""
    config = GatewayConfig(mode="nixl-pull", prefill_url="http://127.0.0.1:9", decode_url="http://127.0.0.1:9")
    ((status, _, _),) = asyncio.run(_statuses(config, [("POST", "/v1/completions", {})]))
    assert status == 400


def test_api_key_flag_and_environment(monkeypatch):
    """--api-key sets it; KVPUSH_GATEWAY_API_KEY is the fallback."""
    base = ["--mode", "nixl-pull", "--prefill-url", "http://p", "--decode-url", "http://d"]
    assert parse_args([*base, "--api-key", "k1"]).api_key == "k1"
    monkeypatch.setenv("KVPUSH_GATEWAY_API_KEY", "k2")
    assert parse_args(base).api_key == "k2"
