"""Random-weight models of real shapes (Llama-3.1-8B's config), made on the machine that runs them and cached.

No model can be downloaded where the GPU runs, and vLLM's own dummy weights (uniform in ±1e-3, norms
included) give logits so flat that bf16 rounding decides most greedy tokens. So the weights here are what
`transformers` initialises (normal, std = initializer_range; norms 1), seeded, in bf16, made on the GPU
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
PRESETS = {"llama-3.1-8b": LLAMA_3_1_8B, "tiny-llama": TINY_LLAMA}
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


def kv_bytes_per_token(config: dict[str, Any]) -> int:
    """Bytes of K and V one token occupies in one layer (the unit of every push)."""
    element = 2 if config["dtype"] in ("bfloat16", "float16") else 4
    return 2 * config["num_key_value_heads"] * config["head_dim"] * element


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
    from transformers import LlamaConfig, LlamaForCausalLM

    dtype = getattr(torch, config["dtype"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(_SEED)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**config))
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="5GB")
    (folder / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()),
                                                    "dtype": config["dtype"]}, indent=2))
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
