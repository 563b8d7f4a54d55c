"""Real NIXL head-sliced pushes between processes: a prefill worker holding 2 KV heads writes head 0 into one
decode process and head 1 into another (prefill TP 1 -> decode TP 2), each landing byte-exact with its own
notification; no other head or block is touched."""

from __future__ import annotations

import numpy as np
import pytest

from kvpush.dataplane import WriteRequest
from kvpush.dataplane.layout import HeadSlice
from tests.integration.dataplane.peer_process import PeerSpec
from tests.integration.dataplane.test_push import BOUND_S, decode_peer, prefill_agent

pytestmark = pytest.mark.nixl

LAYERS, BLOCKS, BS, HEAD = 3, 24, 32, 32


@pytest.mark.parametrize("hint", ["cpu_attn", "fused_kv"])
def test_one_worker_splits_its_heads_over_two_decode_processes(hint):
    specs = [PeerSpec(f"decode-heads-{hint}-{rank}", LAYERS, BLOCKS, BS, 1, HEAD, hint) for rank in range(2)]
    with decode_peer(specs[0]) as peer0, decode_peer(specs[1]) as peer1, \
            prefill_agent(LAYERS, BLOCKS, BS, 2, HEAD, hint) as (agent, writer, out, _layout, arrays):
        peers = [peer0, peer1]
        for spec, peer in zip(specs, peers, strict=True):
            agent.add_peer(spec.name, peer.metadata, peer.layout).result(BOUND_S)
        src, dst, tokens = [5, 17, 2], [9, 0, 20], 2 * BS + 7
        for rank, spec in enumerate(specs):
            for layer in range(LAYERS):
                writer.submit(WriteRequest(f"t-heads-{rank}", spec.name, (layer,), src, dst, 0, tokens,
                                           notify=f"t-heads-{rank}".encode() if layer == LAYERS - 1 else None,
                                           head_slice=HeadSlice(rank, 0, 1)))
        assert out.wait(lambda: len(out.transfers) == 2), "transfers did not finish"
        assert all(o.ok and o.notified for o in out.transfers)
        head_block = BS * 2 * HEAD * 2
        per_layer = 3 * head_block if hint == "cpu_attn" else tokens * 2 * HEAD * 2
        assert sorted(o.bytes for o in out.transfers) == [LAYERS * per_layer] * 2
        for rank, peer in enumerate(peers):
            assert [m for _a, m in peer.notifs(1)] == [f"t-heads-{rank}".encode()]
            dumped = peer.dump()
            for layer in range(LAYERS):
                for s, d in zip(src[:2], dst[:2], strict=True):
                    assert np.array_equal(dumped[layer][d, 0], arrays[layer][s, rank]), (rank, layer, d)
                assert not dumped[layer][[b for b in range(BLOCKS) if b not in dst]].any()
