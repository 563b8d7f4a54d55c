"""The hooks only vLLM 0.33+ and 0.34+ call (src/kvpush/connector/compat.py), on the real connector built from a real
VllmConfig, scheduler side, against a directory on loopback. The installed vLLM (0.32) never calls them, so they
are called here as those releases do (the call sites are in each release's snapshot, test_vllm_api.py)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from vllm import SamplingParams
from vllm.config import KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request

from kvpush.client.config import ChannelConfig
from kvpush.client.sync import SyncDirectoryClient
from kvpush.connector.connector import KVPushConnector
from kvpush.localstack.model import TinyModelSpec, ensure_tiny_model
from tests.fixtures.directory import (
    DECODE,
    PREFILL,
    directory_on_loopback,
    register_request,
)

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(ensure_tiny_model(TinyModelSpec()))


def _connector(model_dir: str, address: str, kv_role: str, engine_id: str) -> KVPushConnector:
    transfer = KVTransferConfig(
        kv_connector="KVPushConnector", kv_role=kv_role, kv_connector_module_path="kvpush.connector",
        engine_id=engine_id, kv_connector_extra_config={"directory_address": address, "message_queue_poll_s": None})
    config = VllmConfig(model_config=ModelConfig(model=model_dir), kv_transfer_config=transfer)
    return KVPushConnector(config, KVConnectorRole.SCHEDULER, None)


def _request(request_id: str, kv_transfer_params: dict | None, prompt: int = 40) -> Request:
    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
    return Request(request_id=request_id, prompt_token_ids=list(range(prompt)), pooling_params=None,
                   sampling_params=SamplingParams(max_tokens=4, extra_args=extra))


def test_decode_may_load_a_kvpush_leg_asynchronously_until_it_is_allocated(model_dir):
    """vLLM 0.34 asks may_load_async after on_new_request, each time the request enters a waiting queue."""
    with directory_on_loopback() as address:
        client = SyncDirectoryClient(ChannelConfig(address=address))
        client.register_engine(register_request("p", PREFILL))
        client.register_engine(register_request("d", DECODE))
        transfer_id = client.plan_transfer(prompt_token_count=40).transfer.transfer_id
        connector = _connector(model_dir, address, "kv_consumer", "d")
        try:
            leg = _request("r1", {"transfer_id": transfer_id, "do_remote_prefill": True})
            plain = _request("r2", None)
            # vLLM's default answers True for this one (do_remote_prefill); its parameters are refused here.
            malformed = _request("r3", {"do_remote_prefill": True, "do_remote_decode": True})
            for request in (leg, plain, malformed):
                connector.on_new_request(request)
            assert connector.may_load_async(leg) is True
            assert connector.may_load_async(leg) is True  # no side effects: asking again gives the same answer
            assert connector.may_load_async(plain) is False
            assert connector.may_load_async(malformed) is False
            # Waiting for prefill's start (decode_allocation_wait_s, on by default): nothing allocated yet, still a
            # request that loads asynchronously.
            assert connector.get_num_new_matched_tokens(leg, 0) == (None, False)

            connector.update_state_after_alloc(leg, KVCacheBlocks(([KVCacheBlock(i) for i in range(3)],)), 40)
            assert connector.may_load_async(leg) is False  # allocated: nothing more to load asynchronously
        finally:
            connector.shutdown()


def test_prefill_never_loads_asynchronously(model_dir):
    with directory_on_loopback() as address:
        connector = _connector(model_dir, address, "kv_producer", "p")
        for request in (_request("r1", {"transfer_id": "t-1", "do_remote_decode": True}),
                        _request("r2", {"transfer_id": "t-2", "do_remote_prefill": True})):
            connector.on_new_request(request)
            assert connector.may_load_async(request) is False
        connector.shutdown()


def test_sleep_mode_is_refused_and_lookahead_hashes_accepted(model_dir):
    with directory_on_loopback() as address:
        connector = _connector(model_dir, address, "kv_producer", "p")
        transfer = connector._vllm_config.kv_transfer_config
        assert KVPushConnector.supports_sleep_mode(transfer) is False
        assert KVPushConnector.supports_lookahead_block_hashes(transfer) is True
        # The scheduler's process registered no KV memory: nothing to refuse there.
        assert connector.unregister_kv_caches() is None
        connector.restore_kv_caches()
        connector.shutdown()


def test_kv_cache_access_names_registers_where_vllm_defines_it():
    """kv_cache_access imports KVCacheAccess only when called, which only 0.34+ does: the module and member it
    names must be the ones the 0.34 snapshot (read from the wheel) has."""
    tree = ast.parse((ROOT / "src" / "kvpush" / "connector" / "connector.py").read_text())
    hook = next(node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "kv_cache_access")
    imports = [node for node in ast.walk(hook) if isinstance(node, ast.ImportFrom)]
    returned = [ast.unparse(node.value) for node in ast.walk(hook) if isinstance(node, ast.Return)]
    assert [(node.module, [a.name for a in node.names]) for node in imports] == [
        ("vllm.config.kv_transfer", ["KVCacheAccess"])]
    assert returned == ["KVCacheAccess.REGISTERS"]
    snapshot = json.loads((ROOT / "tests/fixtures/vllm_api/0.34.json").read_text())
    access = snapshot["classes"]["KVCacheAccess"]
    assert access["module"] == "vllm/config/kv_transfer.py" and "REGISTERS" in access["fields"]
