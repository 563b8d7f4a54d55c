"""The gateway hosted in an API server (`HostedGateway`): a real uvicorn serving a FastAPI app with the middleware, as
vLLM's `--middleware` installs it. The gateway starts with the app's start-up and stops with its shutdown; bad flags
fail the app's start-up with the reason; the app's own routes pass through. With the app as the gateway's local
prefill engine (a stand-in for vLLM on the same loop), the plan waits, bounded, for the app to take the leg.
Against real engines: tests/integration/localstack/test_hosted_gateway.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from kvpush.client import ChannelConfig, SyncDirectoryClient
from kvpush.gateway.dispatch import HOSTED_PLAN_WAIT_S
from kvpush.gateway.hosted import ARGS_ENV, HostedGateway, hosted_config
from kvpush.localstack.client import call, stream_completion
from kvpush.localstack.processes import free_port, start_directory, tcp_open
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb
from tests.unit.services.gateway.standin import StandInEngine
from tests.unit.services.gateway.test_first_token_gateway import _decode_events
from tests.unit.services.gateway.test_gateway import _layout


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


def test_with_reuse_port_every_api_server_process_hosts_one_on_the_port(monkeypatch):
    """`vllm serve --api-server-count 2`: two API servers, each hosting a gateway on the one port with --reuse-port;
    both start, and the port answers while either runs."""
    port = free_port()
    monkeypatch.setenv(ARGS_ENV, f"--port {port} --directory 127.0.0.1:1 --reuse-port")
    first = Served(_app([])).start()
    second = Served(_app([])).start()
    try:
        assert first.server.started and second.server.started
        assert call("GET", f"http://127.0.0.1:{port}/metrics", timeout_s=5).status == 200
        first.stop()
        assert call("GET", f"http://127.0.0.1:{port}/metrics", timeout_s=5).status == 200
    finally:
        second.stop()
        if first.thread.is_alive():
            first.stop()


def test_without_the_variable_the_reason_names_it(monkeypatch):
    monkeypatch.delenv(ARGS_ENV, raising=False)
    with pytest.raises(ValueError, match=ARGS_ENV):
        hosted_config()


# ---------------------------------------------------------------- the plan waits for the local engine to take the leg


class LocalPrefill:
    """A stand-in vLLM prefill engine as a FastAPI app, hosting the gateway: it answers a streamed leg after
    `headers_delay_s`, sends its token's event after `token_delay_s`, and records (wall clock) when its response
    headers left, each leg's client port (0: called in process, no socket) and each stream it ended early (the
    leg's disconnect, as vLLM aborts a request)."""

    def __init__(self) -> None:
        self.headers_delay_s = 0.0
        self.token_delay_s = 0.0
        self.headers_sent_at: list[float] = []
        self.client_ports: list[int] = []
        self.aborted = threading.Event()
        self.fail_with: Exception | None = None
        self.app = _app([])
        self.app.state.engine = "standin-local"  # read back through request.app, as vLLM's handlers read theirs

        @self.app.post("/v1/completions")
        async def completions(request: Request):
            self.client_ports.append(request.client.port)
            assert request.app.state.engine == "standin-local"
            await request.json()
            if self.fail_with is not None:
                raise self.fail_with
            await asyncio.sleep(self.headers_delay_s)
            token = {"id": "cmpl-p", "object": "text_completion", "created": 5, "model": "tiny", "choices": [
                {"index": 0, "text": " sea", "token_ids": [17], "finish_reason": "length", "logprobs": None}]}

            async def events():
                ended = False
                try:
                    await asyncio.sleep(self.token_delay_s)
                    yield f"data: {json.dumps(token)}\n\n"
                    yield "data: [DONE]\n\n"
                    ended = True
                finally:
                    if not ended:
                        self.aborted.set()

            self.headers_sent_at.append(time.time())  # the response starts as this handler returns
            return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def hosted(tmp_path_factory):
    """A directory, a stand-in decode engine, and the local prefill app hosting the gateway (its engine)."""
    log_dir = tmp_path_factory.mktemp("hosted-plan-wait")
    directory = start_directory(log_dir)
    client = SyncDirectoryClient(ChannelConfig(address=directory.address, timeout_s=5.0))
    decode = StandInEngine("decode").start()
    prefill = LocalPrefill()
    gateway_port = free_port()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ARGS_ENV, f"--port {gateway_port} --directory {directory.address} "
                               f"--local-prefill-engine standin-local --prefill-timeout 1.5")
        served = Served(prefill.app).start()
    for engine_id, role, url in (("standin-local", tpb.ENGINE_ROLE_PREFILL, f"http://127.0.0.1:{served.port}"),
                                 ("standin-decode", tpb.ENGINE_ROLE_DECODE, decode.url)):
        client.start_registration(dpb.RegisterEngineRequest(
            engine_id=engine_id, role=role, tp_rank=0, tp_size=1, agent_name=f"agent-{engine_id}",
            agent_metadata=b"standin-metadata", layout=_layout(), endpoint=url, model="tiny",
            forces_first_token=role == tpb.ENGINE_ROLE_DECODE))
    yield client, prefill, decode, f"http://127.0.0.1:{gateway_port}"
    served.stop()
    client.close()
    directory.process.stop(grace_s=5.0)
    decode.stop()


