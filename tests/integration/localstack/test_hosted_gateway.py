"""The gateway hosted in the prefill engine's API server (vLLM `--middleware`, `kvpush.gateway.hosted`), in
front of the same real engines as the standalone gateway: outputs equal the colocated engine's, its prefill legs
go to the engine it runs in, its spans come from that engine's process, vLLM's own routes are untouched. (Greedy
outputs through it: test_pd_gateway.py's `test_disaggregated_output_equals_colocated`, for both gateways.)

Engines are this folder's `local_stack` (conftest.py: `hosted_gateway=True`).
"""

from __future__ import annotations

import pytest

from kvpush.localstack.client import call, stream_completion
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import settled_transfer
from tests.integration.localstack.test_pd_gateway import _ids, _transfer

pytestmark = pytest.mark.engines


def test_streamed_first_token_through_the_hosted_gateway(local_stack, otlp_receiver):
    """Streamed with first token from prefill: every token once, equal to colocated's; the gateway's spans come from
    the prefill engine's processes (its service name), in one trace with the push."""
    body = {"model": "tiny", "prompt": _ids(200, seed=61), "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    streamed = stream_completion(local_stack.hosted_gateway_url + "/v1/completions", body, timeout_s=180)
    reference = call("POST", local_stack.colocated.url + "/v1/completions", body, timeout_s=180)
    assert streamed.status == 200 and not streamed.error, streamed.error
    ids = [i for e in streamed.events for c in e.get("choices", []) for i in c.get("token_ids") or []]
    assert ids == reference.body["choices"][0]["token_ids"]
    transfer_id = streamed.headers["x-kvpush-transfer-id"]
    transfer = settled_transfer(lambda tid: _transfer(local_stack, tid), transfer_id)
    assert transfer.state == tpb.TRANSFER_STATE_COMPLETE, transfer.failure_reason
    assert transfer.first_token_id == ids[0]

    def request_leg_and_push(spans):
        requests = [s for s in spans if s.name == "gateway.request" and s.attributes.get("kvpush.transfer_id")
                    == transfer_id]
        traced = [s for s in spans if requests and s.trace_id == requests[0].trace_id]
        legs = [s for s in traced if s.name == "gateway.prefill_leg"]
        pushes = [s for s in traced if s.name == "kvpush.push"]
        return (requests[0], legs[0], pushes[0]) if requests and legs and pushes else None

    request, leg, push = request_leg_and_push(otlp_receiver.wait_for(request_leg_and_push, 30))
    assert request.service_name == push.service_name == "kvpush-prefill"
    assert leg.attributes["kvpush.in_process"] is True  # into vLLM's app, no HTTP (in_process)
    assert push.parent_span_id == leg.span_id


def test_bad_requests_get_the_gateways_errors_and_vllm_keeps_its_routes(local_stack):
    """A request the gateway refuses gets its 4xx with a message on the hosted port; on vLLM's port of the same
    process vLLM's own API answers as before."""
    missing = call("POST", local_stack.hosted_gateway_url + "/v1/completions", {"model": "tiny"}, timeout_s=30)
    assert missing.status == 400 and "prompt" in missing.body["error"]["message"]
    unknown = call("POST", local_stack.hosted_gateway_url + "/v1/completions",
                   {"model": "no-such-model", "prompt": [5, 6], "max_tokens": 2}, timeout_s=30)
    assert unknown.status == 404 and "no-such-model" in unknown.body["error"]["message"]
    models = call("GET", local_stack.prefill.url + "/v1/models", timeout_s=30)
    assert models.status == 200 and [m["id"] for m in models.body["data"]] == ["tiny"]
    assert call("GET", local_stack.hosted_gateway_url + "/health", timeout_s=30).status == 200


def test_an_in_process_leg_keeps_vllms_errors_and_the_transfer_ends(local_stack):
    """A prompt over the context length: vLLM's 400 with its message comes back through the in-process leg, and the
    transfer ends (cancelled or failed), as through the standalone gateway."""
    result = call("POST", local_stack.hosted_gateway_url + "/v1/completions",
                  {"model": "tiny", "prompt": _ids(5000, seed=70), "max_tokens": 4, "stream": True}, timeout_s=60)
    assert result.status == 400, result.text
    assert "4096" in result.body["error"]["message"]
    transfer_id = result.headers.get("x-kvpush-transfer-id")
    if transfer_id:
        transfer = settled_transfer(lambda tid: _transfer(local_stack, tid), transfer_id)
        assert transfer.state in (tpb.TRANSFER_STATE_CANCELLED, tpb.TRANSFER_STATE_FAILED)
