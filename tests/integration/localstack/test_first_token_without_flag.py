"""First token from prefill with a decode engine started as the README starts one: the kv-transfer-config and
nothing else (no `--logits-processors`). Its registration says it forces prefill's token, and streamed or not,
greedy or seeded, the gateway's answers are token for token the colocated engine's, in a stream of many token
events without an error event.

Engines are this folder's `local_stack` (conftest.py here), whose decode engine gets no logits-processor flag.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpush.localstack.client import call, stream_completion
from kvpush.v1 import types_pb2 as tpb
from tests.integration.localstack.test_pd_gateway import _ids, _transfer

pytestmark = pytest.mark.engines

SAMPLINGS = {
    "greedy": {"temperature": 0.0},
    "seeded": {"temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 4242},
}


def _token_events(result) -> list[list[int]]:
    return [c["token_ids"] for e in result.events for c in e.get("choices", []) if c.get("token_ids")]


def test_the_decode_engine_has_no_flag_and_registers_that_it_forces(local_stack):
    """No --logits-processors on the decode engine's command line; `kvpush engines` shows its capability (and the
    prefill engine's '-'), in the table and in JSON; its log says the processor came in once."""
    for engine in local_stack.engines():
        assert "--logits-processors" not in engine.spec.argv()
    channel = local_stack.directory_channel()
    flags = ["--address", channel.address]
    if channel.root_cert_file:
        flags += ["--tls-root-cert", channel.root_cert_file, "--tls-client-cert", channel.client_cert_file,
                  "--tls-client-key", channel.client_key_file]

    def engines(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvpush.cli.main", "engines", *flags, *args],
                              check=False, capture_output=True, text=True, timeout=60)

    listed = engines("--json")
    assert listed.returncode == 0, listed.stderr
    capability = {(w["engine_id"], w.get("forces_first_token", False)) for w in json.loads(listed.stdout)}
    assert capability == {("prefill-0", False), ("decode-0", True)}
    table = engines().stdout.splitlines()
    column = table[0].split().index("FIRST_TOKEN")
    assert {row.split()[0]: row.split()[column] for row in table[1:]} == {"prefill-0": "-", "decode-0": "forced"}
    decode_log = local_stack.decode.process.log_path.read_text()
    assert decode_log.count("first-token forcing installed") == 1
    assert "stays idle" not in decode_log
    assert "first-token forcing installed" not in local_stack.prefill.process.log_path.read_text()


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_streamed_through_the_gateway_equals_colocated(local_stack, sampling):
    """Streamed with first token from prefill (the transfer carried prefill's token to decode): every token once,
    as many token events as tokens, no error event, the colocated engine's ids and text."""
    body = {"model": "tiny", "prompt": _ids(150, seed=21), "max_tokens": 8, "ignore_eos": True,
            "return_token_ids": True, **SAMPLINGS[sampling]}
    streamed = stream_completion(local_stack.gateway_url + "/v1/completions", body, timeout_s=180)
    reference = call("POST", local_stack.colocated.url + "/v1/completions", body, timeout_s=180)
    assert reference.status == 200, reference.text
    assert streamed.status == 200 and not streamed.error, streamed.error
    assert not [e for e in streamed.events if "error" in e]
    events = _token_events(streamed)
    assert len(events) > 1
    want = reference.body["choices"][0]
    assert [i for ids in events for i in ids] == want["token_ids"]
    assert streamed.text == want["text"]
    transfer = _transfer(local_stack, streamed.headers["x-kvpush-transfer-id"])
    assert transfer.state == tpb.TRANSFER_STATE_COMPLETE, transfer.failure_reason
    assert transfer.HasField("first_token_id") and transfer.first_token_id == want["token_ids"][0]


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_not_streamed_through_the_gateway_equals_colocated(local_stack, sampling):
    body = {"model": "tiny", "prompt": _ids(90, seed=22), "max_tokens": 8, "ignore_eos": True,
            "return_token_ids": True, **SAMPLINGS[sampling]}
    answer = call("POST", local_stack.gateway_url + "/v1/completions", body, timeout_s=180)
    reference = call("POST", local_stack.colocated.url + "/v1/completions", body, timeout_s=180)
    assert answer.status == 200 and reference.status == 200, (answer.text, reference.text)
    assert answer.body["choices"][0]["token_ids"] == reference.body["choices"][0]["token_ids"]
    assert answer.body["choices"][0]["text"] == reference.body["choices"][0]["text"]
