"""Prefill and decode workers of a model with two KV-cache groups (Gemma 3's pattern under vLLM's hybrid KV-cache
manager: sliding-window layers 0 and 2 in group 0, full-attention layers 1 and 3 in group 1), on the in-memory NIXL
against a real directory on loopback.

Each group has its own block lists on both sides, drawn from one block pool. Decode's sliding group holds only the
prompt's last window: the blocks behind it are the null block (id 0), as vLLM leaves them. Checked for prompts
shorter than the window, longer than it, and chunked: full layers hold prefill's KV for every token, in their own
group's blocks; sliding layers hold it from the window's first block on; the null block and every other block stay
untouched; the bytes the transfer reports are exactly those written."""

from __future__ import annotations

import random
import time

import pytest
import torch

from kvpush.client.config import ChannelConfig
from kvpush.client.sync import SyncDirectoryClient
from kvpush.connector.halves import build_worker_half
from kvpush.connector.metadata import KVPushMetadata, PrefillChunk, ReceiveStart
from kvpush.dataplane.agent import TransferAgent
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.block_size_push import connector_config
from tests.fixtures.directory import directory_on_loopback
from tests.unit.connector.inmemory_helpers import new_fabric, nixl_config

BS, HEADS, HEAD, BLOCKS = 16, 2, 8, 64
WINDOW = 32
NAMES = [f"model.layers.{i}.self_attn" for i in range(4)]
GROUPS = [([NAMES[0], NAMES[2]], WINDOW), ([NAMES[1], NAMES[3]], 0)]
GROUP_OF = {NAMES[0]: 0, NAMES[1]: 1, NAMES[2]: 0, NAMES[3]: 1}
NULL = 0
BOUND_S = 20.0


def _caches(fill: bool, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (2, BLOCKS, BS, HEADS, HEAD)
    return {name: (torch.randn(shape, generator=gen) if fill else torch.zeros(shape)) for name in NAMES}


def _token(cache: torch.Tensor, blocks: tuple[int, ...], token: int) -> torch.Tensor:
    return cache[:, blocks[token // BS], token % BS]


def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.mark.parametrize(("prompt", "chunk_ends"), [
    (20, (20,)),               # shorter than the window: every block of every layer
    (100, (100,)),             # longer: the sliding group keeps blocks 4-6 (tokens 64-99 cover the last window)
    (150, (48, 96, 150)),      # chunked prefill, the window's first block written by the last chunk
])
def test_each_layer_lands_in_its_groups_blocks_and_sliding_layers_only_in_their_window(prompt, chunk_ends):
    fabric_name, _ = new_fabric()

    def create(config, kv_caches, block_size, heads, head_size, agent_name):
        agent = TransferAgent(agent_name, nixl_config(fabric_name))
        agent.register(kv_caches, block_size, heads, head_size)
        return agent.start()

    rng = random.Random(prompt)
    blocks = -(-prompt // BS)
    # vLLM: the sliding group skips tokens before prompt - window + 1; their blocks are the null block.
    first_block = max(0, prompt - WINDOW + 1) // BS
    with directory_on_loopback() as address:
        p_caches, d_caches = _caches(True, seed=prompt), _caches(False, seed=0)
        prefill = build_worker_half(connector_config(address, "prefill", "p", {}), p_caches, BS, HEADS, HEAD, 0, 1,
                                    "p-agent", create_agent=create, kv_cache_groups=GROUPS)
        decode = build_worker_half(connector_config(address, "decode", "d", {}), d_caches, BS, HEADS, HEAD, 0, 1,
                                   "d-agent", create_agent=create, kv_cache_groups=GROUPS)
        client = SyncDirectoryClient(ChannelConfig(address=address))
        try:
            (engine,) = client.get_engine("d")
            assert [(list(g.layers), g.sliding_window_tokens) for g in engine.layout.kv_cache_groups] \
                == [([0, 2], WINDOW), ([1, 3], 0)]
            p_pool = rng.sample(range(1, BLOCKS), 2 * blocks)  # one pool for both groups, as vLLM's
            src = (tuple(p_pool[:blocks]), tuple(p_pool[blocks:]))
            d_pool = rng.sample(range(1, BLOCKS), 2 * blocks)
            dst_sliding = tuple(NULL if i < first_block else d_pool[i] for i in range(blocks))
            dst = (dst_sliding, tuple(d_pool[blocks:]))
            before = {name: cache.clone() for name, cache in d_caches.items()}

            transfer_id = client.plan_transfer(prompt_token_count=prompt).transfer.transfer_id
            refused: list[str] = []
            decode.link.report_allocation(transfer_id, list(dst[0]), prompt, 0, refused.append,
                                          block_groups=[(dst[0], first_block * BS), (dst[1], 0)])
            decode.half.begin_step(KVPushMetadata(receives=[ReceiveStart("rd", transfer_id, dst[0], prompt, 0)]))
            start = 0
            for end in chunk_ends:
                n = -(-end // BS)
                prefill.half.begin_step(KVPushMetadata(prefill_chunks=[PrefillChunk(
                    "rp", transfer_id, start, end, prompt, src[0][:n], block_groups=(src[0][:n], src[1][:n]))]))
                for name in NAMES:
                    prefill.half.save_kv_layer(name)
                prefill.half.wait_for_save()
                start = end
            prefill.half.begin_step(KVPushMetadata(held_prefills=["rp"]))
            finished: set[str] = set()
            released: set[str] = set()
            errors: set[int] = set()

            def step() -> bool:
                done, failed = decode.half.collect()
                finished.update(done)
                errors.update(failed)
                released.update(prefill.half.get_finished_sending({"rp"}))
                return "rd" in finished and "rp" in released

            _until(step, "decode to finish receiving and prefill to release")
            assert refused == [] and errors == set()

            written_tokens = 0
            for name, d_cache in d_caches.items():
                group = GROUP_OF[name]
                first_token = first_block * BS if group == 0 else 0
                expected = before[name].clone()
                for t in range(first_token, prompt):
                    _token(expected, dst[group], t).copy_(_token(p_caches[name], src[group], t))
                # vLLM CPU-style whole blocks are not in play here (token-addressable layout): tokens exactly.
                written_tokens += prompt - first_token
                assert torch.equal(d_cache, expected), name
                assert torch.count_nonzero(d_cache[:, NULL]) == 0, f"{name}: the null block was written"
            transfer = client.get_transfer(transfer_id)
            assert transfer.state == tpb.TRANSFER_STATE_COMPLETE
            token_bytes = 2 * HEADS * HEAD * 4
            assert transfer.bytes_written == written_tokens * token_bytes
            assert [(list(g.block_ids), g.first_token) for g in transfer.decode_block_groups] \
                == [(list(dst[0]), first_block * BS), (list(dst[1]), 0)]
        finally:
            client.close()
            prefill.shutdown()
            decode.shutdown()
