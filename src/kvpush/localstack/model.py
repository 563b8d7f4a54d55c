"""A tiny, deterministic, random Llama model plus a locally trained tokenizer, for real vLLM engines on CPU.

Life cycle: `ensure_tiny_model(spec)` hashes the spec, and if `<cache>/<hash>/` is complete returns it at
once; otherwise it builds the model (seeded random weights, saved as safetensors) and a byte-level BPE
tokenizer trained on a built-in text (vocabulary size = the model's), with a chat template, into a
temporary folder and renames it into place, so a crash never leaves a half-written model behind and
two processes building the same spec at once both end with a complete folder.

The weights are random: generated text is gibberish, but greedy output is deterministic, which is all
the P/D correctness checks need. vLLM's CPU attention wants head_dim in {32, 64, 80, ...}; 16 fails.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kvpush.observability import get_logger

_log = get_logger("localstack.model")

# Bump when the on-disk format of what ensure_tiny_model writes changes, so old caches are not reused.
_FORMAT_VERSION = 2

# head_dim values the vLLM CPU attention backend accepts (REFERENCE §4).
CPU_HEAD_DIMS = frozenset({32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512})

DEFAULT_CACHE_DIR = Path(os.environ.get("KVPUSH_MODEL_CACHE", Path.home() / ".cache" / "kvpush" / "models"))

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"

# A ChatML-like template; the tokenizer has no dedicated role tokens, so roles are plain text.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

# The built-in training text: public-domain style prose about the project's own domain, repeated
# with deterministic variations so byte-level BPE has enough pairs to reach a few thousand merges.
_BASE_TEXT = """
The prefill engine computes the prompt and writes every layer of its key and value cache into the
blocks that the decode engine allocated before the prompt was computed. The directory knows which
blocks belong to which request, tells the prefill worker where to write, and watches every transfer
until it completes, fails, expires or is cancelled. A gateway plans the transfer, sends the prefill
leg and the decode leg at the same time, and returns the decode response to the client.
Once upon a time a small model lived on a machine with two cores and twenty four gigabytes of memory.
It answered questions about the weather, the sea, mountains, rivers, cities, numbers and colours.
One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, thirteen, fourteen.
Red, orange, yellow, green, blue, indigo, violet, black, white, grey, brown, pink, purple, gold.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday, January, February, March, April.
What is the capital of France? Paris is the capital of France. Tell me a story about a lighthouse.
The quick brown fox jumps over the lazy dog while the network carries bytes from one host to another.
"""


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    """Shape and seed of a tiny random Llama; equal specs always give byte-identical model folders."""

    num_layers: int = 2
    hidden_size: int = 64
    intermediate_size: int = 128
    num_attention_heads: int = 2
    num_kv_heads: int = 2
    head_dim: int = 32
    vocab_size: int = 1024
    max_position_embeddings: int = 4096
    seed: int = 1234
    # A larger init range than Llama's 0.02 makes logits peaked, so greedy decoding rarely meets
    # near-ties that differ between a full-prompt forward and a one-token forward.
    initializer_range: float = 0.2
    # float32, because the tests compare decode output with a colocated engine token for token: vLLM's CPU
    # kernels round differently when a prompt is cut into different prefill chunks (batch composition),
    # and in bfloat16 that moves a logit by one ulp (0.03), enough to flip the near-ties a random model
    # has (measured: the colocated engine's top two at one position were 0.031 apart). float32 noise is
    # ~1e-6; the smallest gap over the tests' prompts is ~1e-3.
    dtype: str = "float32"

    def validate(self) -> None:
        """Raise ValueError naming the first field that vLLM on CPU or the Llama code would refuse."""
        positive = ("num_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_kv_heads",
                    "head_dim", "vocab_size", "max_position_embeddings")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"TinyModelSpec.{name} must be a positive int, got {value!r}")
        if self.head_dim not in CPU_HEAD_DIMS:
            raise ValueError(f"TinyModelSpec.head_dim={self.head_dim} is not accepted by vLLM's CPU attention; "
                             f"use one of {sorted(CPU_HEAD_DIMS)}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.vocab_size < 300:
            raise ValueError(f"vocab_size={self.vocab_size} is too small: the byte-level tokenizer needs 256 "
                             "byte tokens, 3 special tokens and some merges (>= 300)")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtype={self.dtype!r} must be bfloat16, float16 or float32")

    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token occupies over all layers (K and V)."""
        element = 4 if self.dtype == "float32" else 2
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * element

    def kv_config(self) -> dict[str, Any]:
        """The model's KV fields by a Hugging Face config's names (what `shaped_model.pushed_kv_bytes` reads)."""
        return {"num_hidden_layers": self.num_layers, "num_key_value_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "dtype": self.dtype}

    def config_hash(self) -> str:
        """A short stable hash of the spec and the on-disk format version (the cache key)."""
        payload = json.dumps({"format": _FORMAT_VERSION, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


# The benchmark model of the TTFT spec: 8 layers, hidden 512, 8 KV heads x 64 -> 16 KiB of KV per token,
# 32 MiB for a 2048-token prompt.
BENCH_MODEL_SPEC = TinyModelSpec(num_layers=8, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                                 num_kv_heads=8, head_dim=64, vocab_size=4096, max_position_embeddings=4096,
                                 dtype="bfloat16")


def ensure_tiny_model(spec: TinyModelSpec | None = None, cache_dir: Path | str | None = None) -> Path:
    """Return the folder holding the model and tokenizer for `spec`, building it on first use.

    Repeated calls with the same spec return the cached folder without touching torch.
    """
    spec = spec or TinyModelSpec()
    spec.validate()
    root = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR
    target = root / f"tiny-llama-{spec.config_hash()}"
    if (target / "complete.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        _log.info("building tiny model", spec=dataclasses.asdict(spec), target=str(target))
        _write_model(spec, staging)
        _write_tokenizer(spec, staging)
        (staging / "complete.json").write_text(json.dumps(dataclasses.asdict(spec), sort_keys=True))
        try:
            staging.rename(target)
        except OSError:
            # Another process finished the same spec first; its folder is equivalent.
            if not (target / "complete.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_model(spec: TinyModelSpec, folder: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(getattr(torch, spec.dtype))
    model.config.dtype = spec.dtype
    model.save_pretrained(folder, safe_serialization=True)


def training_text(repeats: int = 60) -> str:
    """The deterministic built-in corpus the tokenizer is trained on."""
    words = _BASE_TEXT.split()
    lines = [_BASE_TEXT]
    for i in range(repeats):
        # Rotate the word list and splice numbers in, so merges across many word pairs appear.
        rotated = words[i % len(words):] + words[: i % len(words)]
        lines.append(" ".join(f"{w} {i * 7 + j}" if j % 11 == 0 else w for j, w in enumerate(rotated)))
    return "\n".join(lines)


def _write_tokenizer(spec: TinyModelSpec, folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = [UNK_TOKEN, BOS_TOKEN, EOS_TOKEN]  # ids 0, 1, 2: match the model config
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(training_text().splitlines(), trainer=trainer)
    # A small corpus may run out of merges before the vocabulary is full; fill it with inert tokens so
    # every id the model can emit decodes to something.
    missing = spec.vocab_size - tokenizer.get_vocab_size()
    if missing > 0:
        tokenizer.add_tokens([f"<|filler_{i}|>" for i in range(missing)])
    if tokenizer.get_vocab_size() != spec.vocab_size:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, model {spec.vocab_size}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
                                   unk_token=UNK_TOKEN, model_max_length=spec.max_position_embeddings)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
