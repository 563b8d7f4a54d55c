"""Prefill and decode workers of different block sizes (16 -> 128 and 128 -> 16), wired by `halves.build_worker_half`,
against a real directory on loopback and the in-memory NIXL, with token-addressable (FlashAttention kv_first NHD)
layouts: the directory pairs them, prefill plans its writes in its own blocks and decode's blocks in decode's size,
and decode's cache holds prefill's KV token by token, for prompts ending mid-block, chunked prefill (decode blocks
cut by the writes of two chunks), a prefix hit on decode and one on prefill. Every block is released on both sides:
the next transfer reuses the same decode blocks, and the directory would refuse a block still owned."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import pytest
import torch

from kvpush.client.config import ChannelConfig
from kvpush.client.sync import SyncDirectoryClient
from kvpush.connector.halves import DecodeWorkerHalf, PrefillWorkerHalf, build_worker_half
from kvpush.connector.metadata import KVPushMetadata, PrefillChunk, ReceiveStart
from kvpush.dataplane.agent import TransferAgent
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import directory_on_loopback
from tests.unit.connector.inmemory_helpers import connector_config, new_fabric, nixl_config

LAYERS, HEADS, HEAD = 3, 2, 8
CAPACITY_TOKENS = 1024  # each engine's cache: CAPACITY_TOKENS / block size blocks
BOUND_S = 20.0


def _caches(block_size: int, fill: bool, seed: int) -> dict[str, torch.Tensor]:
    """Per layer a (2, blocks, block_size, heads, head) float32 cache: K/V first, tokens contiguous (NHD)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (2, CAPACITY_TOKENS // block_size, block_size, HEADS, HEAD)
    return {f"model.layers.{i}.self_attn": (torch.randn(shape, generator=gen) if fill else torch.zeros(shape))
            for i in range(LAYERS)}


def _in_memory_agent(fabric_name: str):
    def create(config, kv_caches, block_size, heads, head_size, agent_name):
        agent = TransferAgent(agent_name, nixl_config(fabric_name))
        agent.register(kv_caches, block_size, heads, head_size)  # 5-D with 2 first: kv_first, token-addressable
        return agent.start()

    return create


def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _token(cache: torch.Tensor, blocks: tuple[int, ...], block_size: int, token: int) -> torch.Tensor:
    """K and V of one token: (2, heads, head)."""
    return cache[:, blocks[token // block_size], token % block_size]


@dataclass(frozen=True)
class Case:
    """One request: its prompt, the chunk ends prefill computes it in, decode's own prefix hit (a multiple of
    decode's block size) and prefill's own prefix-cache hit (a multiple of prefill's)."""

    prompt: int
    chunk_ends: tuple[int, ...]
    decode_hit: int = 0
    prefill_hit: int = 0


def _cases(prefill_size: int, decode_size: int) -> list[Case]:
    return [
        Case(40, (40,)),                                  # one step, a partial last block on both sides
        Case(300, (100, 200, 300)),                       # chunked: decode blocks cut by two chunks' writes
        Case(257, (129, 257), decode_hit=2 * decode_size),  # decode holds a prefix; the push starts there
        Case(300, (300,), prefill_hit=2 * prefill_size),  # prefill's own cache holds a prefix (pushed too)
        Case(128, (50, 128)),                             # a prompt of exactly one 128-token block
    ]


def _push(prefill, decode, p_caches, transfer_id: str, case: Case, src: tuple[int, ...], dst: tuple[int, ...],
          prefill_size: int, n: int) -> tuple[list[str], set[int]]:
    """Decode reports its blocks and waits; prefill computes the prompt chunk by chunk (every layer of each), then
    holds the request. Returns the directory's refusals of decode's allocation and decode's load errors, once
    decode finished receiving and prefill released the request."""
    refused: list[str] = []
    rp, rd = f"rp{n}", f"rd{n}"
    decode.link.report_allocation(transfer_id, list(dst), case.prompt, case.decode_hit, refused.append)
    decode.half.begin_step(KVPushMetadata(receives=[ReceiveStart(rd, transfer_id, dst, case.prompt, case.decode_hit)]))
    start = case.prefill_hit
    for end in case.chunk_ends:
        chunk = PrefillChunk(rp, transfer_id, start, end, case.prompt, src[:-(-end // prefill_size)],
                             cached_token_count=case.prefill_hit if start == case.prefill_hit else 0)
        prefill.half.begin_step(KVPushMetadata(prefill_chunks=[chunk]))
        for name in p_caches:
            prefill.half.save_kv_layer(name)
        prefill.half.wait_for_save()
        start = end
    prefill.half.begin_step(KVPushMetadata(held_prefills=[rp]))
    finished: set[str] = set()
    errors: set[int] = set()
    released: set[str] = set()

    def step() -> bool:
        done, failed = decode.half.collect()
        finished.update(done)
        errors.update(failed)
        released.update(prefill.half.get_finished_sending({rp}))
        return rd in finished and rp in released

    _until(step, f"case {case}: decode to finish receiving and prefill to release")
    return refused, errors


@pytest.mark.parametrize(("prefill_size", "decode_size"), [(16, 128), (128, 16)])
def test_decode_holds_prefill_kv_token_by_token_across_block_sizes(prefill_size: int, decode_size: int):
    fabric_name, _ = new_fabric()
    rng = random.Random(7)
    with directory_on_loopback() as address:
        p_caches = _caches(prefill_size, True, seed=prefill_size)
        d_caches = _caches(decode_size, False, seed=0)
        prefill = build_worker_half(connector_config(address, "prefill", "p"), p_caches, prefill_size, HEADS, HEAD,
                                    0, 1, "p-agent", create_agent=_in_memory_agent(fabric_name))
        decode = build_worker_half(connector_config(address, "decode", "d"), d_caches, decode_size, HEADS, HEAD,
                                   0, 1, "d-agent", create_agent=_in_memory_agent(fabric_name))
        client = SyncDirectoryClient(ChannelConfig(address=address))
        assert isinstance(prefill.half, PrefillWorkerHalf) and isinstance(decode.half, DecodeWorkerHalf)
        assert prefill.agent.layout.layout_name == "kv_first_nhd" and not prefill.agent.layout.block_atomic
        token_bytes = sum(p.segment_count * p.segment_bytes_per_token for p in prefill.agent.layout.planes)
        # The same decode blocks for every case (shuffled once): each case reuses those the one before released.
        d_pool = list(range(CAPACITY_TOKENS // decode_size))
        rng.shuffle(d_pool)
        try:
            for n, case in enumerate(_cases(prefill_size, decode_size)):
                src = tuple(rng.sample(range(CAPACITY_TOKENS // prefill_size), -(-case.prompt // prefill_size)))
                dst = tuple(d_pool[:-(-case.prompt // decode_size)])
                for cache in d_caches.values():
                    cache.zero_()
                    # Decode's own prefix: bytes of its own that the push must leave alone.
                    for t in range(case.decode_hit):
                        _token(cache, dst, decode_size, t).fill_(float(n + 1))
                before = {name: cache.clone() for name, cache in d_caches.items()}
                transfer_id = client.plan_transfer(prompt_token_count=case.prompt).transfer.transfer_id
                refused, errors = _push(prefill, decode, p_caches, transfer_id, case, src, dst, prefill_size, n)
                assert refused == [] and errors == set(), (case, refused, errors)
                for name, d_cache in d_caches.items():
                    expected = before[name].clone()
                    for t in range(case.decode_hit, case.prompt):
                        _token(expected, dst, decode_size, t).copy_(_token(p_caches[name], src, prefill_size, t))
                    # Whole-cache equality: every pushed token in place, decode's own prefix and every other
                    # token of every block untouched.
                    for t in range(case.prompt):
                        assert torch.equal(_token(d_cache, dst, decode_size, t),
                                           _token(expected, dst, decode_size, t)), (case, name, t)
                    assert torch.equal(d_cache, expected), (case, name)
                transfer = client.get_transfer(transfer_id)
                assert transfer.state == tpb.TRANSFER_STATE_COMPLETE, case
                pushed_bytes = (case.prompt - case.decode_hit) * token_bytes * LAYERS
                assert transfer.bytes_written == pushed_bytes, case
                (rank,) = transfer.rank_timings
                assert rank.timing.bytes_written == pushed_bytes, case
        finally:
            client.close()
            prefill.shutdown()
            decode.shutdown()
