"""The gateway process against a real directory and scripted stand-in engines: legs, ids, errors, SageMaker."""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path

import pytest

from kvpush.client import ChannelConfig, SyncDirectoryClient
from kvpush.localstack.client import call, stream_completion
from kvpush.localstack.processes import group_cpu_seconds, start_directory, start_gateway
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb
from tests.unit.services.gateway.standin import StandInEngine, default_behaviour

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE_ID}-00f067aa0ba902b7-01"


def _layout(block_count: int = 64) -> tpb.KVLayout:
    region = 4096 * block_count
    return tpb.KVLayout(
        layer_count=2, block_size_tokens=16, block_count=block_count, block_bytes_per_layer=4096, dtype="bfloat16",
        memory_kind=tpb.MEMORY_KIND_DRAM, layer_region_bytes=region, compatibility_hash="standin",
        layer_base_addresses=[region, 2 * region],
        planes=[tpb.KVPlane(offset_bytes=0, block_stride_bytes=4096, block_bytes=4096, segment_count=1,
                            token_stride_bytes=256, segment_bytes_per_token=256)])


def register_standin(client: SyncDirectoryClient, name: str, role: int, endpoint: str, block_count: int = 64,
                     forces_first_token: bool = False):
    """Register a stand-in engine `standin-<name>` (one rank, model "tiny") and keep its lease; the registration."""
    return client.start_registration(dpb.RegisterEngineRequest(
        engine_id=f"standin-{name}", role=role, tp_rank=0, tp_size=1, agent_name=f"agent-{name}",
        agent_metadata=b"standin-metadata", layout=_layout(block_count), endpoint=endpoint, model="tiny",
        forces_first_token=forces_first_token))


class Deployment:
    """A directory, a stand-in prefill and decode engine registered there, and a gateway in front."""

    def __init__(self, log_dir: Path, otlp_env: dict[str, str], first_token_from_prefill: bool = False,
                 decode_forces_first_token: bool = True) -> None:
        self.prefill = StandInEngine("prefill").start()
        self.decode = StandInEngine("decode").start()
        self.directory = start_directory(log_dir)
        self.client = SyncDirectoryClient(ChannelConfig(address=self.directory.address, timeout_s=5.0))
        self.registrations = {
            engine.name: register_standin(self.client, engine.name, role, engine.url,
                                          forces_first_token=role == tpb.ENGINE_ROLE_DECODE
                                          and decode_forces_first_token)
            for engine, role in ((self.prefill, tpb.ENGINE_ROLE_PREFILL), (self.decode, tpb.ENGINE_ROLE_DECODE))}
        self.gateway = start_gateway(log_dir, directory_address=self.directory.address, env=otlp_env,
                                     extra_args=["--prefill-timeout", "4", "--decode-timeout", "4",
                                                 # the concurrent path; first token from prefill (the default):
                                                 # test_first_token_gateway.py and tests/integration/localstack
                                                 *(() if first_token_from_prefill
                                                   else ("--no-first-token-from-prefill",))])

    def reset(self) -> None:
        for engine in (self.prefill, self.decode):
            engine.legs.clear()
            engine.arrived.clear()
            engine.behaviour = None
            engine.tokenized.clear()
            engine.tokenize_status = 200

    def transfer(self, transfer_id: str) -> tpb.Transfer:
        return self.client.get_transfer(transfer_id)

    def stop(self) -> None:
        self.gateway.process.stop(grace_s=5.0)
        self.client.close()
        self.directory.process.stop(grace_s=5.0)
        self.prefill.stop()
        self.decode.stop()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, otlp_receiver):
    """One deployment per module; each test scripts the engines afresh."""
    deployment = Deployment(tmp_path_factory.mktemp("gateway"), otlp_receiver.env("kvpush-gateway-unit"))
    yield deployment
    deployment.stop()


@pytest.fixture
def gw(deployment):
    """The module deployment with engines back to their default behaviour."""
    deployment.reset()
    return deployment


def _complete(gw, body: dict, headers: dict | None = None, path: str = "/v1/completions"):
    return call("POST", gw.gateway.url + path, body, headers=headers, timeout_s=30)


