"""bench/gpu_e2e.py with engines of different block sizes, as a dry run (no engine starts): each engine gets its own
--block-size, the prompt shapes cover both sizes, and the directory's own planning is asked first whether it pairs
the two layouts: GPU (FlashAttention, token-addressable) layouts of 16 and 128 pair, vLLM CPU's tiled ones do not.
Different sizes start the directory with --pair-block-sizes (planning refuses them without it), one size does not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _dry_run(*flags: str, preset: str = "tiny-llama") -> tuple[int, dict]:
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_e2e.py"), "e2e", "--preset", preset,
                          "--dry-run", *flags], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.stdout.startswith("{"), run.stderr[-2000:]
    return run.returncode, json.loads(run.stdout)


def test_gpu_engines_of_16_and_128_tokens_per_block_pair():
    code, plan = _dry_run("--cuda", "--kv-cache-gib", "7", "--prefill-block-size", "16", "--decode-block-size", "128")
    assert code == 0 and plan["directory_pairs_them"] and plan["refusal"] == ""
    assert plan["directory_args"] == ["--lease-ttl-s", "30", "--pair-block-sizes"]
    assert plan["block_sizes"] == {"prefill": 16, "decode": 128}
    assert {name: e["block_size"] for name, e in plan["engines"].items()} == {
        "prefill": 16, "decode": 128, "colocated": 128}
    shapes = plan["shapes"]
    assert (shapes["exactly_4_blocks"], shapes["4_blocks_plus_1"]) == (512, 513)
    assert (shapes["exactly_4_blocks_prefill_blocks"], shapes["4_blocks_plus_1_prefill_blocks"]) == (64, 65)


def test_the_reverse_pairs_too_and_one_size_keeps_the_usual_shapes():
    code, plan = _dry_run("--cuda", "--prefill-block-size", "128", "--decode-block-size", "16")
    assert code == 0 and plan["block_sizes"] == {"prefill": 128, "decode": 16}
    assert plan["shapes"]["exactly_4_blocks"] == 64 and plan["shapes"]["exactly_4_blocks_prefill_blocks"] == 512
    code, plan = _dry_run("--cuda", "--block-size", "32")
    assert code == 0 and plan["block_sizes"] == {"prefill": 32, "decode": 32}
    assert plan["directory_args"] == ["--lease-ttl-s", "30"]
    assert not any(name.endswith("_prefill_blocks") for name in plan["shapes"])
    assert "4_blocks_plus_2" not in plan["shapes"]  # only for hybrid SSM models (test_gpu_e2e_hybrid.py)


def test_cpu_engines_of_different_block_sizes_are_refused_before_anything_starts():
    code, plan = _dry_run("--prefill-block-size", "16", "--decode-block-size", "128")
    assert code == 1 and not plan["directory_pairs_them"]
    assert ("block_size_tokens 16 of prefill 'gpu-prefill' differs from 128 of decode 'gpu-decode' (prefill's layout "
            "is block_atomic") in plan["refusal"]


def test_mla_presets_plan_with_their_latent_layout():
    """The MLA presets' layouts (one latent per token, no head_dim in the config) pair, on GPU and CPU, also across
    block sizes on GPU (token-addressable)."""
    code, plan = _dry_run("--cuda", "--kv-cache-gib", "7", preset="deepseek-v2-shaped")
    assert code == 0 and plan["directory_pairs_them"]
    code, plan = _dry_run(preset="tiny-deepseek-v2")
    assert code == 0 and plan["directory_pairs_them"]
    code, plan = _dry_run("--cuda", "--prefill-block-size", "16", "--decode-block-size", "64",
                          preset="deepseek-v2-shaped")
    assert code == 0 and plan["directory_pairs_them"]
