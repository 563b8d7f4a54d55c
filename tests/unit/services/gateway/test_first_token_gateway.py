"""First token from prefill (the gateway's default) against a real directory and scripted stand-in engines: both
legs leave at once, prefill's token reaches the client when its leg returns, decode's copy of it is dropped."""

from __future__ import annotations

import time

import pytest

from kvpush.localstack.client import call, stream_completion
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


USAGE = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}


def _prefill_answer(token_id: int = 17, text: str = " sea", finish: str = "length", *,
                    rest_delay_s: float = 0.0) -> dict:
    """The streamed prefill leg as vLLM sends it: the token's event, then (after `rest_delay_s`) usage, [DONE]."""
    token = {"id": "cmpl-p", "object": "text_completion", "created": 5, "model": "tiny",
             "choices": [{"index": 0, "text": text, "token_ids": [token_id], "finish_reason": finish,
                          "logprobs": None, "prompt_token_ids": [5, 6, 7]}]}
    usage = {"id": "cmpl-p", "object": "text_completion", "created": 5, "model": "tiny", "choices": [],
             "usage": USAGE}
    return {"stream_events": [token, usage], "token_delay_s": rest_delay_s}


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
    assert p_leg.body["stream"] is True and p_leg.body["stream_options"] == {"include_usage": True}
    assert d_leg.arrived_at < p_leg.arrived_at + 1.0


def test_the_first_token_goes_out_at_the_prefill_legs_token_event(gw):
    """The streamed prefill leg's token event is enough: the client has it before the leg's stream ends (here 3 s
    later), and the stream's rest is still read (the leg's connection is not reset)."""
    gw.prefill.behaviour = lambda leg: (200, _prefill_answer(rest_delay_s=3.0), 0.0)
    gw.decode.behaviour = lambda leg: (200, {"stream_events": _decode_events((17, " sea"), (18, " wave"))}, 0.2)
    started = time.monotonic()
    result = stream_completion(gw.gateway.url + "/v1/completions",
                               {"model": "tiny", "prompt": "x", "max_tokens": 2, "return_token_ids": True},
                               timeout_s=30)
    assert result.status == 200, result.error
    assert result.text == " sea wave" and result.total_s < 2.0, result
    first = result.events[0]
    assert first["choices"][0]["token_ids"] == [17] and first["prompt_token_ids"] == [5, 6, 7]
    assert time.monotonic() - started < 2.5
    (p_leg,) = gw.prefill.legs
    deadline = time.monotonic() + 10
    while not p_leg.stream_ended:  # the gateway reads the leg to its end in the background
        assert time.monotonic() < deadline, "the prefill leg's stream was not read to its end"
        time.sleep(0.05)


def test_one_token_streamed_waits_for_the_usage_event(gw):
    """max_tokens=1 streamed with usage: prefill's stream is the whole answer, usage included (it comes after the
    token's event), and no decode leg is sent."""
    gw.prefill.behaviour = lambda leg: (200, _prefill_answer(rest_delay_s=0.3), 0.0)
    result = stream_completion(gw.gateway.url + "/v1/completions",
                               {"model": "tiny", "prompt": "x", "max_tokens": 1,
                                "stream_options": {"include_usage": True}}, timeout_s=30)
    assert result.status == 200, result.error
    assert result.text == " sea"
    assert [e["usage"] for e in result.events if e.get("usage")] == [USAGE]
    assert gw.decode.legs == []
    # The cancellation runs while the answer goes out (the client may read [DONE] before it is through).
    transfer_id = result.headers["x-kvpush-transfer-id"]
    deadline = time.monotonic() + 5
    while gw.transfer(transfer_id).state != tpb.TRANSFER_STATE_CANCELLED:
        assert time.monotonic() < deadline, gw.transfer(transfer_id)
        time.sleep(0.02)