def test_legs_are_sent_concurrently_with_shared_ids(gw):
    """The prefill leg is answered only once the decode leg has arrived, so a 200 proves both were in flight."""
    def prefill_waits_for_decode(leg):
        if not gw.decode.arrived.wait(5):
            return 500, {"error": {"message": "decode leg never arrived"}}, 0.0
        return default_behaviour(leg)

    gw.prefill.behaviour = prefill_waits_for_decode
    result = _complete(gw, {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 7},
                       headers={"X-Request-Id": "req-concurrent-1", "traceparent": CLIENT_TRACEPARENT})
    assert result.status == 200, result.text
    (p_leg,), (d_leg,) = gw.prefill.legs, gw.decode.legs
    assert p_leg.headers["x-request-id"] == d_leg.headers["x-request-id"] == "req-concurrent-1"
    p_params, d_params = p_leg.body["kv_transfer_params"], d_leg.body["kv_transfer_params"]
    assert p_params["transfer_id"] == d_params["transfer_id"] == result.headers["x-kvpush-transfer-id"]
    assert (p_params["do_remote_decode"], d_params["do_remote_prefill"]) == (True, True)
    assert p_leg.body["max_tokens"] == 1 and p_leg.body["stream"] is False
    assert d_leg.body["max_tokens"] == 7 and d_leg.body["prompt"] == [5, 6, 7]
    for leg in (p_leg, d_leg):
        assert leg.headers["traceparent"].split("-")[1] == CLIENT_TRACE_ID
    assert p_params["traceparent"].split("-")[1] == CLIENT_TRACE_ID
    assert result.body["choices"][0]["text"] == "max_tokens=7"
    assert result.body["kvpush"]["transfer_id"] == p_params["transfer_id"]


def test_gateway_span_carries_transfer_id(gw, otlp_receiver):
    """The gateway exports a gateway.request span in the client's trace, tagged with the transfer id."""
    result = _complete(gw, {"model": "tiny", "prompt": "hello", "max_tokens": 2},
                       headers={"traceparent": CLIENT_TRACEPARENT})
    assert result.status == 200, result.text
    transfer_id = result.headers["x-kvpush-transfer-id"]
    spans = otlp_receiver.wait_for(lambda spans: any(
        s.name == "gateway.request" and s.attributes.get("kvpush.transfer_id") == transfer_id for s in spans), 15)
    span = next(s for s in spans if s.attributes.get("kvpush.transfer_id") == transfer_id)
    assert span.trace_id == CLIENT_TRACE_ID
    assert span.attributes["http.status_code"] == 200
    spans = otlp_receiver.wait_for(lambda spans: {"gateway.prefill_leg", "gateway.decode_leg"} <= {
        s.name for s in spans if s.parent_span_id == span.span_id}, 15)
    legs = {s.name: s for s in spans if s.parent_span_id == span.span_id}
    assert {"gateway.plan", "gateway.prefill_leg", "gateway.decode_leg"} <= set(legs)
    # Each leg's traceparent names its own span, so engine spans hang under the right leg.
    assert gw.prefill.legs[0].headers["traceparent"].split("-")[2] == legs["gateway.prefill_leg"].span_id
    assert gw.decode.legs[0].headers["traceparent"].split("-")[2] == legs["gateway.decode_leg"].span_id


def test_failed_prefill_leg_returns_502_and_cancels_transfer(gw):
    """A prefill engine answering 500 ends the request with 502 naming the prefill leg, and the transfer is
    CANCELLED."""
    gw.prefill.behaviour = lambda leg: (500, {"error": {"message": "engine exploded"}}, 0.0)
    gw.decode.behaviour = lambda leg: (200, {"choices": []}, 3.0)
    result = _complete(gw, {"model": "tiny", "prompt": "x", "max_tokens": 3})
    assert result.status == 502
    assert "prefill" in result.body["error"]["message"] and "engine exploded" in result.body["error"]["message"]
    transfer_id = gw.prefill.legs[0].body["kv_transfer_params"]["transfer_id"]
    assert result.headers["x-kvpush-transfer-id"] == transfer_id
    transfer = gw.transfer(transfer_id)
    assert transfer.state == tpb.TRANSFER_STATE_CANCELLED
    assert "prefill" in transfer.failure_reason


def test_engine_4xx_is_passed_through_with_its_message(gw):
    """A decode engine refusing the input (400) gives the client the same 400 and the engine's message."""
    gw.decode.behaviour = lambda leg: (400, {"object": "error", "message": "prompt too long: 9999 > 4096",
                                             "type": "BadRequestError", "code": 400}, 0.0)
    result = _complete(gw, {"model": "tiny", "prompt": "x", "max_tokens": 3})
    assert result.status == 400
    assert "prompt too long" in result.body["error"]["message"]
    transfer = gw.transfer(gw.decode.legs[0].body["kv_transfer_params"]["transfer_id"])
    assert transfer.state == tpb.TRANSFER_STATE_CANCELLED


