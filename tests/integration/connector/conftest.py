"""Real-engine P/D fixtures for the connector: directory, prefill, decode, a victim prefill and a reference engine.

One session-scoped `ConnectorStack` starts, in parallel, on 127.0.0.1:
  * `prefill` and `decode`: vLLM CPU engines with KVPushConnector, chunked prefill (max_num_batched_tokens
    = 256, so long prompts take several steps), prefix caching on, decode with kv_load_failure_policy
    "recompute";
  * `victim`: a second prefill engine whose writer stalls after its first writes (fault injection), for
    the test that kills a prefill engine mid-transfer;
  * `colocated`: a plain engine with the same chunking, the reference for greedy outputs.
Engines keep vLLM's stats on, so /metrics shows KV-cache usage (the leak check). They export spans to
the session OTLP receiver. Helpers plan transfers at the directory and send both legs concurrently.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvpush.client.config import ChannelConfig
from kvpush.client.sync import SyncDirectoryClient
from kvpush.localstack.client import call
from kvpush.localstack.model import TinyModelSpec, ensure_tiny_model
from kvpush.localstack.processes import EngineHandle, EngineSpec, free_port, launch_engine, start_directory
from kvpush.localstack.stack import kv_transfer_config
from kvpush.localstack.vllm_bench import kv_cache_usage, wait_kv_usage_zero
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures import metrics
from tests.fixtures.directory import wait_for_transfer

BLOCK_SIZE = 128
MAX_BATCHED_TOKENS = 256
# Generous bounds: the 2-core machine is shared with other suites and benchmarks (load averages of 30+
# were seen), so a healthy transfer can take seconds. The failure tests assert on these bounds.
LEASE_TTL_S = 15.0
TRANSFER_TIMEOUT_S = 60.0
PUSH_TIMEOUT_S = 90.0
READY_TIMEOUT_S = 600.0
# Decode's wait for a leg's prefill to start before allocating (the connector's default); the environment variable
# runs this suite with another value, 0 for none (allocation at once, as the leg arrives).
DECODE_ALLOCATION_WAIT_S = float(os.environ.get("KVPUSH_TEST_DECODE_ALLOCATION_WAIT_S", "10"))
PREFILL_ID = "conn-prefill"
DECODE_ID = "conn-decode"
VICTIM_ID = "conn-victim"
# A 4-layer model makes per-layer streaming visible; the rest is the session's tiny Llama.
MODEL_SPEC = TinyModelSpec(num_layers=4)
_ALLOCATED_OR_LATER = {tpb.TRANSFER_STATE_ALLOCATED, tpb.TRANSFER_STATE_STREAMING, tpb.TRANSFER_STATE_COMPLETE,
                       tpb.TRANSFER_STATE_FAILED, tpb.TRANSFER_STATE_CANCELLED, tpb.TRANSFER_STATE_EXPIRED}


def _engine_args(prefix_caching: bool) -> list[str]:
    return ["--block-size", str(BLOCK_SIZE), "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS),
            "--max-num-seqs", "32"]


def _kvpush_spec(name: str, role: str, engine_id: str, model_dir: Path, directory: str, env: dict[str, str],
                 extra: dict[str, Any] | None = None, policy: str | None = None) -> EngineSpec:
    port = free_port()
    config = kv_transfer_config("kvpush", role, engine_id=engine_id, directory_address=directory,
                                engine_endpoint=f"http://127.0.0.1:{port}",
                                extra={"transfer_timeout_s": TRANSFER_TIMEOUT_S, "push_timeout_s": PUSH_TIMEOUT_S,
                                       **(extra or {})})
    if policy:
        config["kv_load_failure_policy"] = policy
    # All engines of these tests are on one host: keep UCX on loopback (shared-memory transports unaffected).
    env = {"UCX_NET_DEVICES": "lo", **env}
    return EngineSpec(name=name, model_dir=model_dir, port=port, kv_transfer_config=config, env=env,
                      enable_prefix_caching=True, extra_args=_engine_args(True), log_stats=True)


@dataclass
class ConnectorStack:
    """The running engines plus a directory client for planning and inspecting transfers."""

    directory_address: str
    prefill: EngineHandle
    decode: EngineHandle
    victim: EngineHandle
    colocated: EngineHandle
    directory: SyncDirectoryClient
    model_dir: Path
    directory_metrics_url: str
    _reference_cache: dict[tuple, list[int]] = field(default_factory=dict)

    # ---------------------------------------------------------------- requests

    def complete(self, engine: EngineHandle, prompt: list[int], max_tokens: int, params: dict | None = None,
                 timeout_s: float = 240.0) -> dict:
        """POST /v1/completions with token ids; return the JSON body (asserting HTTP 200)."""
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "return_token_ids": True, "ignore_eos": True}
        if params is not None:
            body["kv_transfer_params"] = params
        result = call("POST", engine.url + "/v1/completions", body, timeout_s=timeout_s)
        assert result.status == 200, f"{engine.spec.name} answered {result.status}: {result.text[:500]}"
        return result.body

    def reference(self, prompt: list[int], max_tokens: int) -> list[int]:
        """Greedy tokens of the colocated engine (cached per prompt)."""
        key = (tuple(prompt), max_tokens)
        if key not in self._reference_cache:
            body = self.complete(self.colocated, prompt, max_tokens)
            self._reference_cache[key] = list(body["choices"][0]["token_ids"])
        return self._reference_cache[key]

    def plan(self, prompt_len: int, prefill_id: str = PREFILL_ID) -> str:
        """PlanTransfer pinned to (prefill_id, decode); returns the transfer id."""
        response = self.directory.plan_transfer(prompt_token_count=prompt_len, prefill_engine_id=prefill_id,
                                                decode_engine_id=DECODE_ID)
        return response.transfer.transfer_id

    def disaggregated(self, prompt: list[int], max_tokens: int, prefill: EngineHandle | None = None,
                      prefill_id: str = PREFILL_ID, decode_first: bool = False) -> tuple[dict, dict, str]:
        """Plan, then send the prefill and decode legs at the same time; return (prefill body, decode body, id).

        decode_first: send the prefill leg only once decode's allocation reached the directory, so the push
        instruction can only depend on prefill's first readiness (a test of streaming, not of the race).
        """
        transfer_id = self.plan(len(prompt), prefill_id)
        prefill = prefill or self.prefill
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            d_leg = pool.submit(self.complete, self.decode, prompt, max_tokens,
                                {"transfer_id": transfer_id, "do_remote_prefill": True})
            if decode_first:
                allocated = self.wait_transfer(transfer_id, _ALLOCATED_OR_LATER)
                assert allocated.state in _ALLOCATED_OR_LATER, f"decode never allocated: {allocated}"
            p_leg = pool.submit(self.complete, prefill, prompt, 1,
                                {"transfer_id": transfer_id, "do_remote_decode": True})
            return p_leg.result(), d_leg.result(), transfer_id

    def directory_metric(self, name: str, **labels: str) -> float:
        """One of the directory's metrics now (summed over samples with `labels`)."""
        return metrics.value(metrics.scrape(self.directory_metrics_url), name, **labels)

    def wait_directory_metric(self, name: str, at_least: float, timeout_s: float = 30.0, **labels: str) -> float:
        """Poll the directory's metric until it reaches `at_least` (bounded); return the last value."""
        deadline = time.monotonic() + timeout_s
        while True:
            seen = self.directory_metric(name, **labels)
            if seen >= at_least or time.monotonic() > deadline:
                return seen
            time.sleep(0.05)

    def wait_transfer(self, transfer_id: str, states: set[int], timeout_s: float = 60.0):
        """Poll GetTransfer until its state is in `states` (bounded); return the transfer."""
        return wait_for_transfer(self.directory.get_transfer, transfer_id, states, timeout_s)

    # ---------------------------------------------------------------- inspection

    def kv_usage(self, engine: EngineHandle) -> float:
        """vLLM's KV-cache usage gauge (0.0 = no block held by any request)."""
        return kv_cache_usage(engine.url)

    def wait_kv_usage_zero(self, engine: EngineHandle, timeout_s: float = 40.0) -> float:
        """Wait (bounded) until the engine holds no KV block; return the last usage seen."""
        return wait_kv_usage_zero(engine.url, timeout_s)


