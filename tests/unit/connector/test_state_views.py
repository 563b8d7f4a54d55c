"""KVPushConnector's view of a state layer on vLLM 0.30+: one raw int8 page view per layer, `(num_blocks, 1, 1,
page)` from the layer's own block 0 (as `MambaBase.bind_kv_cache` receives it), turned into conv and SSM views at
that very address; vLLM 0.25's lists pass through."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvpush.connector.connector import _with_state_views
from kvpush.dataplane.describe import describe_state_layers

PAGE, BLOCKS = 65536, 8
CONV, SSM = (3, 288), (8, 32, 16)


def _config() -> SimpleNamespace:
    spec = SimpleNamespace(shapes=(CONV, SSM), dtypes=(torch.float32, torch.float32))
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=["m0", "m2"], kv_cache_spec=spec)])


def test_each_layers_page_view_is_read_at_its_own_address():
    """Two Mamba layers in one allocation, the second 512 KiB in: each layer's views start at its own page view's
    address (nothing added for its place in the allocation) and equal the layer's bound conv and SSM states."""
    backing = torch.zeros(2 * BLOCKS * PAGE, dtype=torch.int8)
    pages = {name: backing[i * BLOCKS * PAGE:(i + 1) * BLOCKS * PAGE].view(BLOCKS, 1, 1, PAGE)
             for i, name in enumerate(("m0", "m2"))}
    views = _with_state_views({**pages, "a1": torch.zeros(1)}, _config(), {0: (["m0", "m2"], 4096)})
    for name, page in pages.items():
        conv, ssm = views[name]
        flat = page.squeeze(dim=(1, 2))
        bound_conv = flat[:, :3 * 288 * 4].view(torch.float32).view(-1, *CONV)  # MambaBase.bind_kv_cache
        bound_ssm = flat[:, 3 * 288 * 4:(3 * 288 + 8 * 32 * 16) * 4].view(torch.float32).view(-1, *SSM)
        for view, bound in ((conv, bound_conv), (ssm, bound_ssm)):
            assert (view.data_ptr(), tuple(view.shape), tuple(view.stride())) == (
                bound.data_ptr(), tuple(bound.shape), tuple(bound.stride()))
    spec = describe_state_layers({name: views[name] for name in pages})
    assert spec.layer_base_addresses == (backing.data_ptr(), backing.data_ptr() + BLOCKS * PAGE)
    assert (spec.block_stride_bytes, spec.block_count, spec.state_bytes_per_block) == (PAGE, BLOCKS, 19840)


def test_lists_of_views_pass_through():
    state = [torch.zeros(BLOCKS, *CONV), torch.zeros(BLOCKS, *SSM)]
    views = _with_state_views({"m0": state, "m2": state}, _config(), {0: (["m0", "m2"], 4096)})  # type: ignore[dict-item]
    assert views["m0"] is state
