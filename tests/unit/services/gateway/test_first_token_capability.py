"""The gateway serves the first token from prefill only through decode engines that register `forces_first_token`:
with one that does not, first token on (the default) still gives a whole, unbroken answer, all of it decode's."""

from __future__ import annotations

import pytest

from kvpush.localstack.client import call, stream_completion
from kvpush.v1 import types_pb2 as tpb
from tests.unit.services.gateway.test_first_token_gateway import _decode_events, _prefill_answer
from tests.unit.services.gateway.test_gateway import Deployment, register_standin


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, otlp_receiver):
    deployment = Deployment(tmp_path_factory.mktemp("gateway-no-forcing"), otlp_receiver.env("kvpush-gateway-nf"),
                            first_token_from_prefill=True, decode_forces_first_token=False)
    yield deployment
    deployment.stop()


@pytest.fixture
def gw(deployment):
    deployment.reset()
    return deployment


def _token_ids(result) -> list[int]:
    return [i for e in result.events for c in e.get("choices", []) for i in c.get("token_ids") or []]


def test_the_directory_lists_the_decode_engine_without_the_capability(gw):
    """What the gateway decides by: the decode worker as registered (false), as ListEngines returns it."""
    decode = [w for w in gw.client.list_engines() if w.role == tpb.ENGINE_ROLE_DECODE]
    assert [(w.engine_id, w.forces_first_token) for w in decode] == [("standin-decode", False)]


def test_a_streamed_request_is_decodes_whole_stream(gw):
    """Decode samples a first token (42) other than prefill's (17): no leg asks for first token from prefill, the
    prefill leg is the plain one (not streamed, no token asked for), and the client gets decode's every token, with
    no error event (with first token used here, decode's 42 would have cut the stream after prefill's 17)."""
    gw.prefill.behaviour = lambda leg: (200, {"choices": [{"index": 0, "text": " sea", "token_ids": [17]}],
                                              "kv_transfer_params": {}}, 0.0)
    gw.decode.behaviour = lambda leg: (200, {"stream_events": _decode_events((42, " land"), (18, " wave"), (19, "s"))},
                                       0.1)
    result = stream_completion(gw.gateway.url + "/v1/completions",
                               {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "return_token_ids": True},
                               timeout_s=30)
    assert result.status == 200 and not result.error, result.error
    assert _token_ids(result) == [42, 18, 19] and result.text == " land waves"
    (p_leg,), (d_leg,) = gw.prefill.legs, gw.decode.legs
    assert "first_token_from_prefill" not in p_leg.body["kv_transfer_params"]
    assert "first_token_from_prefill" not in d_leg.body["kv_transfer_params"]
    assert not p_leg.body.get("stream")
    assert p_leg.body["kv_transfer_params"]["transfer_id"] == d_leg.body["kv_transfer_params"]["transfer_id"]


def test_one_token_requests_go_to_decode_too(gw):
    """max_tokens=1 is not answered from prefill alone either: decode's token is the answer."""
    gw.prefill.behaviour = lambda leg: (200, {"choices": [{"index": 0, "text": " sea", "token_ids": [17]}],
                                              "kv_transfer_params": {}}, 0.0)
    gw.decode.behaviour = lambda leg: (200, {"id": "cmpl-d", "object": "text_completion", "model": "tiny",
                                             "choices": [{"index": 0, "text": " land", "token_ids": [42],
                                                          "finish_reason": "length"}]}, 0.0)
    result = call("POST", gw.gateway.url + "/v1/completions",
                  {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1, "return_token_ids": True}, timeout_s=30)
    assert result.status == 200, result.text
    assert result.body["choices"][0]["token_ids"] == [42]
    assert len(gw.decode.legs) == 1


def test_an_early_prefill_leg_for_a_decode_engine_that_stopped_forcing(tmp_path, otlp_receiver):
    """The gateway's engine list (cached) still says the decode engine forces, so the prefill leg leaves before the
    plan in first-token mode; the plan says the engine, registered again, no longer does: the request is decode's
    whole answer, with no error event, although its prefill leg asked for the token."""
    deployment = Deployment(tmp_path, otlp_receiver.env("kvpush-gateway-nf2"), first_token_from_prefill=True)
    try:
        deployment.prefill.behaviour = lambda leg: (200, _prefill_answer(), 0.0)
        deployment.decode.behaviour = lambda leg: (200, {"stream_events": _decode_events((17, " sea"), (18, " wave"))},
                                                   0.0)
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "return_token_ids": True}
        warm = stream_completion(deployment.gateway.url + "/v1/completions", body, timeout_s=30)
        assert warm.status == 200 and _token_ids(warm) == [17, 18], warm.error  # first token from prefill
        deployment.client.run(deployment.registrations["decode"].stop())
        register_standin(deployment.client, "decode", tpb.ENGINE_ROLE_DECODE, deployment.decode.url,
                         forces_first_token=False)
        deployment.reset()
        deployment.prefill.behaviour = lambda leg: (200, _prefill_answer(), 0.0)
        deployment.decode.behaviour = lambda leg: (200, {"stream_events": _decode_events((42, " land"), (18, " wave"))},
                                                   0.0)
        result = stream_completion(deployment.gateway.url + "/v1/completions", body, timeout_s=30)
        assert result.status == 200 and not result.error, result.error
        assert _token_ids(result) == [42, 18] and result.text == " land wave"
        (p_leg,), (d_leg,) = deployment.prefill.legs, deployment.decode.legs
        assert p_leg.body["kv_transfer_params"]["first_token_from_prefill"] is True  # sent before the plan
        assert "first_token_from_prefill" not in d_leg.body["kv_transfer_params"]
    finally:
        deployment.stop()
