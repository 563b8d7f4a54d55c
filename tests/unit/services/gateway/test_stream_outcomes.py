"""How streams end and how they are counted, against a real directory and gateway with stand-in engines, with and
without first token from prefill: a stream broken after its headers ends with the error event (no [DONE]) and counts
as a failure; a client that closes after the last byte is a success, never an error line; a refused request leaves no
transfer planned; the latency histograms count what was streamed."""

from __future__ import annotations

import http.client
import json
import re
import urllib.request

import pytest

from kvpush.localstack.client import call, stream_completion
from kvpush.localstack.processes import tail
from kvpush.v1 import types_pb2 as tpb
from tests.unit.services.gateway.test_gateway import Deployment

ROUTE = "/v1/completions"


@pytest.fixture(scope="module", params=["first-token", "pass-through"])
def deployment(request, tmp_path_factory, otlp_receiver):
    """A deployment per first-token mode (prefill's token streamed first, or decode's stream passed through)."""
    first = request.param == "first-token"
    deployment = Deployment(tmp_path_factory.mktemp(f"gateway-{request.param}"),
                            otlp_receiver.env("kvpush-gateway-streams"), first_token_from_prefill=first)
    deployment.first_token = first
    yield deployment
    deployment.stop()


@pytest.fixture
def gw(deployment):
    deployment.reset()
    return deployment


