"""The gateway's HTTP session to the engines, which every client's legs share.

Its pooled connections expire before the engines' own keep-alive does: vLLM's server closes a connection idle for
5 s; a gateway that keeps it longer sends its next request on a socket the engine is closing and gets "Server
disconnected" with nothing answered (seen on the H200 between two requests 5 s apart). The session must drop an
idle connection after upstream_keepalive_s instead. And it keeps no cookies: one set on a leg's answer must not go
out with another client's legs.
"""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from kvpush.gateway.app import SESSION_KEY, create_app
from kvpush.gateway.config import GatewayConfig, parse_args


@contextlib.asynccontextmanager
async def _engine_behind_a_gateway(handler, config: GatewayConfig):
    """An aiohttp app answering GET / with `handler` (its own keep-alive 60 s: longer than any gateway's) and a
    gateway app whose lifecycle ran; yields the engine's port and the gateway's session to engines."""
    engine = web.Application()
    engine.router.add_get("/", handler)
    runner = web.AppRunner(engine, keepalive_timeout=60.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        gateway = create_app(config)
        gateway_runner = web.AppRunner(gateway)
        await gateway_runner.setup()  # runs the lifecycle: the session exists
        try:
            yield site._server.sockets[0].getsockname()[1], gateway[SESSION_KEY]
        finally:
            await gateway_runner.cleanup()
    finally:
        await runner.cleanup()


async def _client_ports_of_two_requests(idle_s: float, keepalive_s: float) -> list[int]:
    ports: list[int] = []

    async def hello(request: web.Request) -> web.Response:
        ports.append(request.transport.get_extra_info("peername")[1])
        return web.Response(text="ok")

    # The engine would keep the connection: the gateway must not, past its keep-alive.
    config = GatewayConfig(mode="kvpush", directory_address="127.0.0.1:1", upstream_keepalive_s=keepalive_s)
    async with _engine_behind_a_gateway(hello, config) as (port, session):
        for pause in (0.0, idle_s):
            await asyncio.sleep(pause)
            async with session.get(f"http://127.0.0.1:{port}/") as response:
                assert response.status == 200 and await response.text() == "ok"
    return ports


def test_an_idle_connection_older_than_the_keepalive_is_not_reused():
    ports = asyncio.run(_client_ports_of_two_requests(idle_s=1.2, keepalive_s=0.3))
    assert len(ports) == 2 and ports[0] != ports[1]


def test_a_connection_idle_less_than_the_keepalive_is_reused():
    ports = asyncio.run(_client_ports_of_two_requests(idle_s=0.1, keepalive_s=5.0))
    assert len(ports) == 2 and ports[0] == ports[1]


def test_the_default_is_below_vllms_five_seconds_and_the_flag_sets_it():
    assert GatewayConfig().upstream_keepalive_s < 5.0
    config = parse_args(["--directory", "127.0.0.1:1", "--upstream-keepalive", "2.5"])
    assert config.upstream_keepalive_s == 2.5


async def _cookies_sent_after_one_was_set() -> list[str | None]:
    cookies: list[str | None] = []

    async def answer(request: web.Request) -> web.Response:
        cookies.append(request.headers.get("Cookie"))
        response = web.Response(text="ok")
        response.set_cookie("session", "first-client")
        return response

    config = GatewayConfig(mode="kvpush", directory_address="127.0.0.1:1")
    async with _engine_behind_a_gateway(answer, config) as (port, session):
        for _ in range(2):  # by host name: a cookie jar would keep cookies from it (it drops those from IP addresses)
            async with session.get(f"http://localhost:{port}/") as response:
                assert response.status == 200
    return cookies


def test_a_cookie_an_engine_set_does_not_go_out_with_later_legs():
    assert asyncio.run(_cookies_sent_after_one_was_set()) == [None, None]
