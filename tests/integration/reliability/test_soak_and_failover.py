"""The soak's CI form on real engines, then gateway failover with one of two decode engines SIGKILLed.

Order matters (one shared stack, conftest.py): the soak leaves every engine up; the failover test kills one.
"""

from __future__ import annotations

import json
import random
import time

import pytest

from kvpush.client import SyncDirectoryClient
from kvpush.localstack.client import call, stream_completion

pytestmark = pytest.mark.engines


def test_short_soak_ends_every_request_and_leaks_nothing(soak, soak_stack, tmp_path):
    """A small soak with a directory SIGKILL+restart and client aborts: the JSON has its form, no request hung,
    none was corrupt, nothing leaked, and it took at most 90 s."""
    started = time.monotonic()
    result = soak.run_soak(soak_stack, count=60, rate=4.0, concurrency=4, seed=7, faults=["directory-kill"],
                           fault_interval_s=4.0, abort_share=0.1, request_bound_s=60.0, sample_s=1.0)
    took = time.monotonic() - started
    out = tmp_path / "soak.json"
    out.write_text(json.dumps(result))
    soak.plot(json.loads(out.read_text()), out.with_suffix(".png"))
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(result["outcomes"]) == {"completed", "failed", "aborted", "hung"}
    assert sum(result["outcomes"].values()) == 60
    assert result["hung"] == 0, result["outcomes"]
    assert result["corrupt"] == 0
    assert result["leaked"] == 0, result["leaks"]
    assert result["checked_token_identical"] == result["outcomes"]["completed"] > 0
    assert result["fault_counts"].get("directory-kill", 0) >= 1, result["faults_injected"]
    assert all(e.get("reregistered") for e in result["faults_injected"]), result["faults_injected"]
    for name in ("directory", "gateway", "prefill", "decode", "decode-1"):
        assert name in result["memory"], result["memory"].keys()
        assert result["memory"][name]["lives"][0]["sample_count"] >= 2
    assert took <= 90, f"the CI soak took {took:.0f} s"


def _samples(stack, name: str) -> dict[str, float]:
    text = call("GET", stack.gateway_url + "/metrics", timeout_s=10).text
    return {line.rpartition(" ")[0]: float(line.rpartition(" ")[2]) for line in text.splitlines()
            if line.startswith(name)}


def test_a_sigkilled_decode_engine_fails_over_token_identical(soak, soak_stack):
    """SIGKILL the decode engine the directory plans first: every new request within its lease (30 s) still
    succeeds, on the other decode engine, token-identical to the colocated engine; the gateway counted a
    failover, and the directory lists the dead engine unreachable."""
    stack = soak_stack
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 1024) for _ in range(n)] for n in (5, 40, 130, 300, 17, 64)]
    wants = soak.references(stack.colocated.url, prompts)
    operator = SyncDirectoryClient(stack.directory_channel(timeout_s=5.0, max_attempts=2))
    try:
        probe = operator.plan_transfer(model="tiny").transfer  # the directory's first choice now
        operator.cancel_transfer(probe.transfer_id, "probe")
        planned = probe.decode_engine_id
        victim = next(e for e in stack.decodes if e.spec.kv_transfer_config["engine_id"] == planned)
        survivor = next(e for e in stack.decodes if e is not victim)
        before = sum(_samples(stack, "kvpush_gateway_failovers_total").values())
        stack.kill(victim)
        killed_at = time.monotonic()
        for index, (prompt, want) in enumerate(zip(prompts, wants)):
            body = soak.body_of(prompt)
            if index % 2:
                result = stream_completion(stack.gateway_url + "/v1/completions", body, timeout_s=120)
                assert result.status == 200 and not result.error, (result.status, result.error)
                ids = [i for e in result.events for c in e.get("choices", []) for i in c.get("token_ids") or []]
                transfer_id = result.headers["x-kvpush-transfer-id"]
            else:
                result = call("POST", stack.gateway_url + "/v1/completions", body, timeout_s=120)
                assert result.status == 200, result.text
                ids = result.body["choices"][0]["token_ids"]
                transfer_id = result.headers["x-kvpush-transfer-id"]
            assert ids == want, f"prompt {index}"
            assert operator.get_transfer(transfer_id).decode_engine_id == survivor.spec.kv_transfer_config["engine_id"]
        assert time.monotonic() - killed_at < 30, "the requests must have run within the dead engine's lease"
        assert sum(_samples(stack, "kvpush_gateway_failovers_total").values()) >= before + 1
        dead = operator.get_engine(planned)[0]
        assert dead.HasField("unreachable_time"), dead
    finally:
        operator.close()
