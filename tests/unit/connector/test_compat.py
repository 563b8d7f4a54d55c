"""The supported-vLLM check, the range the docs state, and the prefill scheduler's block-id tracking across vLLM
0.25 to 0.34 (each release's hook signatures: test_vllm_api.py)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvpush.connector import compat
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.scheduler.prefill import PrefillScheduler


@pytest.mark.parametrize("version, release", [("0.25.0", (0, 25)), ("0.32.0+cpu", (0, 32)),
                                              ("0.28.1.dev3+gabc", (0, 28)), ("0.33.0", (0, 33)),
                                              ("0.34.0", (0, 34))])
def test_supported_releases_load(version, release):
    assert compat.check_release(version) == release


@pytest.mark.parametrize("version", ["0.24.1", "0.35.0", "1.0.0"])
def test_unsupported_release_fails_naming_the_range(version):
    with pytest.raises(compat.UnsupportedVLLMError, match=r"supports vLLM 0\.25 to 0\.34; this is vLLM " + version):
        compat.check_release(version)
    assert compat.check_release(version, allow_unsupported=True) == compat.parse_release(version)


def test_unreadable_version_fails_naming_the_range():
    with pytest.raises(compat.UnsupportedVLLMError, match=r"cannot read vLLM's version 'dev'.*0\.25 to 0\.34"):
        compat.check_release("dev")


def test_installed_vllm_is_supported():
    import vllm

    assert compat.parse_release(vllm.__version__) == compat.VLLM_RELEASE


def test_cpu_and_gpu_defaults_differ_only_in_message_queue_pacing():
    cpu = ConnectorConfig.from_extra_config({"directory_address": "127.0.0.1:1"}, role="prefill", engine_id="p")
    gpu = ConnectorConfig.from_extra_config({"directory_address": "127.0.0.1:1"}, role="prefill", engine_id="p",
                                            cpu_platform=False)
    assert cpu.message_queue_poll_s == 0.0001 and gpu.message_queue_poll_s is None
    assert {**vars(cpu), "message_queue_poll_s": None} == vars(gpu)


def _request(request_id, prompt_tokens, computed):
    return SimpleNamespace(request_id=request_id, num_prompt_tokens=prompt_tokens, num_computed_tokens=computed,
                           kv_transfer_params={"transfer_id": f"t-{request_id}", "do_remote_decode": True})


def _step(new=(), cached=(), resumed=(), scheduled=None, release=(0, 32)):
    """A SchedulerOutput as `release` shapes it (only the fields the scheduler half reads). 0.34 has no
    `resumed_req_ids`: a resumed request comes in `scheduled_new_reqs` with its whole table."""
    cached_reqs = SimpleNamespace(req_ids=[rid for rid, _ in cached],
                                  new_block_ids=[None if ids is None else (list(ids),) for _, ids in cached])
    if release < (0, 34):
        cached_reqs.resumed_req_ids = set(resumed)
    else:
        assert not resumed, "0.34 sends resumed requests as new ones"
    return SimpleNamespace(
        total_num_scheduled_tokens=sum((scheduled or {}).values()),
        preempted_req_ids=set(),
        num_scheduled_tokens=scheduled or {},
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, block_ids=(list(ids),)) for rid, ids in new],
        scheduled_cached_reqs=cached_reqs,
    )


@pytest.mark.parametrize("release", [(0, 25), (0, 33), (0, 34)])
def test_prefill_chunks_name_blocks_from_the_scheduler_output_across_chunked_steps(release):
    config = ConnectorConfig.from_extra_config({"directory_address": "127.0.0.1:1"}, role="prefill", engine_id="p")
    scheduler = PrefillScheduler(config, block_size_tokens=16)
    request = _request("r1", prompt_tokens=40, computed=0)
    scheduler.on_new_request(request)

    first = scheduler.build_connector_meta(_step(new=[("r1", [7, 3])], scheduled={"r1": 32}, release=release))
    assert [(c.token_start, c.token_end, c.block_ids) for c in first.prefill_chunks] == [(0, 32, (7, 3))]

    request.num_computed_tokens = 32
    second = scheduler.build_connector_meta(_step(cached=[("r1", [11])], scheduled={"r1": 8}, release=release))
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


def test_a_request_resumed_as_a_new_one_takes_its_whole_table_on_vllm_0_34():
    config = ConnectorConfig.from_extra_config({"directory_address": "127.0.0.1:1"}, role="prefill", engine_id="p")
    scheduler = PrefillScheduler(config, block_size_tokens=16)
    request = _request("r1", prompt_tokens=64, computed=0)
    scheduler.on_new_request(request)
    scheduler.build_connector_meta(_step(new=[("r1", [1, 2])], scheduled={"r1": 32}, release=(0, 34)))
    request.num_computed_tokens = 32
    resumed = scheduler.build_connector_meta(_step(new=[("r1", [9, 8, 5, 4])], scheduled={"r1": 32},
                                                   release=(0, 34)))
    assert resumed.prefill_chunks[0].block_ids == (9, 8, 5, 4)


def test_missing_block_ids_stop_the_push_instead_of_naming_wrong_blocks():
    config = ConnectorConfig.from_extra_config({"directory_address": "127.0.0.1:1"}, role="prefill", engine_id="p")
    scheduler = PrefillScheduler(config, block_size_tokens=16)
    scheduler.on_new_request(_request("r1", prompt_tokens=40, computed=0))
    meta = scheduler.build_connector_meta(_step(new=[("r1", [7])], scheduled={"r1": 40}))
    assert meta.prefill_chunks == []


ROOT = Path(__file__).resolve().parents[3]
# Every user-facing place that states the supported range.
RANGE_STATEMENTS = ["README.md", "docs/connector.md", "connector/Dockerfile", "deploy/ec2-efa/README.md"]


@pytest.mark.parametrize("path", RANGE_STATEMENTS)
def test_docs_and_deploy_files_state_the_supported_range(path):
    text = re.sub(r"[\s*#]+", " ", (ROOT / path).read_text())  # across line breaks, comments and bold
    stated = set(re.findall(r"vLLM (0\.\d+ to 0\.\d+)", text))
    assert stated == {compat.supported_range_text().removeprefix("vLLM ")}, stated

