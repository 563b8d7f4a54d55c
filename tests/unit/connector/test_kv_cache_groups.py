"""Which KV-cache groups KVPushConnector takes at start-up (`connector._kv_cache_groups`): attention groups of the
engine's block size and Mamba state groups kept one block per request; a state kept per prefix block (vLLM's 'align'
mode, prefix caching on) or any other group kind is refused naming the group."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvpush.connector.connector import _kv_cache_groups


class FullAttentionSpec(SimpleNamespace):
    pass


class MambaSpec(SimpleNamespace):
    pass


class CrossAttentionSpec(SimpleNamespace):
    pass


def _config(*specs: SimpleNamespace) -> SimpleNamespace:
    names = [[f"model.layers.{i}.mixer"] if isinstance(spec, MambaSpec) else [f"model.layers.{i}.attn"]
             for i, spec in enumerate(specs)]
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=layers)
                                            for spec, layers in zip(specs, names, strict=True)])


def test_a_mamba_group_is_a_state_group_with_its_own_block_size():
    groups, states = _kv_cache_groups(_config(MambaSpec(block_size=4096, mamba_cache_mode="none"),
                                              FullAttentionSpec(block_size=128)), 128)
    assert groups == [(["model.layers.0.mixer"], 0), (["model.layers.1.attn"], 0)]
    assert states == {0: (["model.layers.0.mixer"], 4096)}


def test_one_group_needs_no_description():
    assert _kv_cache_groups(_config(FullAttentionSpec(block_size=128)), 128) == ([], {})


@pytest.mark.parametrize("spec,message", [
    (MambaSpec(block_size=128, mamba_cache_mode="align"), "KV-cache group 0 .*Mamba cache mode 'align'.*"
                                                          "--no-enable-prefix-caching"),
    (CrossAttentionSpec(block_size=128), "KV-cache group 0 is CrossAttentionSpec"),
    (FullAttentionSpec(block_size=16), "KV-cache group 0 has 16-token blocks; the engine's are 128"),
])
def test_what_a_push_cannot_move_is_refused_naming_the_group(spec, message):
    with pytest.raises(ValueError, match=message):
        _kv_cache_groups(_config(spec, FullAttentionSpec(block_size=128)), 128)
