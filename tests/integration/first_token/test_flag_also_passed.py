"""A decode engine started the old way, with `--logits-processors kvpush.connector.first_token:ForcePrefillFirstToken`
as well as kvpush installed (whose entry point loads the same processor): it starts, registers that it forces
the first token, its log shows the processor forcing once (the second copy idle), and a request naming a first
token starts with it under sampling and continues greedily as a colocated engine given prompt + that token.
"""

from __future__ import annotations

import random

import pytest

from kvpush.client import ChannelConfig, SyncDirectoryClient
from kvpush.localstack.client import call
from kvpush.localstack.processes import EngineSpec, free_port, launch_engine
from kvpush.localstack.stack import FIRST_TOKEN_FLAG_ARGS, kv_transfer_config

pytestmark = pytest.mark.engines

ENGINE_ID = "decode-with-flag"
READY_TIMEOUT_S = 480.0


@pytest.fixture(scope="module")
def flagged_decode(tiny_model_dir, kv_directory, otlp_receiver, session_log_dir):
    """A KVPushConnector decode engine registered at the session directory, started with the flag."""
    port = free_port()
    engine = launch_engine(EngineSpec(
        name="decode-with-flag", model_dir=tiny_model_dir, port=port, env=otlp_receiver.env("kvpush-decode-flag"),
        kv_transfer_config=kv_transfer_config("kvpush", "decode", engine_id=ENGINE_ID,
                                              directory_address=kv_directory.address,
                                              engine_endpoint=f"http://127.0.0.1:{port}"),
        extra_args=FIRST_TOKEN_FLAG_ARGS), session_log_dir)
    try:
        engine.wait_ready(READY_TIMEOUT_S)
        yield engine
    finally:
        engine.stop(grace_s=15.0)


def _greedy(prompt: list[int], max_tokens: int) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}


def test_the_flag_and_the_entry_point_force_once(flagged_decode, colocated_engine, kv_directory):
    client = SyncDirectoryClient(ChannelConfig(address=kv_directory.address, timeout_s=5.0))
    try:
        (worker,) = [w for w in client.list_engines() if w.engine_id == ENGINE_ID]
    finally:
        client.close()
    assert worker.forces_first_token
    log = flagged_decode.process.log_path.read_text()
    assert log.count("first-token forcing installed") == 1
    assert log.count("this copy stays idle") == 1  # the entry point's copy or the flag's: the other one
    assert "--logits-processors" in flagged_decode.spec.argv()

    rng = random.Random(31)
    prompt = [rng.randrange(3, 1024) for _ in range(40)]
    argmax = call("POST", colocated_engine.url + "/v1/completions", _greedy(prompt, 1), timeout_s=120)
    forced = (argmax.body["choices"][0]["token_ids"][0] + 7) % 500 + 3  # anything but the argmax
    sampled = {**_greedy(prompt, 4), "temperature": 0.9, "top_p": 0.8, "seed": 5,
               "kv_transfer_params": {"first_token_id": forced}}
    result = call("POST", flagged_decode.url + "/v1/completions", sampled, timeout_s=120)
    assert result.status == 200, result.text
    assert result.body["choices"][0]["token_ids"][0] == forced
    via_decode = call("POST", flagged_decode.url + "/v1/completions",
                      {**_greedy(prompt, 6), "kv_transfer_params": {"first_token_id": forced}}, timeout_s=120)
    reference = call("POST", colocated_engine.url + "/v1/completions", _greedy(prompt + [forced], 5), timeout_s=120)
    assert via_decode.body["choices"][0]["token_ids"] == [forced] + reference.body["choices"][0]["token_ids"]