def test_one_token_not_streamed_is_prefills_answer_and_cancels_the_transfer(gw):
    """max_tokens=1 without streaming: prefill's answer is the client's; the transfer is cancelled before the
    answer is sent (the handler waits for the cancellation), and no decode leg is sent."""
    completion = {"id": "cmpl-p", "object": "text_completion", "created": 5, "model": "tiny", "usage": USAGE,
                  "choices": [{"index": 0, "text": " sea", "token_ids": [17], "finish_reason": "length",
                               "logprobs": None}], "kv_transfer_params": {"transfer_id": "x"}}
    gw.prefill.behaviour = lambda leg: (200, completion, 0.0)
    answer = call("POST", gw.gateway.url + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1},
                  timeout_s=30)
    assert answer.status == 200, answer.text
    assert answer.body["choices"][0]["text"] == " sea" and answer.body["usage"] == USAGE
    assert "kv_transfer_params" not in answer.body and "token_ids" not in answer.body["choices"][0]
    assert gw.decode.legs == []
    assert gw.transfer(answer.headers["x-kvpush-transfer-id"]).state == tpb.TRANSFER_STATE_CANCELLED


def test_an_error_event_on_the_prefill_leg_keeps_its_status(gw):
    """vLLM ends a started stream with an error event: a 400 there is the client's 400, with its message."""
    gw.prefill.behaviour = lambda leg: (200, {"stream_error": {"message": "bad logit_bias", "code": 400},
                                              "stream_events": []}, 0.0)
    gw.decode.behaviour = lambda leg: (200, {"stream_events": _decode_events((17, " sea"))}, 2.0)
    result = stream_completion(gw.gateway.url + "/v1/completions",
                               {"model": "tiny", "prompt": "x", "max_tokens": 3}, timeout_s=30)
    assert result.status == 400 and "bad logit_bias" in (result.error or ""), result


def test_a_prefill_stream_without_a_token_is_a_502(gw):
    """A prefill leg whose stream ends with no token id (not a vLLM with return_token_ids) is 502, named."""
    gw.prefill.behaviour = lambda leg: (200, {"stream_tokens": ["no ids"]}, 0.0)
    gw.decode.behaviour = lambda leg: (200, {"stream_events": _decode_events((17, " sea"))}, 2.0)
    result = stream_completion(gw.gateway.url + "/v1/completions",
                               {"model": "tiny", "prompt": "x", "max_tokens": 3}, timeout_s=30)
    assert result.status == 502 and "no single token id" in (result.error or ""), result


def test_prefill_eos_ends_the_stream_and_stops_the_decode_leg(gw):
    """A first token that finishes the request (EOS) is the whole answer; the transfer is cancelled before the
    stream ends ([DONE])."""
    gw.prefill.behaviour = lambda leg: (200, _prefill_answer(2, "", "stop"), 0.0)
    gw.decode.behaviour = lambda leg: (200, {"stream_events": _decode_events((2, ""), finish="stop")}, 2.0)
    result = stream_completion(gw.gateway.url + "/v1/completions",
                               {"model": "tiny", "prompt": "x", "max_tokens": 5}, timeout_s=30)
    assert result.status == 200, result.error
    assert [e["choices"][0]["finish_reason"] for e in result.events if e.get("choices")] == ["stop"]
    assert gw.transfer(result.headers["x-kvpush-transfer-id"]).state == tpb.TRANSFER_STATE_CANCELLED


def test_a_decode_leg_failing_before_prefill_returns_is_an_error_status(gw):
    """The decode engine refuses the leg while prefill still computes: the client gets that status, not a stream."""
    gw.prefill.behaviour = lambda leg: (200, _prefill_answer(), 1.0)
    gw.decode.behaviour = lambda leg: (500, {"error": {"message": "decode broke"}}, 0.0)
    result = stream_completion(gw.gateway.url + "/v1/completions",
                               {"model": "tiny", "prompt": "x", "max_tokens": 3}, timeout_s=30)
    assert result.status == 502 and "decode broke" in (result.error or "")
