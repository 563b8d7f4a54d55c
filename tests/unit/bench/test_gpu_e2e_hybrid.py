"""bench/gpu_e2e.py with hybrid SSM models (Mamba2 + attention, Granite 4.0-H architecture), no engine started.

The dry run plans with the layout the workers register: a STATE KV-cache group per vLLM group of Mamba layers (one
state block of max-model-len tokens per request, conv + SSM state at each page's start) beside the attention
group, asking the directory's own planning whether prefill and decode pair. Every engine runs without prefix caching,
so the decode prefix-hit check is reported as skipped. A transfer's expected bytes are the attention KV of the prompt
minus its last token (whole blocks on vLLM CPU's block-atomic layout) plus one state per Mamba layer: the figures of
the CPU engine test (tests/integration/connector/test_pd_models.py, `tiny-granite-4.0-h`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpush.localstack.shaped_model import mamba2_state_bytes, preset_config
from tests.fixtures.bench_scripts import load_bench

ROOT = Path(__file__).resolve().parents[3]
SKIPPED = "skipped: prefix caching is off for hybrid SSM models"
TINY_STATE = 19840  # (3 x 288 conv + 8 x 32 x 16 SSM) float32 values of one Mamba2 layer
SHAPED_STATE = 1074688  # (3 x 4,352 conv + 64 x 64 x 128 SSM) bf16 values


def _dry_run(*flags: str, preset: str) -> tuple[int, dict]:
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_e2e.py"), "e2e", "--preset", preset,
                          "--dry-run", *flags], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.stdout.startswith("{"), run.stderr[-2000:]
    return run.returncode, json.loads(run.stdout)


def test_state_bytes_of_the_presets():
    assert mamba2_state_bytes(preset_config("tiny-granite-4.0-h")) == TINY_STATE
    assert mamba2_state_bytes(preset_config("granite-4.0-h-shaped")) == SHAPED_STATE


def test_cpu_dry_run_plans_with_the_state_group_and_skips_the_prefix_hit():
    code, plan = _dry_run("--max-batched-tokens", "1024", "--max-model-len", "4096", preset="tiny-granite-4.0-h")
    assert code == 0 and plan["directory_pairs_them"] and plan["refusal"] == ""
    assert {name: e["prefix_caching"] for name, e in plan["engines"].items()} == {
        "prefill": False, "decode": False, "colocated": False}
    assert plan["skipped_checks"] == {"decode_prefix_hit": SKIPPED}
    for name in ("prefill", "decode"):
        layout = plan["planned_layouts"][name]
        assert (layout["block_size_tokens"], layout["block_atomic"], layout["dtype"], layout["layer_count"]) \
            == (128, True, "float32", 4)
        # vLLM's order: the Mamba layers' group first; one 65,536-byte page per block, shared with attention.
        assert layout["kv_cache_groups"] == [
            {"group_index": 0, "layers": [0, 1], "kind": "state", "block_size_tokens": 4096,
             "block_stride_bytes": 65536, "state_bytes": TINY_STATE},
            {"group_index": 1, "layers": [2, 3], "kind": "attention", "sliding_window_tokens": 0}]
    # The push stops one token short: 514 tokens is the first prompt whose push spills into a fifth block.
    assert (plan["shapes"]["exactly_4_blocks"], plan["shapes"]["4_blocks_plus_1"], plan["shapes"]["4_blocks_plus_2"]) \
        == (512, 513, 514)


def test_gpu_dry_run_counts_in_the_enlarged_attention_block():
    """bf16 state of 1,074,688 B per Mamba layer: a 128-token attention page (262,144 B) cannot hold it, so vLLM
    (this version's rule) takes 5 x 128 = 640 tokens per block; 6 Mamba layers make 3 STATE groups of 2."""
    code, plan = _dry_run("--cuda", "--kv-cache-gib", "7", preset="granite-4.0-h-shaped")
    assert code == 0 and plan["directory_pairs_them"]
    layout = plan["planned_layouts"]["decode"]
    assert (layout["block_size_tokens"], layout["block_atomic"], layout["dtype"]) == (640, False, "bfloat16")
    groups = layout["kv_cache_groups"]
    assert [g["kind"] for g in groups] == ["state", "state", "state", "attention"]
    assert {(g["block_stride_bytes"], g["state_bytes"], g["block_size_tokens"]) for g in groups[:3]} \
        == {(640 * 2048, SHAPED_STATE, 32768)}
    assert (plan["shapes"]["shorter_than_a_block"], plan["shapes"]["exactly_4_blocks"],
            plan["shapes"]["4_blocks_plus_2"]) == (323, 2560, 2562)
    assert not any(e["prefix_caching"] for e in plan["engines"].values())


def test_hybrid_engines_of_different_block_sizes_are_refused_by_the_directory():
    code, plan = _dry_run("--cuda", "--kv-cache-gib", "7", "--prefill-block-size", "16", "--decode-block-size", "128",
                          preset="granite-4.0-h-shaped")
    assert code == 1 and not plan["directory_pairs_them"]
    assert "block_size_tokens 528 of prefill 'gpu-prefill' differs from 640 of decode 'gpu-decode'" in plan["refusal"]
    assert "need one block size" in plan["refusal"]


@pytest.mark.parametrize("prompt,expected", [
    # (blocks of 128 holding prompt - 1 tokens) x 128 x 512 B x 2 attention layers + 2 x 19,840 B
    (50, 128 * 512 * 2 + 2 * TINY_STATE),
    (256, 256 * 512 * 2 + 2 * TINY_STATE),
    (257, 256 * 512 * 2 + 2 * TINY_STATE),
    (258, 384 * 512 * 2 + 2 * TINY_STATE),
    (512, 512 * 512 * 2 + 2 * TINY_STATE),
    (514, 640 * 512 * 2 + 2 * TINY_STATE),
    (1061, 1152 * 512 * 2 + 2 * TINY_STATE),
])
def test_expected_bytes_of_the_tiny_hybrid_on_cpu_engines(prompt, expected):
    gpu_e2e = load_bench("gpu_e2e")
    config = preset_config("tiny-granite-4.0-h")
    assert gpu_e2e.expected_push_bytes(prompt, 0, config, False, 128, block_atomic=True) == expected
    assert gpu_e2e.expected_push_bytes(1061, 0, config, False, 128, block_atomic=True) == 1_219_328


def test_expected_bytes_of_the_shaped_hybrid_on_a_gpu():
    """Token-addressable bf16 attention (2 KV layers of 2,048 B per token) for the prompt minus one token, less a
    decode hit; 6 Mamba layers of 1,074,688 B each."""
    gpu_e2e = load_bench("gpu_e2e")
    config = preset_config("granite-4.0-h-shaped")
    assert gpu_e2e.expected_push_bytes(8192, 0, config, True, 640) == 8191 * 2048 * 2 + 6 * SHAPED_STATE \
        == 39_998_464
    assert gpu_e2e.expected_push_bytes(8192, 640, config, True, 640) == (8191 - 640) * 4096 + 6 * SHAPED_STATE


def test_block_atomic_bytes_match_a_recorded_cpu_run_and_token_bytes_are_unchanged():
    """tiny-llama on vLLM CPU engines moved whole 128-token blocks (bench/results/gpu_e2e_cpu.json: 67 tokens ->
    262,144 B, 513 -> 1,310,720 B); on a GPU every token, as before."""
    gpu_e2e = load_bench("gpu_e2e")
    config = preset_config("tiny-llama")
    assert gpu_e2e.expected_push_bytes(67, 0, config, False, 128, block_atomic=True) == 262144
    assert gpu_e2e.expected_push_bytes(513, 0, config, False, 128, block_atomic=True) == 1310720
    assert gpu_e2e.expected_push_bytes(67, 0, config, False, 128) == 67 * 2048
    with pytest.raises(ValueError, match="block size"):
        gpu_e2e.expected_push_bytes(67, 0, config, False, 0, block_atomic=True)


def test_only_hybrid_presets_skip_the_prefix_hit():
    gpu_e2e = load_bench("gpu_e2e")
    assert gpu_e2e.skipped_checks(preset_config("tiny-granite-4.0-h")) == {"decode_prefix_hit": SKIPPED}
    assert gpu_e2e.skipped_checks(preset_config("tiny-llama")) == {}
    assert gpu_e2e.prefix_caching("tiny-llama") and not gpu_e2e.prefix_caching("granite-4.0-h-shaped")


def test_kv_cache_groups_follow_vllms_uniform_page_grouping():
    """6 Mamba and 2 attention layers: groups of 2, the i-th Mamba group every third Mamba layer (vLLM's
    `_get_kv_cache_groups_uniform_page_size`); 2 and 2 (the tiny preset): one group each."""
    gpu_e2e = load_bench("gpu_e2e")
    assert gpu_e2e._kv_cache_groups_of(preset_config("granite-4.0-h-shaped")["layer_types"]) == [
        ("state", [0, 4]), ("state", [1, 5]), ("state", [2, 6]), ("attention", [3, 7])]
    assert gpu_e2e._kv_cache_groups_of(preset_config("tiny-granite-4.0-h")["layer_types"]) == [
        ("state", [0, 2]), ("attention", [1, 3])]