def test_slow_decode_leg_times_out_with_504(gw):
    """A decode leg slower than --decode-timeout ends with 504 within the bound."""
    gw.decode.behaviour = lambda leg: (200, {"choices": []}, 8.0)
    result = _complete(gw, {"model": "tiny", "prompt": "x", "max_tokens": 3})
    assert result.status == 504
    assert "decode" in result.body["error"]["message"]
    assert result.elapsed_s < 8.0


def test_streaming_passes_decode_events_through(gw):
    """A streamed request returns the decode engine's SSE events in order, with the transfer id header."""
    # Decode's first event comes after prefill answered, as with a real push (decode waits for the KV),
    # so the prefill's params are known before the stream's headers go out.
    gw.decode.behaviour = lambda leg: (200, {"stream_tokens": ["one", " two", " three"]}, 0.3)
    result = stream_completion(gw.gateway.url + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 3},
                               timeout_s=30)
    assert result.status == 200, result.error
    assert result.text == "one two three"
    assert result.headers["x-kvpush-transfer-id"] == gw.decode.legs[0].body["kv_transfer_params"]["transfer_id"]
    assert gw.prefill.legs[0].body["stream"] is False
    # The stand-in prefill echoes its params; they come back in a header since a stream has no body field.
    prefill_params = json.loads(result.headers["x-kvpush-prefill-params"])
    assert prefill_params["echo"]["transfer_id"] == result.headers["x-kvpush-transfer-id"]


def test_streaming_with_failed_prefill_gets_an_error_status(gw):
    """When the prefill leg fails before decode's first event, a streaming client still gets a 502 status."""
    gw.prefill.behaviour = lambda leg: (503, {"error": {"message": "no capacity"}}, 0.0)
    gw.decode.behaviour = lambda leg: (200, {"stream_tokens": ["late"]}, 2.0)
    result = stream_completion(gw.gateway.url + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 3},
                               timeout_s=30)
    assert result.status == 502
    assert "no capacity" in result.error


def test_stream_failing_before_its_first_token_is_a_502(gw):
    """A decode stream whose first event is vLLM's error event becomes a 502 with the engine's message."""
    gw.decode.behaviour = lambda leg: (200, {"stream_error": {"message": "KV load failed", "code": 500},
                                             "stream_tokens": []}, 0.0)
    result = stream_completion(gw.gateway.url + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 3},
                               timeout_s=30)
    assert result.status == 502
    assert "KV load failed" in result.error
    transfer = gw.transfer(gw.decode.legs[0].body["kv_transfer_params"]["transfer_id"])
    assert transfer.state == tpb.TRANSFER_STATE_CANCELLED


