"""The tiny model builder: deterministic, cached by spec, with a tokenizer vLLM's OpenAI server can use."""

from __future__ import annotations

import hashlib

import pytest

from kvpush.localstack.model import TinyModelSpec, ensure_tiny_model
from kvpush.localstack.processes import EngineSpec


def _digest(folder) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


def test_same_spec_gives_identical_weights_and_is_cached(tmp_path):
    """Two builds of one spec in different caches give byte-identical weights; a repeat call reuses the folder."""
    spec = TinyModelSpec(num_layers=1, hidden_size=64, intermediate_size=64, vocab_size=400, seed=7)
    first = ensure_tiny_model(spec, tmp_path / "a")
    second = ensure_tiny_model(spec, tmp_path / "b")
    assert _digest(first) == _digest(second)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(spec, tmp_path / "a") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime


def test_different_seed_gives_different_weights(tmp_path):
    """The seed is part of the cache key and changes the weights."""
    base = dict(num_layers=1, hidden_size=64, intermediate_size=64, vocab_size=400)
    one = ensure_tiny_model(TinyModelSpec(seed=1, **base), tmp_path)
    two = ensure_tiny_model(TinyModelSpec(seed=2, **base), tmp_path)
    assert one != two and _digest(one) != _digest(two)


def test_tokenizer_matches_vocab_and_has_chat_template(tiny_model_dir, tiny_model_spec):
    """The saved tokenizer has exactly the model's vocabulary, round-trips text and renders chat."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(tokenizer) == tiny_model_spec.vocab_size
    ids = tokenizer.encode("The prefill engine writes blocks.", add_special_tokens=False)
    assert max(ids) < tiny_model_spec.vocab_size
    assert tokenizer.decode(ids) == "The prefill engine writes blocks."
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<s>user: hi\nassistant: "


@pytest.mark.parametrize("field, value", [("head_dim", 16), ("num_kv_heads", 3), ("vocab_size", 100),
                                          ("num_layers", 0), ("dtype", "int8")])
def test_bad_spec_is_refused_before_building(tmp_path, field, value):
    """A spec vLLM on CPU could not load is refused with the field's name, and nothing is written."""
    spec = TinyModelSpec(**{field: value})
    with pytest.raises(ValueError, match=field):
        ensure_tiny_model(spec, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_engines_run_the_model_folder_dtype(tiny_model_dir, tiny_model_spec):
    """vLLM's "auto" would run a float32 folder in bfloat16 on CPU; the launcher passes the folder's dtype."""
    engine = EngineSpec(name="dtype-check", model_dir=tiny_model_dir)
    argv = engine.argv()
    assert argv[argv.index("--dtype") + 1] == tiny_model_spec.dtype == "float32"
    chosen = EngineSpec(name="dtype-check", model_dir=tiny_model_dir, extra_args=["--dtype", "bfloat16"]).argv()
    assert chosen.count("--dtype") == 1 and chosen[chosen.index("--dtype") + 1] == "bfloat16"
