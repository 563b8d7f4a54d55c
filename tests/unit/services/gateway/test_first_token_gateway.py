"""First token from prefill (the gateway's default) against a real directory and scripted stand-in engines: both
legs leave at once, prefill's token reaches the client when its leg returns, decode's copy of it is dropped."""

from __future__ import annotations

import time

import pytest

from kvpush.localstack.client import stream_completion
from kvpush.v1 import types_pb2 as tpb
from tests.unit.services.gateway.test_gateway import Deployment


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, otlp_receiver):
    deployment = Deployment(tmp_path_factory.mktemp("gateway-first-token"), otlp_receiver.env("kvpush-gateway-ft"),
                            first_token_from_prefill=True)
    yield deployment
    deployment.stop()


@pytest.fixture
def gw(deployment):
    deployment.reset()
    return deployment


def _prefill_answer(token_id: int = 17, text: str = " sea", finish: str = "length") -> dict:
    return {"id": "cmpl-p", "object": "text_completion", "created": 5, "model": "tiny",
            "choices": [{"index": 0, "text": text, "token_ids": [token_id], "finish_reason": finish,
                         "logprobs": None}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


def _decode_events(*tokens: tuple[int, str], finish: str = "length") -> list[dict]:
    events = [{"id": "cmpl-d", "object": "text_completion", "choices": [
        {"index": 0, "text": text, "token_ids": [token_id], "logprobs": None,
         "finish_reason": finish if i == len(tokens) - 1 else None}]} for i, (token_id, text) in enumerate(tokens)]
    return events


def test_both_legs_leave_at_once_and_the_client_sees_each_token_once(gw):
    """Prefill answers only after the decode leg arrived (so both were in flight); both legs say
    first_token_from_prefill; the client gets prefill's token first and decode's stream without its copy."""
    def prefill(leg):
        if not gw.decode.arrived.wait(5):
            return 500, {"error": {"message": "decode leg never arrived"}}, 0.0
        return 200, _prefill_answer(), 0.0

    gw.prefill.behaviour = prefill
    gw.decode.behaviour = lambda leg: (200, {"stream_events": _decode_events((17, " sea"), (18, " wave"), (19, "s")),
                                             "token_delay_s": 0.05}, 0.2)
    result = stream_completion(gw.gateway.url + "/v1/completions",
                               {"model": "tiny", "prompt": "x", "max_tokens": 3}, timeout_s=30)
    assert result.status == 200, result.error
    assert result.text == " sea waves"
    (p_leg,), (d_leg,) = gw.prefill.legs, gw.decode.legs
    assert p_leg.body["kv_transfer_params"]["first_token_from_prefill"] is True
    assert d_leg.body["kv_transfer_params"]["first_token_from_prefill"] is True
    assert "first_token_id" not in d_leg.body["kv_transfer_params"]  # it travels with the transfer
    assert p_leg.body["return_token_ids"] is True and d_leg.body["return_token_ids"] is True
    assert d_leg.arrived_at < p_leg.arrived_at + 1.0


def test_prefill_eos_ends_the_stream_and_stops_the_decode_leg(gw):
    """A first token that finishes the request (EOS) is the whole answer; the transfer is cancelled."""
    gw.prefill.behaviour = lambda leg: (200, _prefill_answer(2, "", "stop"), 0.0)
    gw.decode.behaviour = lambda leg: (200, {"stream_events": _decode_events((2, ""), finish="stop")}, 2.0)
    result = stream_completion(gw.gateway.url + "/v1/completions",
                               {"model": "tiny", "prompt": "x", "max_tokens": 5}, timeout_s=30)
    assert result.status == 200, result.error
    assert [e["choices"][0]["finish_reason"] for e in result.events if e.get("choices")] == ["stop"]
    transfer_id = result.headers["x-kvpush-transfer-id"]
    deadline = time.monotonic() + 5  # cancelled right after the client's stream ended
    while gw.transfer(transfer_id).state != tpb.TRANSFER_STATE_CANCELLED:
        assert time.monotonic() < deadline, gw.transfer(transfer_id)
        time.sleep(0.02)


def test_a_decode_leg_failing_before_prefill_returns_is_an_error_status(gw):
    """The decode engine refuses the leg while prefill still computes: the client gets that status, not a stream."""
    gw.prefill.behaviour = lambda leg: (200, _prefill_answer(), 1.0)
    gw.decode.behaviour = lambda leg: (500, {"error": {"message": "decode broke"}}, 0.0)
    result = stream_completion(gw.gateway.url + "/v1/completions",
                               {"model": "tiny", "prompt": "x", "max_tokens": 3}, timeout_s=30)
    assert result.status == 502 and "decode broke" in (result.error or "")
