"""Random-weight models of real shapes, made on the machine that runs them and cached.

Presets: `llama-3.1-8b` (its config) and `tiny-llama`; `deepseek-v2-shaped` (DeepSeek-V2-Lite's MLA attention, few
dense layers) and `tiny-deepseek-v2`; `tiny-gemma3` (sliding-window and full-attention layers); `granite-4.0-h-shaped`
and `tiny-granite-4.0-h` (Mamba2 state layers between attention layers, a hybrid SSM model). The tiny ones are
float32 for vLLM CPU engines (`vllm_cpu_engine_args` says what else such an engine needs).

No model can be downloaded where the GPU runs, and vLLM's own dummy weights (uniform in ±1e-3, norms
included) give logits so flat that bf16 rounding decides most greedy tokens. So the weights here are what
`transformers` initialises (normal, std = initializer_range; norms 1), seeded, in the preset's dtype, made on the GPU
when there is one (seconds) and saved as safetensors. The tokenizer is a word-level one over exactly the
model's vocabulary (`t0 ... tN`, plus Llama 3's begin/end-of-text ids), so any token sequence decodes to
text that encodes back to the same ids: `vllm bench serve`'s random dataset gets prompts of exactly the
length it asks for, and chat templates work.

`ensure_shaped_model(preset)` returns the cached folder, building it first if needed (written to a
temporary folder and renamed into place, so a crash leaves nothing half-written).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Collection
from pathlib import Path
from typing import Any

from kvpush.observability import get_logger

_log = get_logger("localstack.shaped_model")

DEFAULT_CACHE_DIR = Path(os.environ.get("KVPUSH_MODEL_CACHE", Path.home() / ".cache" / "kvpush" / "models"))

# The public config of meta-llama/Llama-3.1-8B (32 layers, 8 KV heads x 128); only the weights are random.
LLAMA_3_1_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
    "initializer_range": 0.02, "bos_token_id": 128000, "eos_token_id": 128001, "dtype": "bfloat16",
}
# The same architecture at a size a CPU builds in seconds: a dry run of the GPU scripts' plumbing.
TINY_LLAMA: dict[str, Any] = {
    **LLAMA_3_1_8B, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 2048,
    "max_position_embeddings": 32768, "bos_token_id": 2000, "eos_token_id": 2001, "dtype": "float32",
}
# DeepSeek-V2's attention (MLA) exactly as in DeepSeek-V2-Lite: 16 heads, no query LoRA, a 512-wide KV latent plus
# a 64-wide decoupled RoPE key (the cache holds 576 values per token and layer, once, for all heads), nope/V head
# dims 128. The rest is cut to fit P, D and a colocated engine on one 80 GB GPU: 8 layers, every one a dense MLP
# (first_k_dense_replace = the layer count, so no MoE layer exists), ~1.6 GB of bf16 weights. Plain RoPE: V2's
# YaRN scaling changes attention scores, not what the cache holds.
DEEPSEEK_V2_SHAPED: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
    "intermediate_size": 5632, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 16,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "first_k_dense_replace": 8, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "topk_method": "greedy", "routed_scaling_factor": 1.0,
    "vocab_size": 102400, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "initializer_range": 0.02,
    "bos_token_id": 100000, "eos_token_id": 100001, "dtype": "bfloat16",
}
# The same attention for vLLM CPU engines: vLLM's CPU MLA kernels exist only for a 576-wide latent (512 + 64), so
# those stay; everything else is tiny, in float32 (the P/D tests compare tokens with a colocated engine).
TINY_DEEPSEEK_V2: dict[str, Any] = {
    **DEEPSEEK_V2_SHAPED, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "first_k_dense_replace": 4, "vocab_size": 2048,
    "initializer_range": 0.2, "bos_token_id": 2000, "eos_token_id": 2001, "dtype": "float32",
}
# Gemma 3's attention pattern (text model): sliding-window layers with full-attention layers between them (here
# every second layer full, Gemma 3's own is every sixth), at a size for vLLM CPU engines (head_dim 32 is one CPU
# attention accepts), float32. The window (64 tokens) is shorter than the tests' prompts, so it shapes every output.
# Untied embeddings: tied ones at this init range make a random Gemma repeat one token forever.
TINY_GEMMA3: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 64, "sliding_window_pattern": 2,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "vocab_size": 2048, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": False, "initializer_range": 0.2,
    "pad_token_id": 0, "bos_token_id": 2000, "eos_token_id": 2001, "dtype": "float32",
}
# Gemma 3 4B's attention for the GPU: 8 query and 4 KV heads of 256, a 1,024-token window on five of every six layers
# (layers 5 and 11 full). Cut to 12 layers and a 32k vocabulary (~1.2B parameters, ~2.4 GB in bf16) so P, D and a
# colocated engine fit one 80 GB GPU; the window and pattern are Gemma 3's own.
GEMMA3_SHAPED: dict[str, Any] = {
    **TINY_GEMMA3, "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 12,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256,
    "sliding_window": 1024, "sliding_window_pattern": 6,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 2, "vocab_size": 32768,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "initializer_range": 0.02, "bos_token_id": 2, "eos_token_id": 1, "dtype": "bfloat16",
}
# gpt-oss's attention and MoE (GptOss: attention sinks, a 128-token window on every other layer, biased attention
# projections, top-k routed experts with YaRN rope over 4,096 original positions) at a size for vLLM CPU engines,
# float32 and unquantized (vllm-cpu 0.32 runs its experts with CPUUnquantizedExperts). The window and the
# sliding/full alternation are gpt-oss's own.
TINY_GPT_OSS: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 128, "intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 2, "num_local_experts": 4,
    "num_experts_per_tok": 2, "experts_per_token": 2, "attention_bias": True, "swiglu_limit": 7.0,
    "rope_theta": 150000.0, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                             "truncate": False, "original_max_position_embeddings": 4096},
    "vocab_size": 2048, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "initializer_range": 0.2, "pad_token_id": 0, "bos_token_id": 2000, "eos_token_id": 2001, "dtype": "float32",
}
# A Granite 4.0-H hybrid (GraniteMoeHybrid, dense): Mamba2 mixers with attention layers between them, at Granite
# 4.0-H-Micro-like dimensions (2048 hidden, 32 query and 8 KV heads of 64; 64 SSM heads of 64 with a 128-wide state, one
# group, 4-wide convolution), cut to 8 layers of which 2 are attention, bf16. vLLM gives the Mamba layers a KV-cache
# group of their own (MambaSpec: one block of conv and SSM state per request) beside the attention layers'.
GRANITE_4_0_H_SHAPED: dict[str, Any] = {
    "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid", "hidden_size": 2048,
    "intermediate_size": 8192, "shared_intermediate_size": 8192, "num_local_experts": 0, "num_experts_per_tok": 0,
    "num_hidden_layers": 8, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    "mamba_n_heads": 64, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_d_conv": 4,
    "mamba_expand": 2, "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_proj_bias": False,
    "position_embedding_type": "nope", "vocab_size": 100352, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False, "initializer_range": 0.02,
    "pad_token_id": 0, "bos_token_id": 100000, "eos_token_id": 100001, "dtype": "bfloat16",
}
# The same architecture for vLLM CPU engines: two Mamba2 layers and two attention layers, float32 (head_dim 32, which
# CPU attention accepts). vllm-cpu 0.32 serves it only without prefix caching (`vllm_cpu_engine_args`).
TINY_GRANITE_4_0_H: dict[str, Any] = {
    **GRANITE_4_0_H_SHAPED, "hidden_size": 128, "intermediate_size": 256, "shared_intermediate_size": 256,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "mamba_n_heads": 8, "mamba_d_head": 32, "mamba_d_state": 16, "mamba_chunk_size": 64,
    "position_embedding_type": "rope", "rope_theta": 10000.0, "vocab_size": 2048, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "initializer_range": 0.2, "bos_token_id": 2000, "eos_token_id": 2001, "dtype": "float32",
}
PRESETS = {"llama-3.1-8b": LLAMA_3_1_8B, "tiny-llama": TINY_LLAMA, "deepseek-v2-shaped": DEEPSEEK_V2_SHAPED,
           "tiny-deepseek-v2": TINY_DEEPSEEK_V2, "tiny-gemma3": TINY_GEMMA3, "gemma3-shaped": GEMMA3_SHAPED,
           "granite-4.0-h-shaped": GRANITE_4_0_H_SHAPED, "tiny-granite-4.0-h": TINY_GRANITE_4_0_H,
           "tiny-gpt-oss": TINY_GPT_OSS}
_FORMAT_VERSION = 1
_SEED = 0
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ message['role'] }} {{ message['content'] }} "
                 "{% endfor %}{% if add_generation_prompt %}assistant {% endif %}")


def preset_config(preset: str) -> dict[str, Any]:
    """The model config of a preset name (KeyError naming the known ones otherwise)."""
    try:
        return dict(PRESETS[preset])
    except KeyError:
        raise KeyError(f"unknown model preset {preset!r}; known: {sorted(PRESETS)}") from None


def is_mla(config: dict[str, Any]) -> bool:
    """Whether the preset's attention is MLA (DeepSeek V2/V3 style: a compressed KV latent in the cache)."""
    return config.get("kv_lora_rank") is not None


