"""Engine configuration for the three connectors: what the demo, tests and benchmark pass to vLLM."""

from __future__ import annotations

import pytest

from kvpush.localstack.processes import EngineSpec
from kvpush.localstack.stack import kv_transfer_config


def test_kvpush_config_names_module_directory_and_endpoint():
    """KVPushConnector configs load the connector from kvpush.connector and carry directory and endpoint."""
    config = kv_transfer_config("kvpush", "decode", engine_id="d0", directory_address="127.0.0.1:1",
                                engine_endpoint="http://127.0.0.1:2", extra={"transfer_timeout_s": 5})
    assert config == {"kv_connector": "KVPushConnector", "kv_connector_module_path": "kvpush.connector",
                      "kv_role": "kv_consumer", "engine_id": "d0",
                      "kv_connector_extra_config": {"directory_address": "127.0.0.1:1",
                                                    "engine_endpoint": "http://127.0.0.1:2", "transfer_timeout_s": 5}}


@pytest.mark.parametrize("connector, name", [("nixl-pull", "NixlConnector"), ("nixl-push", "NixlPushConnector")])
def test_vllm_nixl_configs(connector, name):
    """The baselines use vLLM's own connectors by their registered names, producer on prefill."""
    config = kv_transfer_config(connector, "prefill", engine_id="p0")
    assert (config["kv_connector"], config["kv_role"], config["engine_id"]) == (name, "kv_producer", "p0")
    assert "kv_connector_module_path" not in config


@pytest.mark.parametrize("args, message", [
    (("kvpush", "prefill"), "directory_address"),
    (("lmcache", "prefill"), "unknown connector"),
    (("nixl-pull", "both"), "role"),
])
def test_bad_configs_are_refused(args, message):
    """Unknown connectors, roles, or a kvpush engine without its directory are refused with a message."""
    with pytest.raises(ValueError, match=message):
        kv_transfer_config(*args)


def test_engine_command_line_is_cpu_safe(tmp_path):
    """Engines run the OpenAI server module (not `vllm serve`), eager, with a bounded KV cache and the config."""
    spec = EngineSpec(name="e", model_dir=tmp_path, port=1234, kv_transfer_config={"kv_connector": "X"},
                      netns="ns1", cpus="0")
    proc_argv = spec.argv()
    assert proc_argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert "--enforce-eager" in proc_argv and "--no-enable-prefix-caching" in proc_argv
    assert proc_argv[proc_argv.index("--kv-transfer-config") + 1] == '{"kv_connector": "X"}'
    assert spec.environment()["VLLM_CPU_KVCACHE_SPACE"] == "1"
