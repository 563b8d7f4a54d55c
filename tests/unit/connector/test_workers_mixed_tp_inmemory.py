"""Worker halves of engines of different TP sizes against a real directory on loopback and the in-memory NIXL.

The model has 2 KV heads: a TP 1 worker holds both, each TP 2 worker one. Prefill TP 1 -> decode TP 2 splits
each block's heads over the two decode workers; prefill TP 2 -> decode TP 1 fills each decode block from both
prefill workers. Every destination head lands byte-exact, no other block is touched, the transfer completes,
each prefill rank reports exactly the bytes of its heads, and every worker finishes.
"""

from __future__ import annotations

import time

import pytest
import torch

from kvpush.client.config import ChannelConfig
from kvpush.client.sync import SyncDirectoryClient
from kvpush.connector.halves import build_worker_half
from kvpush.connector.metadata import KVPushMetadata, PrefillChunk, ReceiveStart
from kvpush.connector.worker.decode import DecodeWorker
from kvpush.dataplane.agent import TransferAgent
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import directory_on_loopback
from tests.unit.connector.inmemory_helpers import connector_config, new_fabric, nixl_config

LAYERS, BLOCKS, BS, MODEL_HEADS, HEAD = 3, 16, 16, 2, 16
BOUND_S = 10.0
HEAD_BLOCK_BYTES = BS * 2 * HEAD * 2  # one head of one block: K and V rows, bfloat16


def _caches(heads: int, seed: int | None) -> dict[str, torch.Tensor]:
    shape = (BLOCKS, heads, BS, 2 * HEAD)
    if seed is None:
        return {f"model.layers.{i}.self_attn": torch.zeros(shape, dtype=torch.bfloat16) for i in range(LAYERS)}
    gen = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn": torch.randint(-1000, 1000, shape, generator=gen).to(torch.bfloat16)
            for i in range(LAYERS)}


def _in_memory_agent(fabric_name: str):
    def create(config, kv_caches, block_size, heads, head_size, agent_name):
        agent = TransferAgent(agent_name, nixl_config(fabric_name))
        agent.register(kv_caches, block_size, heads, head_size)
        return agent.start()

    return create


def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _engine(address: str, fabric_name: str, role: str, engine_id: str, tp: int, seed: int | None):
    heads = MODEL_HEADS // tp
    parts = []
    for rank in range(tp):
        caches = _caches(heads, None if seed is None else seed + rank)
        parts.append((build_worker_half(connector_config(address, role, engine_id), caches, BS, heads, HEAD, rank, tp,
                                        f"{engine_id}-agent-{rank}", create_agent=_in_memory_agent(fabric_name),
                                        model_kv_head_count=MODEL_HEADS), caches))
    return parts


def _model_head(caches_of_rank: list[dict[str, torch.Tensor]], tp: int, name: str, block: int, head: int):
    per_rank = MODEL_HEADS // tp
    return caches_of_rank[head // per_rank][name][block, head % per_rank]


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1)])
def test_mixed_tp_push_lands_every_head_byte_exact(prefill_tp, decode_tp):
    fabric_name, _ = new_fabric()
    with directory_on_loopback() as address:
        prefills = _engine(address, fabric_name, "prefill", "p", prefill_tp, seed=5)
        decodes = _engine(address, fabric_name, "decode", "d", decode_tp, seed=None)
        client = SyncDirectoryClient(ChannelConfig(address=address))
        try:
            prompt, src, dst = 40, (4, 9, 2), (11, 3, 7)
            transfer_id = client.plan_transfer(prompt_token_count=prompt).transfer.transfer_id
            refused: list[str] = []
            decodes[0][0].link.report_allocation(transfer_id, list(dst), prompt, 0, refused.append)
            for half, _c in decodes:
                half.half.begin_step(KVPushMetadata(receives=[ReceiveStart("rd", transfer_id, dst, prompt, 0)]))
            for half, caches in prefills:
                half.half.begin_step(KVPushMetadata(prefill_chunks=[
                    PrefillChunk("rp", transfer_id, 0, prompt, prompt, src)]))
                for name in caches:
                    half.half.save_kv_layer(name)
                half.half.wait_for_save()
                half.half.begin_step(KVPushMetadata(held_prefills=["rp"]))
            finished = [set() for _ in decodes]
            released = [set() for _ in prefills]

            def step() -> bool:
                for seen, (half, _c) in zip(finished, decodes, strict=True):
                    seen.update(half.half.collect()[0])
                for seen, (half, _c) in zip(released, prefills, strict=True):
                    seen.update(half.half.get_finished_sending({"rp"}))
                return all("rd" in s for s in finished) and all("rp" in s for s in released)

            _until(step, "every decode worker to finish receiving and every prefill worker to release")
            assert refused == []
            p_caches = [c for _h, c in prefills]
            d_caches = [c for _h, c in decodes]
            for name in p_caches[0]:
                for s, d in zip(src, dst, strict=True):
                    for head in range(MODEL_HEADS):
                        assert torch.equal(_model_head(d_caches, decode_tp, name, d, head),
                                           _model_head(p_caches, prefill_tp, name, s, head)), (name, head)
                for caches in d_caches:
                    untouched = [b for b in range(BLOCKS) if b not in dst]
                    assert not caches[name][untouched].any(), "a block outside the allocation was written"
            transfer = client.get_transfer(transfer_id)
            assert transfer.state == tpb.TRANSFER_STATE_COMPLETE
            # Each prefill rank moved its heads of 3 blocks in every layer, once per head.
            per_rank = LAYERS * len(src) * HEAD_BLOCK_BYTES * (MODEL_HEADS // prefill_tp)
            assert sorted(r.timing.bytes_written for r in transfer.rank_timings) == [per_rank] * prefill_tp
            assert transfer.bytes_written == per_rank * prefill_tp
        finally:
            client.close()
            for half, _c in (*prefills, *decodes):
                half.shutdown()


def test_a_receive_written_by_two_prefill_workers_completes_on_the_second_notification_only():
    config = connector_config("127.0.0.1:1", "decode", "d")
    worker = DecodeWorker(config, None, BS)
    worker.on_notification("p-agent-0", b"t1\n0/2")
    worker.on_notification("p-agent-0", b"t1\n0/2")  # a repeat counts once
    assert worker._inbox.qsize() == 0
    worker.on_notification("p-agent-1", b"t1\n1/2")
    assert worker._inbox.qsize() == 1
    worker.on_notification("x", b"t2\n3/2")  # malformed part: ignored
    worker.on_notification("x", b"t3")  # one writer: at once
    assert worker._inbox.qsize() == 2