def kv_bytes_per_token(config: dict[str, Any]) -> int:
    """Bytes of KV one token occupies in one layer (the unit of every push).

    MLA caches one latent per token (kv_lora_rank + qk_rope_head_dim values) shared by every head; other
    layouts cache K and V per KV head.
    """
    element = 2 if config["dtype"] in ("bfloat16", "float16") else 4
    if is_mla(config):
        return (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * element
    return 2 * config["num_key_value_heads"] * config["head_dim"] * element


def is_hybrid_ssm(config: dict[str, Any]) -> bool:
    """Whether the preset has state layers (Mamba2 mixers, here) besides attention."""
    return "linear_attention" in (config.get("layer_types") or ())


def state_layer_count(config: dict[str, Any]) -> int:
    """Layers that keep a recurrent state (conv and SSM state per request) instead of per-token KV."""
    return sum(1 for kind in config.get("layer_types") or () if kind == "linear_attention")


def mamba2_state_bytes(config: dict[str, Any], tp_size: int = 1) -> int:
    """Bytes of one request's state in one Mamba2 layer on one of `tp_size` ranks, as vLLM keeps it: conv state
    ((d_conv - 1) x (inner width + 2 x groups x state) / tp_size) and SSM state (heads x head dim x state / tp_size),
    in the model's dtype (vllm-cpu keeps float32). Groups that do not split over the ranks are replicated up to
    tp_size of them, as vLLM's `extra_groups_for_head_shards` does."""
    element = 2 if config["dtype"] in ("bfloat16", "float16") else 4
    inner = config["mamba_n_heads"] * config["mamba_d_head"]
    groups = config["mamba_n_groups"]
    if groups % tp_size:
        groups = tp_size
    conv = (config["mamba_d_conv"] - 1) * (inner + 2 * groups * config["mamba_d_state"]) // tp_size
    return (conv + inner * config["mamba_d_state"] // tp_size) * element


def pushed_kv_bytes(config: dict[str, Any], prompt_tokens: int, block_size: int, *, block_atomic: bool,
                    prefix_hit_tokens: int = 0, tp_size: int = 1, sliding_windows: bool = True) -> int:
    """What one transfer of a whole prompt moves, over all `tp_size` ranks: the KV of every token decode did not
    hold (`prefix_hit_tokens`), every layer, every head, in `config`'s dtype.

    A sliding-window layer (vLLM's hybrid KV-cache manager, which the connector keeps on; `sliding_windows` False
    when it is off) only from the decode block holding the first token of the prompt's last window: vLLM leaves the
    blocks before it null. A block-atomic layout (vLLM CPU attention's tiles) moves whole blocks of decode's
    `block_size`. A hybrid SSM model's prefill stops one token short of the prompt (decode computes the last one on
    the pushed state): its attention layers move the KV of the prompt minus one token, and each Mamba layer one
    state block's state per rank (its padding excluded). `block_size` 0: not known, so no window cut.
    """
    per_token = kv_bytes_per_token(config)
    pushed = prompt_tokens - 1 if is_hybrid_ssm(config) else prompt_tokens
    if block_atomic:
        if not block_size:
            raise ValueError("a block-atomic layout's bytes need decode's block size")
        pushed = -(-pushed // block_size) * block_size
    total = 0
    for layer_type in config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]:
        if layer_type == "linear_attention":
            total += tp_size * mamba2_state_bytes(config, tp_size)
            continue
        first = prefix_hit_tokens
        if layer_type == "sliding_attention" and sliding_windows and block_size:
            window_start = max(0, prompt_tokens - config["sliding_window"] + 1)
            first = max(first, window_start // block_size * block_size)
        total += max(0, pushed - first) * per_token
    return total


def runs_on_cpu(preset: str) -> bool:
    """Whether a preset is made for vLLM CPU engines (float32, tiny) rather than a GPU."""
    return preset_config(preset)["dtype"] == "float32"


def vllm_cpu_engine_args(config: dict[str, Any], mla_backend: str = "CPU_MLA") -> list[str]:
    """Extra `vllm serve` arguments a vllm-cpu 0.32 engine needs for this model to run and be right.

    MLA: `mla_backend`, CPU_MLA by default: the reference backend, which takes float32 and forces 16-token blocks
    and no chunked prefill or prefix caching; AMX_MLA (vLLM's default where AMX exists) takes bf16 weights only
    (pass `--dtype bfloat16` too) and keeps 128-token blocks, chunked prefill and prefix caching. Either way
    PyTorch's rope instead of vLLM's CPU rope kernel, with which DeepSeek-V2's prefill is not causal (a prefix's
    prompt log-probabilities change with the tokens after it; measured with CPU_MLA and AMX_MLA).
    """
    if is_hybrid_ssm(config):
        # Prefix caching would put the Mamba layers in vLLM's 'align' mode, whose CPU prefill of a prompt longer than
        # one 128-token block fails (mamba_mixer2 indexes past its chunk states); 'none' keeps one state block per
        # request.
        return ["--no-enable-prefix-caching"]
    if not is_mla(config):
        return []
    if mla_backend not in ("CPU_MLA", "AMX_MLA"):
        raise ValueError(f"mla_backend {mla_backend!r} is not one of vllm-cpu's MLA backends (CPU_MLA, AMX_MLA)")
    blocks = ["--block-size", "16"] if mla_backend == "CPU_MLA" else []
    return ["--attention-backend", mla_backend, *blocks,
            "--compilation-config", json.dumps({"custom_ops": ["-rotary_embedding"]})]


def ensure_shaped_model(preset: str, cache_dir: Path = DEFAULT_CACHE_DIR) -> Path:
    """The folder of `preset`'s random-weight model (config, safetensors, tokenizer), built once."""
    config = preset_config(preset)
    digest = hashlib.sha256(json.dumps([_FORMAT_VERSION, _SEED, config], sort_keys=True).encode()).hexdigest()[:16]
    folder = Path(cache_dir) / f"{preset}-{digest}"
    if (folder / ".complete").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{preset}-", dir=folder.parent))
    try:
        _write_tokenizer(config, staging)
        _write_weights(config, staging)
        (staging / ".complete").write_text(digest)
        try:
            staging.rename(folder)
        except OSError:  # another process finished first: keep its folder
            if not (folder / ".complete").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _log.info("shaped model built", preset=preset, folder=str(folder))
    return folder


def _token_names(config: dict[str, Any]) -> list[str]:
    names = [f"t{i}" for i in range(config["vocab_size"])]
    names[0] = "<unk>"
    names[config["bos_token_id"]] = "<|begin_of_text|>"
    names[config["eos_token_id"]] = "<|end_of_text|>"
    return names


def _write_tokenizer(config: dict[str, Any], folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = _token_names(config)
    tokenizer = Tokenizer(models.WordLevel(vocab={name: i for i, name in enumerate(names)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Tokens join with single spaces (no token has the "##" continuation prefix), so decoded text encodes back
    # to the same ids.
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|begin_of_text|>",
                                   eos_token="<|end_of_text|>", unk_token="<unk>", model_max_length=1 << 20)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


def _write_weights(config: dict[str, Any], folder: Path) -> None:
    import torch
    import transformers

    config = {**config, **_layer_names_for(transformers.__version__, config)}
    config_class, model_class = _model_classes(config["model_type"])
    dtype = getattr(torch, config["dtype"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(_SEED)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(config_class(**config))
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="5GB")
    (folder / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()),
                                                    "dtype": config["dtype"]}, indent=2))
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


# transformers 4 names GraniteMoeHybrid's layer kinds "mamba" and "attention"; transformers 5 and vllm-cpu 0.32 name
# them "linear_attention" and "full_attention". Presets use the newer names; the written config.json uses the installed
# transformers' names. (CUDA vLLM 0.25's model looks up the old names: beside transformers 5, which renames them on
# load, it needs `vllm_layer_names_args`.)
_GRANITE_LAYER_NAMES_V4 = {"linear_attention": "mamba", "full_attention": "attention"}


def _layer_names_for(transformers_version: str, config: dict[str, Any]) -> dict[str, Any]:
    """`layer_types` as the installed transformers names them (empty when nothing changes)."""
    if config["model_type"] != "granitemoehybrid" or int(transformers_version.split(".")[0]) >= 5:
        return {}
    return {"layer_types": _granite_layer_names_v4(config)}


def _granite_layer_names_v4(config: dict[str, Any]) -> list[str]:
    return [_GRANITE_LAYER_NAMES_V4.get(kind, kind) for kind in config["layer_types"]]


def vllm_layer_names_args(config: dict[str, Any], vllm_layer_kinds: Collection[str]) -> list[str]:
    """`vllm serve` arguments that hand a vLLM whose model knows only `vllm_layer_kinds` (its Granite model's
    ALL_DECODER_LAYER_TYPES) the layer kinds in its own names, or nothing when it knows the preset's.

    transformers 5 renames "mamba"/"attention" to "linear_attention"/"full_attention" whatever config.json says,
    and CUDA vLLM 0.25's Granite 4.0-H model looks up the old names (KeyError 'linear_attention' at start-up, a
    colocated engine too); vLLM applies --hf-overrides after transformers loaded the config.
    """
    if config["model_type"] != "granitemoehybrid" or set(config["layer_types"]) <= set(vllm_layer_kinds):
        return []
    names = _granite_layer_names_v4(config)
    missing = sorted(set(names) - set(vllm_layer_kinds))
    if missing:
        raise ValueError(f"vLLM's Granite model knows layer kinds {sorted(vllm_layer_kinds)}, not {missing}")
    return ["--hf-overrides", json.dumps({"layer_types": names})]


def _model_classes(model_type: str) -> tuple[Any, Any]:
    """The transformers config and causal-LM classes of a preset's model_type."""
    import transformers

    classes = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
               "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
               "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
               "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM"),
               "gpt_oss": ("GptOssConfig", "GptOssForCausalLM")}
    try:
        config_name, model_name = classes[model_type]
    except KeyError:
        raise KeyError(f"no weights writer for model_type {model_type!r}; known: {sorted(classes)}") from None
    return getattr(transformers, config_name), getattr(transformers, model_name)
