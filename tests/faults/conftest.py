"""Real-engine fault fixtures: a directory with short leases and vLLM CPU engines whose failures tests inject.

One package-scoped `FaultStack` (tests/conftest.py runs this suite first, then tears it down) starts, in parallel,
on 127.0.0.1 (the tiny 4-layer float32 model):
  * `prefill`: a plain KVPushConnector prefill engine;
  * `holder`: a prefill engine whose data plane holds every posted WRITE after a transfer's first for
    HOLD_S before its bytes move (`fault_hold_posted_write_s`): a WRITE stuck in the network, in flight
    past the failure the test injects, landing late; it plans no write after a transfer's third
    (`fault_stall_after_writes`), so its transfers never complete and always end in the fault;
  * `decode`: kv_load_failure_policy "fail", prefix caching off and only DECODE_BLOCKS KV blocks, so a
    request that follows a failed one is allocated the failed one's blocks (a late write would land in it);
  * `decode_victim`: a second decode engine, SIGKILLed by a test;
  * `colocated`: a plain engine, the reference for greedy tokens.
Bounds are short so the suite stays within minutes: lease LEASE_TTL_S, max_write_s MAX_WRITE_S on every
engine and the directory. An affected request ends within FENCE_BOUND_S = lease TTL + max_write_s + one
reap (the directory's fence for a lost prefill rank) plus the engines' own step and HTTP time.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvpush.client.config import ChannelConfig
from kvpush.client.errors import DirectoryCallError
from kvpush.client.sync import SyncDirectoryClient
from kvpush.localstack.client import HttpResult, call
from kvpush.localstack.model import ensure_tiny_model
from kvpush.localstack.processes import (
    DirectoryHandle,
    EngineHandle,
    EngineSpec,
    free_port,
    launch_engine,
    start_directory,
)
from kvpush.localstack.stack import kv_transfer_config
from kvpush.localstack.vllm_bench import kv_cache_usage, wait_kv_usage_zero
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import TERMINAL_STATES
from tests.integration.connector.conftest import BLOCK_SIZE, MAX_BATCHED_TOKENS, MODEL_SPEC

LEASE_TTL_S = 5.0
MAX_WRITE_S = 6.0
HOLD_S = 4.0
REAP_S = 0.1
FENCE_BOUND_S = LEASE_TTL_S + MAX_WRITE_S + REAP_S
TRANSFER_TIMEOUT_S = 60.0
PUSH_TIMEOUT_S = 60.0
READY_TIMEOUT_S = 600.0
DECODE_BLOCKS = 8
DECODE_MAX_MODEL_LEN = DECODE_BLOCKS * BLOCK_SIZE
PREFILL_ID, HOLDER_ID, DECODE_ID, VICTIM_ID = "fault-prefill", "fault-holder", "fault-decode", "fault-decode-victim"
TERMINAL = TERMINAL_STATES


def _args(prefix_caching: bool) -> list[str]:
    return ["--block-size", str(BLOCK_SIZE), "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS),
            "--max-num-seqs", "16"]


def _spec(name: str, role: str | None, engine_id: str, model_dir: Path, directory: str, *, extra: dict | None = None,
          policy: str | None = None, blocks: int | None = None) -> EngineSpec:
    port = free_port()
    config = None
    if role is not None:
        config = kv_transfer_config("kvpush", role, engine_id=engine_id, directory_address=directory,
                                    engine_endpoint=f"http://127.0.0.1:{port}",
                                    extra={"transfer_timeout_s": TRANSFER_TIMEOUT_S, "push_timeout_s": PUSH_TIMEOUT_S,
                                           "max_write_s": MAX_WRITE_S, **(extra or {})})
        if policy:
            config["kv_load_failure_policy"] = policy
    extra_args = _args(role == "prefill")
    if blocks is not None:
        extra_args += ["--num-gpu-blocks-override", str(blocks + 1)]  # vLLM keeps one as its null block
    return EngineSpec(name=name, model_dir=model_dir, port=port, kv_transfer_config=config,
                      env={"UCX_NET_DEVICES": "lo"}, enable_prefix_caching=role == "prefill",
                      max_model_len=DECODE_MAX_MODEL_LEN if blocks is not None else 4096, extra_args=extra_args,
                      log_stats=True)


def directory_args() -> list[str]:
    return ["--lease-ttl-s", str(LEASE_TTL_S), "--max-write-s", str(MAX_WRITE_S), "--reap-interval-s", str(REAP_S)]


@dataclass
class FaultStack:
    """The running engines, the directory (restartable on its port) and a client to it."""

    directory: DirectoryHandle
    prefill: EngineHandle
    holder: EngineHandle
    decode: EngineHandle
    decode_victim: EngineHandle
    colocated: EngineHandle
    client: SyncDirectoryClient
    log_dir: Path
    _references: dict[tuple, list[int]] = field(default_factory=dict)

    def request(self, engine: EngineHandle, prompt: list[int], max_tokens: int, params: dict | None = None,
                timeout_s: float = 240.0) -> HttpResult:
        """POST /v1/completions with token ids (greedy); the raw result (any status)."""
        body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                                "return_token_ids": True, "ignore_eos": True}
        if params is not None:
            body["kv_transfer_params"] = params
        return call("POST", engine.url + "/v1/completions", body, timeout_s=timeout_s)

    def tokens(self, result: HttpResult) -> list[int]:
        assert result.status == 200, f"answered {result.status}: {result.text[:500]}"
        return list(result.body["choices"][0]["token_ids"])

    def reference(self, prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in self._references:
            self._references[key] = self.tokens(self.request(self.colocated, prompt, max_tokens))
        return self._references[key]

    def plan(self, prompt_len: int, prefill_id: str, decode_id: str = DECODE_ID, ttl_s: float | None = None) -> str:
        """PlanTransfer pinned to the engines. Decode's free blocks reach the directory with its renewals (every
        TTL/3): right after a request that filled decode, a plan may be refused for up to that long."""
        deadline = time.monotonic() + LEASE_TTL_S
        while True:
            try:
                return self.client.plan_transfer(prompt_token_count=prompt_len, prefill_engine_id=prefill_id,
                                                 decode_engine_id=decode_id, ttl_s=ttl_s).transfer.transfer_id
            except DirectoryCallError as error:
                if "RESOURCE_EXHAUSTED" not in str(error) or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def legs(self, prompt: list[int], max_tokens: int, prefill: EngineHandle, prefill_id: str,
             decode: EngineHandle | None = None, decode_id: str = DECODE_ID, ttl_s: float | None = None,
             transfer_id: str | None = None) -> tuple[concurrent.futures.Future, concurrent.futures.Future, str, float]:
        """Plan (unless given an id) and send both legs at once; (prefill future, decode future, id, start time)."""
        transfer_id = transfer_id or self.plan(len(prompt), prefill_id, decode_id, ttl_s)
        pool = concurrent.futures.ThreadPoolExecutor(2)
        started = time.monotonic()
        d_leg = pool.submit(self.request, decode or self.decode, prompt, max_tokens,
                            {"transfer_id": transfer_id, "do_remote_prefill": True})
        p_leg = pool.submit(self.request, prefill, prompt, 1, {"transfer_id": transfer_id, "do_remote_decode": True})
        pool.shutdown(wait=False)
        return p_leg, d_leg, transfer_id, started

    def wait_transfer(self, transfer_id: str, states: set[int], timeout_s: float = 60.0) -> tpb.Transfer:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                transfer = self.client.get_transfer(transfer_id)
                if transfer.state in states or time.monotonic() > deadline:
                    return transfer
            except Exception:  # the directory may be restarting
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.05)

    def wait_registered(self, engine_ids: list[str], timeout_s: float = 60.0) -> None:
        """Wait until every engine has a worker registered at the (possibly restarted) directory."""
        deadline = time.monotonic() + timeout_s
        missing = list(engine_ids)
        while missing and time.monotonic() < deadline:
            for engine_id in list(missing):
                try:
                    self.client.get_engine(engine_id)
                    missing.remove(engine_id)
                except Exception:
                    pass
            time.sleep(0.2)
        assert not missing, f"not registered again: {missing}"

    def kv_usage(self, engine: EngineHandle) -> float:
        return kv_cache_usage(engine.url)

    def wait_kv_usage_zero(self, engine: EngineHandle, timeout_s: float = 40.0) -> float:
        return wait_kv_usage_zero(engine.url, timeout_s)

    def live_transfers(self) -> list[tpb.Transfer]:
        return [t for t in self.client.list_transfers(limit=1000) if t.state not in TERMINAL]


def is_openai_error(result: HttpResult) -> bool:
    """An OpenAI-style error answer: an HTTP error status with {"error": {"message": ...}} (or vLLM's flat form)."""
    body = result.body if isinstance(result.body, dict) else {}
    error = body.get("error", body)
    return result.status >= 400 and isinstance(error, dict) and bool(error.get("message"))


@pytest.fixture(scope="package")  # torn down after the suite's last test: its 5 engines never overlap the others'
def fault_stack(session_log_dir) -> FaultStack:
    """Directory (short leases), prefill, holder prefill, decode, victim decode and colocated engines."""
    model_dir = ensure_tiny_model(MODEL_SPEC)
    log_dir = session_log_dir / "faults"
    directory = start_directory(log_dir, extra_args=directory_args())
    address = directory.address
    specs = [
        _spec("fault-prefill", "prefill", PREFILL_ID, model_dir, address),
        _spec("fault-holder", "prefill", HOLDER_ID, model_dir, address,
              extra={"fault_hold_posted_write_s": HOLD_S, "fault_hold_after_writes": 1,
                     "fault_stall_after_writes": 3}),
        _spec("fault-decode", "decode", DECODE_ID, model_dir, address, policy="fail", blocks=DECODE_BLOCKS),
        _spec("fault-decode-victim", "decode", VICTIM_ID, model_dir, address, policy="fail"),
        _spec("fault-colocated", None, "", model_dir, address),
    ]
    handles: list[EngineHandle] = []
    client = None
    stack = None
    try:
        for spec in specs:
            handles.append(launch_engine(spec, log_dir))
        for handle in handles:
            handle.wait_ready(READY_TIMEOUT_S)
        client = SyncDirectoryClient(ChannelConfig(address=address))
        stack = FaultStack(directory, *handles, client=client, log_dir=log_dir)
        yield stack
    finally:
        for handle in handles:
            handle.process.terminate()
        for handle in handles:
            handle.stop(grace_s=20.0)
        if client is not None:
            client.close()
        (stack.directory if stack is not None else directory).process.stop(grace_s=5.0)
