"""The supported-vLLM check and the prefill scheduler's block-id tracking, which spans vLLM 0.25 to 0.32."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvpush.connector import compat
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.scheduler.prefill import PrefillScheduler


@pytest.mark.parametrize("version, release", [("0.25.0", (0, 25)), ("0.32.0+cpu", (0, 32)),
                                              ("0.28.1.dev3+gabc", (0, 28))])
def test_supported_releases_load(version, release):
    assert compat.check_release(version) == release


@pytest.mark.parametrize("version", ["0.24.1", "0.33.0", "1.0.0"])
def test_unsupported_release_fails_naming_the_range(version):
    with pytest.raises(compat.UnsupportedVLLMError, match=r"supports vLLM 0\.25 to 0\.32; this is vLLM " + version):
        compat.check_release(version)
    assert compat.check_release(version, allow_unsupported=True) == compat.parse_release(version)


def test_unreadable_version_fails_naming_the_range():
    with pytest.raises(compat.UnsupportedVLLMError, match="cannot read vLLM's version 'dev'.*0.25 to 0.32"):
        compat.check_release("dev")


def test_installed_vllm_is_supported():
    import vllm

    assert compat.VLLM_RELEASE == compat.parse_release(vllm.__version__)


def test_cpu_and_gpu_defaults_differ_only_in_message_queue_pacing():
    cpu = ConnectorConfig.from_extra_config({"directory_address": "127.0.0.1:1"}, role="prefill", engine_id="p")
    gpu = ConnectorConfig.from_extra_config({"directory_address": "127.0.0.1:1"}, role="prefill", engine_id="p",
                                            cpu_platform=False)
    assert cpu.message_queue_poll_s == 0.0001 and gpu.message_queue_poll_s is None
    assert {**vars(cpu), "message_queue_poll_s": None} == vars(gpu)


def _request(request_id, prompt_tokens, computed):
    return SimpleNamespace(request_id=request_id, num_prompt_tokens=prompt_tokens, num_computed_tokens=computed,
                           kv_transfer_params={"transfer_id": f"t-{request_id}", "do_remote_decode": True})


def _step(new=(), cached=(), resumed=(), scheduled=None):
    """A SchedulerOutput as every supported release shapes it (only the fields the scheduler half reads)."""
    return SimpleNamespace(
        total_num_scheduled_tokens=sum((scheduled or {}).values()),
        preempted_req_ids=set(),
        num_scheduled_tokens=scheduled or {},
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, block_ids=(list(ids),)) for rid, ids in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[rid for rid, _ in cached],
                                              new_block_ids=[None if ids is None else (list(ids),)
                                                             for _, ids in cached],
                                              resumed_req_ids=set(resumed)),
    )


def test_prefill_chunks_name_blocks_from_the_scheduler_output_across_chunked_steps():
    config = ConnectorConfig.from_extra_config({"directory_address": "127.0.0.1:1"}, role="prefill", engine_id="p")
    scheduler = PrefillScheduler(config, block_size_tokens=16)
    request = _request("r1", prompt_tokens=40, computed=0)
    scheduler.on_new_request(request)

    first = scheduler.build_connector_meta(_step(new=[("r1", [7, 3])], scheduled={"r1": 32}))
    assert [(c.token_start, c.token_end, c.block_ids) for c in first.prefill_chunks] == [(0, 32, (7, 3))]

    request.num_computed_tokens = 32
    second = scheduler.build_connector_meta(_step(cached=[("r1", [11])], scheduled={"r1": 8}))
    assert [(c.token_start, c.token_end, c.block_ids) for c in second.prefill_chunks] == [(32, 40, (7, 3, 11))]


def test_a_resumed_request_takes_its_new_block_list_and_no_new_blocks_keeps_the_old():
    config = ConnectorConfig.from_extra_config({"directory_address": "127.0.0.1:1"}, role="prefill", engine_id="p")
    scheduler = PrefillScheduler(config, block_size_tokens=16)
    request = _request("r1", prompt_tokens=64, computed=0)
    scheduler.on_new_request(request)
    scheduler.build_connector_meta(_step(new=[("r1", [1, 2])], scheduled={"r1": 32}))
    request.num_computed_tokens = 32
    same = scheduler.build_connector_meta(_step(cached=[("r1", None)], scheduled={"r1": 0}))
    assert same.prefill_chunks[0].block_ids == (1, 2)
    resumed = scheduler.build_connector_meta(_step(cached=[("r1", [9, 8, 5, 4])], resumed=["r1"],
                                                   scheduled={"r1": 32}))
    assert resumed.prefill_chunks[0].block_ids == (9, 8, 5, 4)


def test_missing_block_ids_stop_the_push_instead_of_naming_wrong_blocks():
    config = ConnectorConfig.from_extra_config({"directory_address": "127.0.0.1:1"}, role="prefill", engine_id="p")
    scheduler = PrefillScheduler(config, block_size_tokens=16)
    scheduler.on_new_request(_request("r1", prompt_tokens=40, computed=0))
    meta = scheduler.build_connector_meta(_step(new=[("r1", [7])], scheduled={"r1": 40}))
    assert meta.prefill_chunks == []


def test_connector_overrides_only_hooks_every_supported_release_calls():
    """An override of a hook that vLLM 0.25 lacks would silently never run there: each one must be in 0.25's base
    class and in the installed one, with the same parameters."""
    import inspect

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvpush.connector.connector import KVPushConnector

    overrides = {name for name, member in vars(KVPushConnector).items()
                 if not name.startswith("_") and callable(getattr(KVPushConnector, name))}
    assert overrides, "the connector overrides no hook"
    assert overrides <= compat.HOOKS_OF_OLDEST_RELEASE, overrides - compat.HOOKS_OF_OLDEST_RELEASE
    for name in overrides:
        base = getattr(KVConnectorBase_V1, name, None)
        assert base is not None, f"{name} is gone from the installed vLLM's KVConnectorBase_V1"
        ours = list(inspect.signature(getattr(KVPushConnector, name)).parameters)
        theirs = list(inspect.signature(base).parameters)
        assert len(ours) == len(theirs), f"{name}{tuple(ours)} does not match vLLM's {name}{tuple(theirs)}"