def _read_first_event_then_disconnect(url: str, body: dict) -> tuple[str, bytes]:
    """Stream a completion, read up to its first SSE event, then drop the connection (a client going away)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        while not (line := response.readline()).startswith(b"data:"):
            assert line, "stream ended before its first event"
        return response.getheader("x-kvpush-transfer-id"), line
    finally:
        conn.close()


def test_disconnect_after_first_token_leaves_the_transfer_alone(gw):
    """Decode streamed a token, so its KV landed: a client leaving afterwards must not cancel the transfer."""
    gw.decode.behaviour = lambda leg: (200, {"stream_tokens": ["one", " two", " three"], "token_delay_s": 1.0}, 0.0)
    transfer_id, first = _read_first_event_then_disconnect(gw.gateway.url, {"model": "tiny", "prompt": "x",
                                                                            "max_tokens": 3})
    assert b"one" in first
    time.sleep(2.5)  # the gateway notices the disconnect at its next write
    assert gw.transfer(transfer_id).state != tpb.TRANSFER_STATE_CANCELLED


def test_disconnect_before_first_token_cancels_the_transfer(gw):
    """A client gone before decode produced anything cancels the transfer (prefill must stop writing)."""
    gw.decode.behaviour = lambda leg: (200, {"stream_tokens": ["late"]}, 3.0)
    host, port = gw.gateway.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 3,
                                                             "stream": True}),
                 headers={"Content-Type": "application/json"})
    assert gw.decode.arrived.wait(10)
    conn.close()
    transfer_id = gw.decode.legs[0].body["kv_transfer_params"]["transfer_id"]
    deadline = time.monotonic() + 10
    while gw.transfer(transfer_id).state != tpb.TRANSFER_STATE_CANCELLED and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gw.transfer(transfer_id).state == tpb.TRANSFER_STATE_CANCELLED


@pytest.mark.parametrize("body, field", [
    ({"model": "tiny", "prompt": "x", "kv_transfer_params": {"transfer_id": "t"}}, "kv_transfer_params"),
    ({"model": "tiny", "prompt": "x", "n": 2}, "n"),
    ({"model": "tiny", "prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"model": "tiny", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "tiny", "messages": []}, "messages"),
])
def test_bad_input_is_refused_before_planning(gw, body, field):
    """Malformed requests get a 400 naming the field, and no transfer is planned nor any leg sent."""
    before = len(gw.client.list_transfers(limit=1000))
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    result = _complete(gw, body, path=path)
    assert result.status == 400
    assert result.body["error"]["param"] == field
    assert len(gw.client.list_transfers(limit=1000)) == before
    assert not gw.prefill.legs and not gw.decode.legs


def test_invalid_json_and_bad_request_id_are_400(gw):
    """A body that is not JSON, or a malformed X-Request-Id, is a 400 with a message."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", gw.gateway.port, timeout=10)
    conn.request("POST", "/v1/completions", body=b"{not json", headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 400 and b"not valid JSON" in response.read()
    conn.close()
    result = _complete(gw, {"model": "tiny", "prompt": "x"}, headers={"X-Request-Id": "bad id with spaces"})
    assert result.status == 400 and result.body["error"]["param"] == "X-Request-Id"


def test_sagemaker_ping_and_chat_invocation(gw):
    """/ping is 200 with engines registered; /invocations with messages is routed to chat completions."""
    assert call("GET", gw.gateway.url + "/ping").status == 200
    result = _complete(gw, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                       path="/invocations")
    assert result.status == 200, result.text
    assert gw.decode.legs[0].path == "/v1/chat/completions"
    assert gw.prefill.legs[0].path == "/v1/chat/completions"


def test_models_are_served_from_a_decode_engine(gw):
    """GET /v1/models answers with the decode engine's model list."""
    result = call("GET", gw.gateway.url + "/v1/models")
    assert result.status == 200
    assert result.body["data"][0]["id"] == "tiny"


class TestStaticModes:
    """The vLLM NIXL baseline modes: static engines and vLLM's own params."""

    def test_pull_mode_is_sequential_and_forwards_prefill_params(self, tmp_path):
        """nixl-pull sends decode only after prefill answered, carrying prefill's kv_transfer_params."""
        prefill, decode = StandInEngine("p").start(), StandInEngine("d").start()
        prefill_done = threading.Event()

        def prefill_behaviour(leg):
            prefill_done.set()
            return 200, {"choices": [{"text": "x"}], "kv_transfer_params": {"remote_block_ids": [1, 2]}}, 0.2

        prefill.behaviour = prefill_behaviour
        gateway = start_gateway(tmp_path, directory_address="", extra_args=[
            "--mode", "nixl-pull", "--prefill-url", prefill.url, "--decode-url", decode.url])
        try:
            result = call("POST", gateway.url + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
            assert result.status == 200, result.text
            assert decode.legs[0].arrived_at >= prefill.legs[0].arrived_at + 0.2
            assert decode.legs[0].body["kv_transfer_params"] == {"remote_block_ids": [1, 2]}
            assert prefill.legs[0].body["kv_transfer_params"]["do_remote_decode"] is True
        finally:
            gateway.process.stop(grace_s=5.0)
            prefill.stop()
            decode.stop()

    def test_push_mode_names_prefill_engine_and_request(self, tmp_path):
        """nixl-push sends both legs with the same X-Request-Id and tells decode prefill's engine and side channel."""
        prefill, decode = StandInEngine("p").start(), StandInEngine("d").start()
        gateway = start_gateway(tmp_path, directory_address="", extra_args=[
            "--mode", "nixl-push", "--prefill-url", prefill.url, "--decode-url", decode.url,
            "--prefill-engine-id", "P1", "--prefill-side-channel", "127.0.0.1:5611"])
        try:
            result = call("POST", gateway.url + "/v1/completions", {"model": "tiny", "prompt": "x"},
                          headers={"X-Request-Id": "push-1"})
            assert result.status == 200, result.text
            params = decode.legs[0].body["kv_transfer_params"]
            assert params["remote_engine_id"] == "P1" and params["remote_request_id"] == "push-1"
            assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", 5611)
            assert prefill.legs[0].headers["x-request-id"] == "push-1"
        finally:
            gateway.process.stop(grace_s=5.0)
            prefill.stop()
            decode.stop()

    def test_unreachable_engine_is_503(self, tmp_path):
        """An engine URL nobody listens on ends the request with 503 naming the leg."""
        from kvpush.localstack.processes import free_port

        dead = f"http://127.0.0.1:{free_port()}"
        gateway = start_gateway(tmp_path, directory_address="", extra_args=[
            "--mode", "nixl-pull", "--prefill-url", dead, "--decode-url", dead])
        try:
            result = call("POST", gateway.url + "/v1/completions", {"model": "tiny", "prompt": "x"})
            assert result.status == 503
            message = result.body["error"]["message"]
            assert "prefill engine" in message and "unreachable" in message
        finally:
            gateway.process.stop(grace_s=5.0)


def test_text_prompt_is_counted_and_a_prompt_too_long_for_decode_is_refused(gw):
    """A text prompt is tokenized on the prefill engine first; 2000 tokens exceed decode's 64 blocks of 16
    tokens, so the directory refuses the plan (503 naming the count) and no leg is sent."""
    result = _complete(gw, {"model": "tiny", "prompt": " ".join(["word"] * 2000), "max_tokens": 2})
    assert result.status == 503, result.text
    assert "room for 2000 tokens" in result.body["error"]["message"]
    assert gw.prefill.tokenized[-1]["prompt"].count("word") == 2000
    assert not gw.prefill.legs and not gw.decode.legs


def test_chat_prompt_is_counted_with_its_template_fields(gw):
    """A chat request is tokenized as messages with its template fields, then served; the count reaches the plan."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 2,
            "add_generation_prompt": True}
    result = _complete(gw, body, path="/v1/chat/completions")
    assert result.status == 200, result.text
    (tokenized,) = gw.prefill.tokenized
    assert tokenized["messages"] == body["messages"] and tokenized["add_generation_prompt"] is True
    transfer = gw.transfer(result.headers["x-kvpush-transfer-id"])
    assert transfer.prompt_token_count == 6  # 3 words + 3 (the stand-in's chat template)


def test_tokenizer_failure_only_skips_the_free_block_check(gw):
    """When /tokenize fails (500) the request is still served, planned without a prompt length."""
    gw.prefill.tokenize_status = 500
    result = _complete(gw, {"model": "tiny", "prompt": " ".join(["abcdefgh"] * 300), "max_tokens": 2})
    assert result.status == 200, result.text
    assert gw.prefill.tokenized and gw.decode.legs


def test_short_text_prompt_skips_tokenize_when_its_byte_bound_fits(gw):
    """A text prompt whose UTF-8 length (+16) fits every decode engine's free blocks is planned with that bound,
    without a /tokenize round trip; a longer one is counted exactly and then fits."""
    short = _complete(gw, {"model": "tiny", "prompt": "hello there", "max_tokens": 2})
    assert short.status == 200, short.text
    assert not gw.prefill.tokenized
    assert gw.transfer(short.headers["x-kvpush-transfer-id"]).prompt_token_count == len("hello there") + 16
    longer = _complete(gw, {"model": "tiny", "prompt": " ".join(["abcdefgh"] * 600), "max_tokens": 2})
    assert longer.status == 200, longer.text  # 5399 bytes exceed 1024 tokens of cache; 600 tokens do not
    assert len(gw.prefill.tokenized) == 1
    assert gw.transfer(longer.headers["x-kvpush-transfer-id"]).prompt_token_count == 600


def test_unknown_model_is_404_naming_the_served_models(gw):
    """A model no engine serves is refused before planning with 404 naming what is served."""
    result = _complete(gw, {"model": "gpt-17", "prompt": [1, 2, 3], "max_tokens": 2})
    assert result.status == 404, result.text
    assert "'gpt-17'" in result.body["error"]["message"] and "tiny" in result.body["error"]["message"]
    assert result.body["error"]["param"] == "model"
    assert not gw.prefill.legs and not gw.decode.legs


def test_waiting_for_decode_after_prefill_answered_does_not_spin(gw):
    """Prefill answers at once, decode's first event comes 1.5 s later: the gateway waits for it without burning
    CPU (it once re-polled the finished prefill leg in a loop, a core for as long as decode took)."""
    gw.decode.behaviour = lambda leg: (200, {"stream_tokens": ["late"], "first_event_delay_s": 1.5}, 0.0)
    before = group_cpu_seconds(gw.gateway.process.pid)
    result = stream_completion(gw.gateway.url + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 3},
                               timeout_s=30)
    used = group_cpu_seconds(gw.gateway.process.pid) - before
    assert result.status == 200 and result.text == "late", result
    assert result.ttft_s >= 1.4
    assert used < 0.5, f"the gateway used {used:.2f} CPU s while waiting {result.ttft_s:.2f} s for decode"
