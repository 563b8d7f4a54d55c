"""Real vLLM engines (CPU, tiny model) with KVPushConnector and the gateway against two directory replicas.

The connector and the gateway get both replicas' addresses and nothing else: the client library finds
they are replicas (GetReplicas), opens a prefill session and a watch on each and routes by shard. Greedy
outputs through the gateway equal a colocated engine's before and after one replica is SIGKILLed, every
transfer COMPLETE, and the engines never re-register (their etcd leases move to the surviving replica).
The colocated reference starts after the P/D engines stopped, so at most two engines run at once.
"""

from __future__ import annotations

import random
import signal
import time

import pytest

from kvpush.client import ChannelConfig, SyncDirectoryClient
from kvpush.localstack.client import call
from kvpush.localstack.processes import EngineSpec, free_port, launch_engine, start_directory, start_gateway
from kvpush.localstack.stack import DECODE_ENGINE_ARGS, DECODE_ENGINE_ID, PREFILL_ENGINE_ID, kv_transfer_config
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import settled_transfer

pytestmark = pytest.mark.engines
SESSION_TTL_S = 2


def _greedy(prompt_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    return {"model": "tiny", "prompt": [rng.randrange(3, 1024) for _ in range(prompt_tokens)], "max_tokens": 8,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}


def test_engines_and_gateway_survive_a_replica_kill(etcd, tiny_model_dir, tmp_path):
    directories = []
    for index in range(2):
        log_dir = tmp_path / f"r{index}"
        log_dir.mkdir()
        directories.append(start_directory(log_dir, extra_args=[
            "--lease-ttl-s", "30", "--etcd-endpoints", etcd.endpoint, "--replica-id", f"r{index}",
            "--shard-count", "8", "--session-ttl-s", str(SESSION_TTL_S)]))
    addresses = ",".join(d.address for d in directories)
    engines, gateway = [], None
    client = None
    try:
        client = SyncDirectoryClient(ChannelConfig(address=addresses, timeout_s=5.0))
        deadline = time.monotonic() + 30
        while not all(client.run(client.client.get_replicas()).shard_owner_replica_ids):
            assert time.monotonic() < deadline, "replicas never took every shard"
            time.sleep(0.2)
        prefill_port, decode_port = free_port(), free_port()
        env = {"UCX_NET_DEVICES": "lo"}
        engines.append(launch_engine(EngineSpec(
            name="prefill", port=prefill_port, model_dir=tiny_model_dir, env=env,
            kv_transfer_config=kv_transfer_config("kvpush", "prefill", engine_id=PREFILL_ENGINE_ID,
                                                  directory_address=addresses,
                                                  engine_endpoint=f"http://127.0.0.1:{prefill_port}")), tmp_path))
        engines.append(launch_engine(EngineSpec(
            name="decode", port=decode_port, model_dir=tiny_model_dir, env=env, extra_args=DECODE_ENGINE_ARGS,
            kv_transfer_config=kv_transfer_config("kvpush", "decode", engine_id=DECODE_ENGINE_ID,
                                                  directory_address=addresses,
                                                  engine_endpoint=f"http://127.0.0.1:{decode_port}")), tmp_path))
        for engine in engines:
            engine.wait_ready(600)
        gateway = start_gateway(tmp_path, directory_address=addresses)
        bodies = [_greedy(n, seed=n) for n in (5, 128, 300)]

        def through_gateway() -> list[list[int]]:
            outputs = []
            for body in bodies:
                answer = call("POST", gateway.url + "/v1/completions", body, timeout_s=180)
                assert answer.status == 200, answer.text
                # via its owner
                transfer = settled_transfer(client.get_transfer, answer.headers["x-kvpush-transfer-id"])
                assert transfer.state == tpb.TRANSFER_STATE_COMPLETE, transfer.failure_reason
                outputs.append(answer.body["choices"][0]["token_ids"])
            return outputs

        before = through_gateway()
        registered = {w.engine_id: w.register_time.ToNanoseconds() for w in client.list_engines()}
        directories[0].process.popen.send_signal(signal.SIGKILL)
        directories[0].process.popen.wait(10)
        time.sleep(SESSION_TTL_S + 2)  # the survivor takes every shard
        after = through_gateway()
        assert after == before
        now_registered = {w.engine_id: w.register_time.ToNanoseconds() for w in client.list_engines()}
        assert now_registered == registered, "an engine re-registered instead of its lease being taken over"
    finally:
        if gateway is not None:
            gateway.process.stop(grace_s=5)
        for engine in engines:
            engine.stop()
        if client is not None:
            client.close()
        for directory in directories:
            directory.process.stop(grace_s=5)
    colocated = launch_engine(EngineSpec(name="colocated", model_dir=tiny_model_dir), tmp_path)
    try:
        colocated.wait_ready(600)
        for body, tokens in zip(bodies, before):
            reference = call("POST", colocated.url + "/v1/completions", body, timeout_s=180)
            assert reference.status == 200, reference.text
            assert reference.body["choices"][0]["token_ids"] == tokens
    finally:
        colocated.stop()