def _samples(gw) -> dict[tuple[str, frozenset], float]:
    """Every sample of the gateway's /metrics, by name and label set."""
    with urllib.request.urlopen(gw.gateway.url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        match = re.fullmatch(r"(\w+)(?:\{(.*)\})? (\S+)", line)
        if match:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            samples[(match.group(1), labels)] = float(match.group(3))
    return samples


def _value(samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def _delta(before, after, name: str, **labels: str) -> float:
    return _value(after, name, **labels) - _value(before, name, **labels)


def _mode(gw) -> str:
    return "prefill" if gw.first_token else "decode"


def _prefill_token(token_id: int = 17, text: str = " sea") -> dict:
    """The prefill leg's answer: streamed (first token from prefill) or JSON (its kv_transfer_params), as asked."""
    event = {"id": "cmpl-p", "object": "text_completion", "created": 5, "model": "tiny",
             "choices": [{"index": 0, "text": text, "token_ids": [token_id], "finish_reason": "length",
                          "logprobs": None}]}
    return {"stream_events": [event], **event, "kv_transfer_params": {}}


def _decode_events(*tokens: tuple[int, str]) -> list[dict]:
    return [{"id": "cmpl-d", "object": "text_completion", "choices": [
        {"index": 0, "text": text, "token_ids": [token_id], "logprobs": None,
         "finish_reason": "length" if i == len(tokens) - 1 else None}]} for i, (token_id, text) in enumerate(tokens)]


TOKENS = ((17, " sea"), (18, " wave"), (19, "s"), (20, "!"))


def _script(gw, decode: dict) -> None:
    gw.prefill.behaviour = lambda leg: (200, _prefill_token(), 0.0)
    gw.decode.behaviour = lambda leg: (200, decode, 0.0) if leg.body.get("stream") else (
        200, {"choices": [{"index": 0, "text": " sea waves!", "token_ids": [17, 18, 19, 20]}]}, 0.0)


def _raw_events(url: str, body: dict) -> list[bytes]:
    """The stream's `data:` payloads as sent, [DONE] included."""
    result = stream_completion(url, body, timeout_s=30)
    assert result.status == 200, result.error
    host, port = url.removeprefix("http://").split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", ROUTE, body=json.dumps({**body, "stream": True}),
                     headers={"Content-Type": "application/json"})
        return [line[5:].strip() for line in conn.getresponse().read().split(b"\n") if line.startswith(b"data:")]
    finally:
        conn.close()


def test_a_stream_broken_by_an_engine_error_ends_with_it_and_counts_as_a_failure(gw):
    """Decode streams two tokens, then an error event (then vLLM's [DONE]): the client's stream ends with the error
    event, no [DONE] after it; the request counts 502 (not 200) and once as a stream error; no e2e sample."""
    error = {"message": "engine core died", "type": "InternalServerError", "code": 500}
    events = [*_decode_events(*TOKENS[:2]), {"error": error}]
    _script(gw, {"stream_events": events})
    before = _samples(gw)
    payloads = _raw_events(gw.gateway.url + ROUTE, {"model": "tiny", "prompt": "x", "max_tokens": 4})
    after = _samples(gw)
    assert b"[DONE]" not in payloads, payloads
    assert json.loads(payloads[-1])["error"]["message"].endswith("engine core died")
    texts = [c.get("text") for p in payloads[:-1] for c in json.loads(p).get("choices", [])]
    assert texts == [" sea", " wave"]
    # Two requests were sent (stream_completion, then the raw read): both counted as failures.
    assert _delta(before, after, "kvpush_gateway_requests_total", route=ROUTE, status="502") == 2
    assert _delta(before, after, "kvpush_gateway_requests_total", route=ROUTE, status="200") == 0
    assert _delta(before, after, "kvpush_gateway_stream_errors_total", reason="engine_error") == 2
    assert _delta(before, after, "kvpush_gateway_request_duration_seconds_count",
                  route="completions", mode=_mode(gw)) == 0
    assert "unhandled error" not in tail(gw.gateway.process.log_path, 400)


def test_a_stream_that_stops_before_its_done_is_a_failure(gw):
    """Decode's stream ends after its tokens without [DONE]: the client's stream ends with an error event saying so,
    and the request counts 502 and once as a broken connection."""
    _script(gw, {"stream_events": _decode_events(*TOKENS), "no_done": True})
    before = _samples(gw)
    result = stream_completion(gw.gateway.url + ROUTE, {"model": "tiny", "prompt": "x", "max_tokens": 4},
                               timeout_s=30)
    after = _samples(gw)
    assert result.status == 200 and "ended before [DONE]" in result.error, result.error
    assert "error" in result.events[-1] and result.text == " sea waves!"
    assert _delta(before, after, "kvpush_gateway_requests_total", route=ROUTE, status="502") == 1
    assert _delta(before, after, "kvpush_gateway_stream_errors_total", reason="connection") == 1


def test_a_client_closing_after_its_last_byte_is_a_success(gw):
    """The decode stream stays open 1.5 s after its [DONE]; the client closes as soon as it read [DONE]: the request
    counts 200 with its duration, never 499 or 500, and the gateway logs no error for it."""
    _script(gw, {"stream_events": _decode_events(*TOKENS), "done_linger_s": 1.5})
    before = _samples(gw)
    host, port = gw.gateway.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", ROUTE, body=json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 4, "stream": True}),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    while (line := response.readline()) and not line.startswith(b"data: [DONE]"):
        pass
    assert line.startswith(b"data: [DONE]")
    conn.close()
    for _ in range(50):  # the gateway ends the request when the decode stream ends (1.5 s)
        after = _samples(gw)
        if sum(v for (name, _), v in after.items() if name == "kvpush_gateway_requests_total") > \
                sum(v for (name, _), v in before.items() if name == "kvpush_gateway_requests_total"):
            break
        gw.decode.arrived.wait(0.1)
    assert _delta(before, after, "kvpush_gateway_requests_total", route=ROUTE, status="200") == 1
    for status in ("499", "500"):
        assert _delta(before, after, "kvpush_gateway_requests_total", route=ROUTE, status=status) == 0
    assert _delta(before, after, "kvpush_gateway_request_duration_seconds_count",
                  route="completions", mode=_mode(gw)) == 1
    log = tail(gw.gateway.process.log_path, 400)
    assert "unhandled error" not in log and "Cannot write to closing transport" not in log


def test_latency_histograms_count_streamed_tokens(gw):
    """A streamed request of 4 tokens: one time-to-first-token sample and 3 inter-token samples under its route and
    first-token mode, one duration; a request not streamed: a duration only. Chat counts under its own route."""
    _script(gw, {"stream_events": _decode_events(*TOKENS), "token_delay_s": 0.02})
    before = _samples(gw)
    result = stream_completion(gw.gateway.url + ROUTE, {"model": "tiny", "prompt": "x", "max_tokens": 4},
                               timeout_s=30)
    assert result.status == 200 and not result.error, result.error
    assert result.text == " sea waves!"
    plain = call("POST", gw.gateway.url + ROUTE, {"model": "tiny", "prompt": "x", "max_tokens": 4}, timeout_s=30)
    assert plain.status == 200, plain.text
    after = _samples(gw)
    labels = {"route": "completions", "mode": _mode(gw)}
    assert _delta(before, after, "kvpush_gateway_time_to_first_token_seconds_count", **labels) == 1
    assert _delta(before, after, "kvpush_gateway_inter_token_latency_seconds_count", **labels) == 3
    assert _delta(before, after, "kvpush_gateway_inter_token_latency_seconds_sum", **labels) > 0
    durations = sum(_delta(before, after, "kvpush_gateway_request_duration_seconds_count", route="completions",
                           mode=mode) for mode in ("prefill", "decode"))
    assert durations == 2
    assert _delta(before, after, "kvpush_gateway_time_to_first_token_seconds_count", route="completions",
                  mode="decode" if gw.first_token else "prefill") == 0


def test_a_request_refused_with_a_multi_line_message_leaves_no_transfer_planned(gw):
    """Both engines refuse with vLLM's multi-line validation message: the client gets the 400 with it, and the
    transfer is cancelled (its reason on one line), not left planned."""
    message = ("1 validation error for CompletionRequest\ntemperature\n  Input should be a valid number, unable to "
               "parse string as a number [type=float_parsing, input_value='hot', input_type=str]")
    refusal = (400, {"error": {"message": message, "type": "BadRequestError", "code": 400}}, 0.0)
    gw.prefill.behaviour = gw.decode.behaviour = lambda leg: refusal
    transfer_ids = set()
    for stream in (False, True):
        result = call("POST", gw.gateway.url + ROUTE, {"model": "tiny", "prompt": "x", "max_tokens": 4,
                                                       "temperature": "hot", "stream": stream}, timeout_s=30)
        assert result.status == 400, result.text
        assert "temperature" in result.body["error"]["message"]
        transfer_ids.add(result.headers["x-kvpush-transfer-id"])
        transfer = gw.transfer(result.headers["x-kvpush-transfer-id"])
        assert transfer.state == tpb.TRANSFER_STATE_CANCELLED, tpb.TransferState.Name(transfer.state)
        assert "\n" not in transfer.failure_reason and "temperature" in transfer.failure_reason
    assert not transfer_ids & {t.transfer_id for t in gw.client.list_transfers(state=tpb.TRANSFER_STATE_PLANNED)}