def _streamed(gateway_url: str):
    return stream_completion(gateway_url + "/v1/completions", {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3,
                                                              "return_token_ids": True},
                             timeout_s=30)


def _decode_stream(leg):
    return 200, {"stream_events": _decode_events((17, " sea"), (18, " wave"), (19, "s"))}, 0.0


@pytest.mark.parametrize("headers_delay_s", [0.0, 0.01])
def test_a_hosted_gateway_plans_after_its_engine_took_the_leg(hosted, headers_delay_s):
    """The plan (the directory's create_time) comes after the local engine answered the leg's headers, so the plan's
    work does not run ahead of vLLM's intake on the shared loop; the client gets every token once."""
    client, prefill, decode, gateway_url = hosted
    decode.behaviour, prefill.headers_delay_s, prefill.token_delay_s = _decode_stream, headers_delay_s, 0.0
    prefill.fail_with = None
    answer = _streamed(gateway_url)
    assert answer.status == 200 and not answer.error, answer.error
    assert [i for e in answer.events for c in e.get("choices", []) for i in c.get("token_ids") or []] == [17, 18, 19]
    transfer = client.get_transfer(answer.headers["x-kvpush-transfer-id"])
    assert transfer.prefill_engine_id == "standin-local"
    assert transfer.create_time.ToNanoseconds() / 1e9 > prefill.headers_sent_at[-1]
    assert prefill.client_ports[-1] == 0  # the leg went into the app, not over a socket (in_process)


def test_the_wait_is_bounded_when_the_engine_is_slow_to_answer(hosted):
    """Headers 0.3 s late: the plan goes out after HOSTED_PLAN_WAIT_S anyway, well before them."""
    client, prefill, decode, gateway_url = hosted
    decode.behaviour, prefill.headers_delay_s, prefill.token_delay_s = _decode_stream, 0.3, 0.0
    sent = time.time()
    answer = _streamed(gateway_url)
    assert answer.status == 200 and not answer.error, answer.error
    planned = client.get_transfer(answer.headers["x-kvpush-transfer-id"]).create_time.ToNanoseconds() / 1e9
    assert planned < prefill.headers_sent_at[-1] - 0.1
    assert planned - sent < HOSTED_PLAN_WAIT_S + 0.2


def test_an_in_process_leg_past_its_bound_is_a_504_and_aborts_the_request(hosted):
    """The local engine starts its answer but sends no token within --prefill-timeout (1.5 s): the client gets 504
    naming the prefill leg, and the app's stream is ended early (the disconnect vLLM aborts a request on)."""
    client, prefill, decode, gateway_url = hosted
    decode.behaviour, prefill.headers_delay_s, prefill.token_delay_s = _decode_stream, 0.0, 30.0
    prefill.aborted.clear()
    started = time.monotonic()
    answer = _streamed(gateway_url)
    assert answer.status == 504, (answer.status, answer.error)
    assert "prefill" in (answer.error or "")
    assert time.monotonic() - started < 10
    assert prefill.aborted.wait(5), "the app's stream was not ended by the leg's disconnect"
    transfer = client.get_transfer(answer.headers["x-kvpush-transfer-id"])
    assert transfer.state == tpb.TRANSFER_STATE_CANCELLED


def test_an_app_that_raises_is_a_502_and_not_an_unreachable_engine(hosted):
    """The engine runs in this process: its app raising is a broken answer (502 naming it), not a reason to report
    the engine unreachable and plan elsewhere (the directory still lists it as reachable)."""
    client, prefill, decode, gateway_url = hosted
    decode.behaviour, prefill.headers_delay_s, prefill.token_delay_s = _decode_stream, 0.0, 0.0
    prefill.fail_with = RuntimeError("engine core died")
    try:
        answer = _streamed(gateway_url)
    finally:
        prefill.fail_with = None
    assert answer.status == 502, (answer.status, answer.error)
    assert "in process" in answer.error and "engine core died" in answer.error
    (local,) = [e for e in client.list_engines() if e.engine_id == "standin-local"]
    assert not local.HasField("unreachable_time")
    assert _streamed(gateway_url).status == 200  # and the next request is served there again
