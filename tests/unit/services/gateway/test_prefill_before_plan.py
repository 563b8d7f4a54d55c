"""Prefill before plan: the gateway picks the prefill engine and names the transfer, so the prefill leg leaves
with PlanTransfer instead of after it. A real gateway and directory, stand-in engines.

The pick is the directory's own choice as the engine list tells it; a pick the directory refuses (here an
engine whose KV layout no decode engine shares) costs the early leg, and the request is planned the usual way.
The directory's side (readiness held for the plan) runs with real engines in tests/integration/connector.
"""

from __future__ import annotations

import time

import pytest

from kvpush.client import ChannelConfig, SyncDirectoryClient
from kvpush.localstack.client import call
from kvpush.localstack.processes import start_directory, start_gateway
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb
from tests.unit.services.gateway.standin import StandInEngine
from tests.unit.services.gateway.test_failover import _metric
from tests.unit.services.gateway.test_gateway import _layout

# Sorted first, so the gateway picks it while both are idle; no decode engine shares its layout.
MISFIT, PREFILL, DECODE = "standin-a-misfit", "standin-prefill", "standin-decode"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("prefill-before-plan")
    directory = start_directory(log_dir)
    client = SyncDirectoryClient(ChannelConfig(address=directory.address, timeout_s=5.0))
    engines = {}
    for engine_id, role in ((PREFILL, tpb.ENGINE_ROLE_PREFILL), (DECODE, tpb.ENGINE_ROLE_DECODE)):
        engines[engine_id] = StandInEngine(engine_id).start()
        client.start_registration(dpb.RegisterEngineRequest(
            engine_id=engine_id, role=role, tp_rank=0, tp_size=1, agent_name=f"agent-{engine_id}",
            agent_metadata=b"standin-metadata", layout=_layout(), endpoint=engines[engine_id].url, model="tiny"))
    gateways = [start_gateway(log_dir, directory_address=directory.address, name=f"gateway-{flag}",
                              extra_args=["--no-first-token-from-prefill", flag])
                for flag in ("--prefill-before-plan", "--no-prefill-before-plan")]
    yield client, directory, engines, gateways
    for gateway in gateways:
        gateway.process.stop(grace_s=5.0)
    client.close()
    directory.process.stop(grace_s=5.0)
    for engine in engines.values():
        engine.stop()


def _reset(engines) -> None:
    for engine in engines.values():
        engine.legs.clear()
        engine.behaviour = None


def test_the_prefill_leg_names_the_planned_transfer_and_says_its_plan_is_in_flight(stack):
    client, _, engines, (early, usual) = stack
    _reset(engines)
    answer = call("POST", early.url + "/v1/completions", {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4})
    assert answer.status == 200, answer.text
    (p_leg,), (d_leg,) = engines[PREFILL].legs, engines[DECODE].legs
    transfer_id = answer.headers["x-kvpush-transfer-id"]
    assert p_leg.body["kv_transfer_params"]["plan_in_flight"] is True
    assert p_leg.body["kv_transfer_params"]["transfer_id"] == d_leg.body["kv_transfer_params"]["transfer_id"] \
        == transfer_id
    assert "plan_in_flight" not in d_leg.body["kv_transfer_params"]
    transfer = client.get_transfer(transfer_id)
    assert transfer.prefill_engine_id == PREFILL and transfer.decode_engine_id == DECODE
    assert _metric(early.url, "kvpush_gateway_prefill_before_plan_total", outcome="planned") == 1
    _reset(engines)
    answer = call("POST", usual.url + "/v1/completions", {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4})
    assert answer.status == 200, answer.text
    assert "plan_in_flight" not in engines[PREFILL].legs[0].body["kv_transfer_params"]
    assert _metric(usual.url, "kvpush_gateway_prefill_before_plan_total", outcome="planned") == 0


def test_a_pick_the_directory_refuses_is_planned_the_usual_way(stack):
    client, _, engines, (early, _) = stack
    misfit = StandInEngine(MISFIT).start()
    engines[MISFIT] = misfit
    layout = _layout()
    layout.compatibility_hash = "another-model"
    registration = client.start_registration(dpb.RegisterEngineRequest(
        engine_id=MISFIT, role=tpb.ENGINE_ROLE_PREFILL, tp_rank=0, tp_size=1, agent_name="agent-misfit",
        agent_metadata=b"standin-metadata", layout=layout, endpoint=misfit.url, model="tiny"))
    try:
        _reset(engines)
        # The gateway's engine list is at most 2 s old: within a few requests it lists the misfit, and picks it.
        for _ in range(40):
            answer = call("POST", early.url + "/v1/completions", {"model": "tiny", "prompt": [5, 6], "max_tokens": 2})
            assert answer.status == 200, answer.text
            if _metric(early.url, "kvpush_gateway_prefill_before_plan_total", outcome="replanned"):
                break
            time.sleep(0.2)
        assert _metric(early.url, "kvpush_gateway_prefill_before_plan_total", outcome="replanned") >= 1
        assert client.get_transfer(answer.headers["x-kvpush-transfer-id"]).prefill_engine_id == PREFILL
        assert engines[PREFILL].legs[-1].body["kv_transfer_params"]["transfer_id"] \
            == answer.headers["x-kvpush-transfer-id"]
    finally:
        client.run(registration.stop(deregister=True))
        misfit.stop()
        del engines[MISFIT]


def test_a_gateway_beside_a_prefill_engine_sends_its_legs_there(stack, tmp_path):
    """`--local-prefill-engine` (a gateway hosted in that engine's API server): its legs go to that engine, though
    an idle engine that sorts before it is listed too; the plan pins it."""
    client, directory, engines, _ = stack
    local_id = "standin-prefill-z"  # after PREFILL: the least-loaded rule alone would pick PREFILL
    local = StandInEngine(local_id).start()
    engines[local_id] = local
    registration = client.start_registration(dpb.RegisterEngineRequest(
        engine_id=local_id, role=tpb.ENGINE_ROLE_PREFILL, tp_rank=0, tp_size=1, agent_name=f"agent-{local_id}",
        agent_metadata=b"standin-metadata", layout=_layout(), endpoint=local.url, model="tiny"))
    beside = start_gateway(tmp_path, directory_address=directory.address, name="gateway-beside",
                           extra_args=["--no-first-token-from-prefill", "--local-prefill-engine", local_id])
    try:
        _reset(engines)
        for _ in range(3):
            answer = call("POST", beside.url + "/v1/completions", {"model": "tiny", "prompt": [5, 6], "max_tokens": 2})
            assert answer.status == 200, answer.text
            assert client.get_transfer(answer.headers["x-kvpush-transfer-id"]).prefill_engine_id == local_id
        assert len(local.legs) == 3 and not engines[PREFILL].legs
        assert _metric(beside.url, "kvpush_gateway_prefill_before_plan_total", outcome="planned") == 3
    finally:
        beside.process.stop(grace_s=5.0)
        client.run(registration.stop(deregister=True))
        local.stop()
        del engines[local_id]
