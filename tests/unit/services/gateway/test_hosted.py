"""The gateway hosted in an API server (`HostedGateway`): a real uvicorn serving a FastAPI app with the middleware, as
vLLM's `--middleware` installs it. The gateway starts with the app's start-up and stops with its shutdown; bad flags
fail the app's start-up with the reason; the app's own routes pass through. Against real engines:
tests/integration/localstack/test_hosted_gateway.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI

from kvpush.localstack.client import call
from kvpush.localstack.processes import free_port, tcp_open
from kvpush.services.gateway.hosted import ARGS_ENV, HostedGateway, hosted_config


class Served:
    """A uvicorn server in a thread of its own, as vLLM's API server runs it (lifespan on)."""

    def __init__(self, app: FastAPI) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, lifespan="on",
                                                    log_level="critical"))
        self.exit_code: int | str | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            asyncio.run(self.server.serve())
        except SystemExit as exit_:  # uvicorn's answer to a failed start-up: sys.exit(3)
            self.exit_code = exit_.code

    def start(self, timeout_s: float = 20.0) -> Served:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 20.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "uvicorn did not stop"


def _app(events: list[str]) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        events.append("app started")
        yield
        events.append("app stopping")

    app = FastAPI(lifespan=lifespan)

    @app.get("/own")
    async def own():
        return {"served_by": "the app"}

    app.add_middleware(HostedGateway)
    return app


def test_the_gateway_serves_beside_the_app_from_start_up_to_shutdown(monkeypatch):
    gateway_port, dead_directory = free_port(), f"127.0.0.1:{free_port()}"
    monkeypatch.setenv(ARGS_ENV, f"--port {gateway_port} --directory {dead_directory} --local-prefill-engine p-0 "
                                 f"--plan-timeout 0.5")
    events: list[str] = []
    served = Served(_app(events)).start()
    try:
        assert served.server.started
        assert events == ["app started"]
        own = call("GET", f"http://127.0.0.1:{served.port}/own", timeout_s=5)
        assert own.status == 200 and own.body == {"served_by": "the app"}
        # The gateway's own routes and errors, on its port: no directory answers, so it cannot route.
        health = call("GET", f"http://127.0.0.1:{gateway_port}/health", timeout_s=10)
        assert health.status == 503, health.text
        assert "directory unreachable" in health.body["error"]["message"]
        bad = call("POST", f"http://127.0.0.1:{gateway_port}/v1/completions", {"model": "m"}, timeout_s=5)
        assert bad.status == 400 and bad.body["error"]["type"] == "invalid_request_error"
        # ...and not on the app's: the middleware leaves the app's routes alone.
        assert call("GET", f"http://127.0.0.1:{served.port}/health", timeout_s=5).status == 404
    finally:
        served.stop()
    assert events == ["app started", "app stopping"]
    assert not tcp_open("127.0.0.1", gateway_port)


@pytest.mark.parametrize("args, reason", [
    ("--port 80000 --directory 127.0.0.1:1", "port 80000 out of range"),
    ("--port 1 --mode nixl-pull", "nixl-pull mode needs --prefill-url and --decode-url"),
    ("--directory 127.0.0.1:1 --no-such-flag", "unrecognized arguments: --no-such-flag"),
])
def test_bad_flags_fail_the_apps_start_up_with_the_reason(monkeypatch, args, reason):
    monkeypatch.setenv(ARGS_ENV, args)
    with pytest.raises(ValueError, match=reason):
        hosted_config()
    served = Served(_app([])).start()
    served.thread.join(20)
    assert not served.server.started and not served.thread.is_alive()
    assert served.exit_code == uvicorn.server.STARTUP_FAILURE
    assert not tcp_open("127.0.0.1", served.port)


def test_a_port_in_use_fails_the_apps_start_up(monkeypatch):
    first_port = free_port()
    monkeypatch.setenv(ARGS_ENV, f"--port {first_port} --directory 127.0.0.1:1")
    first = Served(_app([])).start()
    try:
        assert first.server.started
        second = Served(_app([])).start()
        second.thread.join(20)
        assert not second.server.started and not second.thread.is_alive()
        assert second.exit_code == uvicorn.server.STARTUP_FAILURE
        assert tcp_open("127.0.0.1", first_port)  # the first one's gateway is untouched
    finally:
        first.stop()


def test_without_the_variable_the_reason_names_it(monkeypatch):
    monkeypatch.delenv(ARGS_ENV, raising=False)
    with pytest.raises(ValueError, match=ARGS_ENV):
        hosted_config()