def prompt_of(length: int, seed: int) -> list[int]:
    """A deterministic prompt of `length` token ids in [10, 1000)."""
    return [10 + (seed * 7919 + i * 104729 + (i * i) % 13) % 990 for i in range(length)]


def abort_after(engine: EngineHandle, body: dict, delay_s: float) -> None:
    """Send a completion on a raw socket and close it after `delay_s`: vLLM aborts the request."""
    host, port = engine.spec.host, engine.spec.port
    payload = json.dumps(body).encode()
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
        time.sleep(delay_s)


@pytest.fixture(scope="session")
def connector_stack(otlp_receiver, session_log_dir) -> ConnectorStack:
    """A directory, then prefill, decode, victim prefill and colocated engines (started in parallel).

    The directory's lease TTL is LEASE_TTL_S: a killed prefill engine's transfers fail within it.
    """
    model_dir = ensure_tiny_model(MODEL_SPEC)
    log_dir = session_log_dir / "connector"
    metrics_port = free_port()
    directory = start_directory(log_dir, extra_args=["--lease-ttl-s", str(LEASE_TTL_S), "--metrics-port",
                                                     str(metrics_port)], env=otlp_receiver.env("conn-directory"))
    address = directory.address
    specs = [
        _kvpush_spec("conn-prefill", "prefill", PREFILL_ID, model_dir, address, otlp_receiver.env("conn-prefill")),
        _kvpush_spec("conn-decode", "decode", DECODE_ID, model_dir, address, otlp_receiver.env("conn-decode"),
                     extra={"decode_allocation_wait_s": DECODE_ALLOCATION_WAIT_S or None}, policy="recompute"),
        _kvpush_spec("conn-victim", "prefill", VICTIM_ID, model_dir, address, otlp_receiver.env("conn-victim"),
                     extra={"fault_stall_after_writes": 2}),
        EngineSpec(name="conn-colocated", model_dir=model_dir, enable_prefix_caching=False,
                   extra_args=_engine_args(False), log_stats=True),
    ]
    handles: list[EngineHandle] = []
    client = None
    try:
        for spec in specs:
            handles.append(launch_engine(spec, log_dir))
        for handle in handles:
            handle.wait_ready(READY_TIMEOUT_S)
        client = SyncDirectoryClient(ChannelConfig(address=address))
        yield ConnectorStack(address, handles[0], handles[1], handles[2], handles[3], client, model_dir,
                             f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        for handle in handles:
            handle.process.terminate()
        for handle in handles:
            handle.stop(grace_s=20.0)
        if client is not None:
            client.close()
        directory.process.stop(grace_s=5.0)
