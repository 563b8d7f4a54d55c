"""Both worker halves, wired by `halves.build_worker_half`, against a real directory on loopback and the
in-memory NIXL: DirectoryLink, PushTransport, PrefillWorker's owner on the I/O thread and DecodeWorker, in one
process. A push lands byte-exact and decode reports the request finished; a cancelled push confirms."""

from __future__ import annotations

import time

import torch

from kvpush.client.config import ChannelConfig
from kvpush.client.sync import SyncDirectoryClient
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.halves import DecodeWorkerHalf, PrefillWorkerHalf, build_worker_half
from kvpush.connector.metadata import KVPushMetadata, PrefillChunk, ReceiveStart
from kvpush.connector.worker.layout_wire import layout_to_proto
from kvpush.dataplane.agent import TransferAgent
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import PREFILL, directory_on_loopback, register_request
from tests.unit.connector.inmemory_helpers import connector_config, new_fabric, nixl_config

LAYERS, BLOCKS, BS, HEADS, HEAD = 3, 16, 16, 2, 16
BOUND_S = 10.0


def _caches(fill: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {f"model.layers.{i}.self_attn": (torch.randint(-1000, 1000, (BLOCKS, HEADS, BS, 2 * HEAD), generator=gen)
                                            .to(torch.bfloat16) if fill else
                                            torch.zeros((BLOCKS, HEADS, BS, 2 * HEAD), dtype=torch.bfloat16))
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


def _prefill_one_step(prefill, decode, p_caches, transfer_id: str, prompt: int, src, dst, on_refused) -> None:
    """Decode reports its blocks `dst` and starts receiving ("rd"); prefill computes every layer of the prompt
    from blocks `src` ("rp") in one step."""
    decode.link.report_allocation(transfer_id, list(dst), prompt, 0, on_refused)
    decode.half.begin_step(KVPushMetadata(receives=[ReceiveStart("rd", transfer_id, dst, prompt, 0)]))
    prefill.half.begin_step(KVPushMetadata(prefill_chunks=[PrefillChunk("rp", transfer_id, 0, prompt, prompt, src)]))
    for name in p_caches:
        prefill.half.save_kv_layer(name)
    prefill.half.wait_for_save()


def test_push_lands_byte_exact_and_decode_finishes_receiving():
    """Prefill computes three layers, the directory dispatches, the owner writes, decode hears and finishes."""
    fabric_name, _ = new_fabric()
    with directory_on_loopback() as address:
        p_caches, d_caches = _caches(True), _caches(False)
        prefill = build_worker_half(connector_config(address, "prefill", "p"), p_caches, BS, HEADS, HEAD, 0, 1,
                                    "p-agent", create_agent=_in_memory_agent(fabric_name))
        decode = build_worker_half(connector_config(address, "decode", "d"), d_caches, BS, HEADS, HEAD, 0, 1,
                                   "d-agent", create_agent=_in_memory_agent(fabric_name))
        client = SyncDirectoryClient(ChannelConfig(address=address))
        try:
            assert isinstance(prefill.half, PrefillWorkerHalf) and isinstance(decode.half, DecodeWorkerHalf)
            prompt, src, dst = 40, (4, 9, 2), (11, 3, 7)
            transfer_id = client.plan_transfer(prompt_token_count=prompt).transfer.transfer_id
            refused: list[str] = []
            _prefill_one_step(prefill, decode, p_caches, transfer_id, prompt, src, dst, refused.append)
            prefill.half.begin_step(KVPushMetadata(held_prefills=["rp"]))
            finished: set[str] = set()
            released: set[str] = set()

            def step() -> bool:
                finished.update(decode.half.collect()[0])
                released.update(prefill.half.get_finished_sending({"rp"}))
                return "rd" in finished and "rp" in released

            _until(step, "decode to finish receiving and prefill to release")
            assert refused == []
            for name in p_caches:
                for s, d in zip(src, dst):
                    assert torch.equal(d_caches[name][d], p_caches[name][s]), (name, s, d)
            assert not d_caches[next(iter(d_caches))][0].any(), "an unassigned block was written"
            transfer = client.get_transfer(transfer_id)
            assert transfer.state == tpb.TRANSFER_STATE_COMPLETE and transfer.bytes_written > 0
            (rank,) = transfer.rank_timings
            assert rank.timing.write_count == LAYERS and rank.timing.bytes_written == transfer.bytes_written
        finally:
            client.close()
            prefill.shutdown()
            decode.shutdown()


def test_cancelled_before_dispatch_is_confirmed_and_released():
    """A cancellation of a transfer prefill holds but was never dispatched: prefill confirms CANCELLED, decode
    hears the terminal state and reports the request finished with its blocks as load errors."""
    fabric_name, _ = new_fabric()
    with directory_on_loopback() as address:
        p_caches, d_caches = _caches(True), _caches(False)
        prefill = build_worker_half(connector_config(address, "prefill", "p"), p_caches, BS, HEADS, HEAD, 0, 1,
                                    "p-agent", create_agent=_in_memory_agent(fabric_name))
        decode = build_worker_half(connector_config(address, "decode", "d"), d_caches, BS, HEADS, HEAD, 0, 1,
                                   "d-agent", create_agent=_in_memory_agent(fabric_name))
        client = SyncDirectoryClient(ChannelConfig(address=address))
        try:
            prompt = 40
            transfer_id = client.plan_transfer(prompt_token_count=prompt).transfer.transfer_id
            prefill.half.begin_step(KVPushMetadata(prefill_chunks=[
                PrefillChunk("rp", transfer_id, 0, prompt, prompt, (1, 2, 3))]))
            for name in p_caches:
                prefill.half.save_kv_layer(name)
            prefill.half.wait_for_save()
            prefill.half.begin_step(KVPushMetadata(held_prefills=["rp"]))
            decode.half.begin_step(KVPushMetadata(receives=[ReceiveStart("rd", transfer_id, (5, 6, 7), prompt, 0)]))
            client.cancel_transfer(transfer_id, "gateway gave up")
            released: set[str] = set()
            results: list = []

            def step() -> bool:
                released.update(prefill.half.get_finished_sending({"rp"}))
                finished, errors = decode.half.collect()
                if finished:
                    results.append((finished, errors))
                return "rp" in released and bool(results)

            _until(step, "prefill to release and decode to finish")
            assert results == [({"rd"}, {5, 6, 7})]
            assert client.get_transfer(transfer_id).state == tpb.TRANSFER_STATE_CANCELLED
            assert not any(c.any() for c in d_caches.values()), "a cancelled push wrote into decode's blocks"
        finally:
            client.close()
            prefill.shutdown()
            decode.shutdown()


def test_a_receive_past_its_bound_is_cancelled_then_released_as_load_errors():
    """No prefill ever pushes: past transfer_timeout_s decode cancels the transfer at the directory, and once
    the directory confirms the terminal state the request finishes with its pushed blocks as load errors."""
    fabric_name, _ = new_fabric()
    with directory_on_loopback() as address:
        config = ConnectorConfig.from_extra_config({"directory_address": address, "transfer_timeout_s": 0.3},
                                                   role="decode", engine_id="d")
        decode = build_worker_half(config, _caches(False), BS, HEADS, HEAD, 0, 1, "d-agent",
                                   create_agent=_in_memory_agent(fabric_name))
        client = SyncDirectoryClient(ChannelConfig(address=address))
        try:
            # A prefill engine that never pushes (registered only, with decode's layout so they are paired).
            client.register_engine(register_request("p", PREFILL, layout=layout_to_proto(decode.agent.layout)))
            prompt = 40
            transfer_id = client.plan_transfer(prompt_token_count=prompt).transfer.transfer_id
            decode.link.report_allocation(transfer_id, [4, 5, 6], prompt, 16, lambda reason: None)
            decode.half.begin_step(KVPushMetadata(receives=[ReceiveStart("rd", transfer_id, (4, 5, 6), prompt, 16)]))
            results: list = []

            def step() -> bool:
                finished, errors = decode.half.collect()
                if finished:
                    results.append((finished, errors))
                return bool(results)

            started = time.monotonic()
            _until(step, "decode to give up")
            assert time.monotonic() - started >= 0.3
            assert results == [({"rd"}, {5, 6})]  # block 4 holds decode's own 16-token prefix hit
            assert client.get_transfer(transfer_id).state == tpb.TRANSFER_STATE_CANCELLED
            assert decode.half.failed_count == 1 and decode.half.completed_count == 0
        finally:
            client.close()
            decode.shutdown()


def test_a_write_stalled_past_expiry_lands_before_decode_reuses_the_blocks():
    """Block lifetime, bytes: a posted WRITE held past its transfer's expiry keeps decode waiting until it landed;
    the next transfer into the same decode blocks then leaves exactly its own KV there (no late byte of the first)."""
    fabric_name, _ = new_fabric()
    hold_s = 0.8

    def holding_agent(config, kv_caches, block_size, heads, head_size, agent_name):
        agent = TransferAgent(agent_name, nixl_config(fabric_name, fault_hold_posted_s=hold_s))
        agent.register(kv_caches, block_size, heads, head_size)
        return agent.start()

    with directory_on_loopback() as address:
        p_caches, d_caches = _caches(True), _caches(False)
        prefill = build_worker_half(connector_config(address, "prefill", "p"), p_caches, BS, HEADS, HEAD, 0, 1,
                                    "p-agent", create_agent=holding_agent)
        decode = build_worker_half(connector_config(address, "decode", "d"), d_caches, BS, HEADS, HEAD, 0, 1,
                                   "d-agent", create_agent=_in_memory_agent(fabric_name))
        client = SyncDirectoryClient(ChannelConfig(address=address))
        try:
            prompt, dst = 40, (11, 3, 7)

            def push(request: str, src: tuple[int, ...], ttl_s: float | None) -> tuple[str, set[int], float]:
                transfer_id = client.plan_transfer(prompt_token_count=prompt, ttl_s=ttl_s).transfer.transfer_id
                decode.link.report_allocation(transfer_id, list(dst), prompt, 0, lambda reason: None)
                receive = ReceiveStart(f"d{request}", transfer_id, dst, prompt, 0)
                decode.half.begin_step(KVPushMetadata(receives=[receive]))
                prefill.half.begin_step(KVPushMetadata(prefill_chunks=[
                    PrefillChunk(f"p{request}", transfer_id, 0, prompt, prompt, src)]))
                for name in p_caches:
                    prefill.half.save_kv_layer(name)
                prefill.half.wait_for_save()
                prefill.half.begin_step(KVPushMetadata(held_prefills=[f"p{request}"]))
                started = time.monotonic()
                outcome: dict = {}

                def step() -> bool:
                    finished, errors = decode.half.collect()
                    if f"d{request}" in finished:
                        outcome["errors"] = errors
                        outcome["at"] = time.monotonic()
                    prefill.half.get_finished_sending({f"p{request}"})
                    return "at" in outcome

                _until(step, f"decode to finish receiving {request}")
                return transfer_id, outcome["errors"], outcome["at"] - started

            first, errors, waited = push("a", (4, 9, 2), ttl_s=0.3)
            assert errors == set(dst) and client.get_transfer(first).state == tpb.TRANSFER_STATE_EXPIRED
            assert waited >= hold_s, f"decode was told after {waited:.2f}s, before the held writes landed"
            second, errors, _ = push("b", (5, 8, 13), ttl_s=None)
            assert errors == set() and client.get_transfer(second).state == tpb.TRANSFER_STATE_COMPLETE
            time.sleep(hold_s)  # anything of the first still in flight would have landed by now
            for name in p_caches:
                for s, d in zip((5, 8, 13), dst):
                    assert torch.equal(d_caches[name][d], p_caches[name][s]), (name, s, d)
        finally:
            client.close()
            prefill.shutdown()
            decode.shutdown()


def test_first_token_from_prefill_comes_with_complete_not_before():
    """A first-token transfer: every write lands and decode hears the notification, yet decode does not finish
    receiving (and the directory is not COMPLETE) until prefill's hold brings the sampled token; then DONE carries
    it, the COMPLETE event brings it to decode, and decode hands it on with the finished receive."""
    fabric_name, _ = new_fabric()
    with directory_on_loopback() as address:
        p_caches, d_caches = _caches(True), _caches(False)
        prefill = build_worker_half(connector_config(address, "prefill", "p"), p_caches, BS, HEADS, HEAD, 0, 1,
                                    "p-agent", create_agent=_in_memory_agent(fabric_name))
        decode = build_worker_half(connector_config(address, "decode", "d"), d_caches, BS, HEADS, HEAD, 0, 1,
                                   "d-agent", create_agent=_in_memory_agent(fabric_name))
        client = SyncDirectoryClient(ChannelConfig(address=address))
        try:
            prompt, src, dst = 40, (4, 9, 2), (11, 3, 7)
            transfer_id = client.plan_transfer(prompt_token_count=prompt).transfer.transfer_id
            decode.link.report_allocation(transfer_id, list(dst), prompt, 0, lambda reason: None)
            decode.half.begin_step(KVPushMetadata(receives=[
                ReceiveStart("rd", transfer_id, dst, prompt, 0, awaits_first_token=True)]))
            prefill.half.begin_step(KVPushMetadata(prefill_chunks=[
                PrefillChunk("rp", transfer_id, 0, prompt, prompt, src, sends_first_token=True)]))
            for name in p_caches:
                prefill.half.save_kv_layer(name)
            prefill.half.wait_for_save()
            finished: set[str] = set()

            def landed() -> bool:
                finished.update(decode.half.collect()[0])
                return all(torch.equal(d_caches[name][d], p_caches[name][s])
                           for name in p_caches for s, d in zip(src, dst))

            _until(landed, "every write to land")
            time.sleep(0.2)  # the notification has had time to arrive: it must not end the receive
            finished.update(decode.half.collect()[0])
            assert finished == set() and decode.half.take_first_tokens() == {}
            assert client.get_transfer(transfer_id).state == tpb.TRANSFER_STATE_STREAMING
            prefill.half.begin_step(KVPushMetadata(held_prefills=["rp"], first_tokens={"rp": 0}))
            tokens: dict[str, int] = {}
            released: set[str] = set()

            def step() -> bool:
                finished.update(decode.half.collect()[0])
                tokens.update(decode.half.take_first_tokens())
                released.update(prefill.half.get_finished_sending({"rp"}))
                return "rd" in finished and "rp" in released

            _until(step, "decode to finish receiving with the token and prefill to release")
            assert tokens == {"rd": 0}  # token 0 is a token like any other
            transfer = client.get_transfer(transfer_id)
            assert transfer.state == tpb.TRANSFER_STATE_COMPLETE and transfer.HasField("first_token_id")
            assert transfer.first_token_id == 0
        finally:
            client.close()
            prefill.shutdown()
            decode.shutdown()


def _peer_loaded(parts, agent_name: str) -> bool:
    return parts.agent.call_soon(lambda: parts.agent.peer(agent_name) is not None).result(BOUND_S)


def test_decode_workers_are_loaded_before_any_instruction_whichever_registers_first():
    """The directory announces each decode worker to the prefill sessions that may push to it: one registered
    before the prefill's session opened and one registered after are both loaded by prefill's agent before any
    transfer is planned, and a push to one of them then lands as before."""
    fabric_name, _ = new_fabric()
    with directory_on_loopback() as address:
        early = build_worker_half(connector_config(address, "decode", "d-early"), _caches(False), BS, HEADS, HEAD, 0, 1,
                                  "d-early-agent", create_agent=_in_memory_agent(fabric_name))
        p_caches = _caches(True)
        prefill = build_worker_half(connector_config(address, "prefill", "p"), p_caches, BS, HEADS, HEAD, 0, 1,
                                    "p-agent", create_agent=_in_memory_agent(fabric_name))
        d_caches = _caches(False)
        late = build_worker_half(connector_config(address, "decode", "d-late"), d_caches, BS, HEADS, HEAD, 0, 1,
                                 "d-late-agent", create_agent=_in_memory_agent(fabric_name))
        client = SyncDirectoryClient(ChannelConfig(address=address))
        try:
            _until(lambda: _peer_loaded(prefill, "d-early-agent") and _peer_loaded(prefill, "d-late-agent"),
                   "prefill to load both announced decode workers")
            prompt, src, dst = 40, (4, 9, 2), (11, 3, 7)
            transfer_id = client.plan_transfer(prompt_token_count=prompt,
                                               decode_engine_id="d-late").transfer.transfer_id
            _prefill_one_step(prefill, late, p_caches, transfer_id, prompt, src, dst, lambda error: None)
            _until(lambda: client.get_transfer(transfer_id).state == tpb.TRANSFER_STATE_COMPLETE, "the push")
            for name in p_caches:
                assert torch.equal(d_caches[name][dst[0]], p_caches[name][src[0]]), name
        finally:
            client.close()
            for parts in (prefill, early, late):
                parts.shutdown()


def test_a_dropped_decode_peer_fails_one_transfer_at_once_and_the_next_gets_its_metadata_again():
    """Prefill's data plane drops decode's agent (what it does when a write to it is aborted) while the directory's
    stream still counts the metadata delivered. The next instruction comes without it: prefill fails that transfer
    at once with its reason, reporting the agent dropped, so decode finishes the request with load errors and prefill
    releases the blocks; the directory sends the metadata with the instruction after, and that push lands."""
    fabric_name, _ = new_fabric()
    with directory_on_loopback() as address:
        p_caches, d_caches = _caches(True), _caches(False)
        prefill = build_worker_half(connector_config(address, "prefill", "p", preload_peers=False), p_caches, BS, HEADS,
                                    HEAD, 0, 1, "p-agent", create_agent=_in_memory_agent(fabric_name))
        decode = build_worker_half(connector_config(address, "decode", "d"), d_caches, BS, HEADS, HEAD, 0, 1,
                                   "d-agent", create_agent=_in_memory_agent(fabric_name))
        client = SyncDirectoryClient(ChannelConfig(address=address))
        try:
            prompt, dst = 40, (11, 3, 7)

            def push(request: str, src: tuple[int, ...]) -> tuple[str, set[int]]:
                transfer_id = client.plan_transfer(prompt_token_count=prompt).transfer.transfer_id
                _prefill_one_step(prefill, decode, p_caches, transfer_id, prompt, src, dst, lambda reason: None)
                prefill.half.begin_step(KVPushMetadata(held_prefills=["rp"]))
                outcome: dict = {}

                def step() -> bool:
                    finished, errors = decode.half.collect()
                    if "rd" in finished:
                        outcome["errors"] = errors
                    if prefill.half.get_finished_sending({"rp"}):
                        outcome["released"] = True
                    return len(outcome) == 2

                _until(step, f"push {request} to end on both sides")
                return transfer_id, outcome["errors"]

            first, errors = push("first", (4, 9, 2))
            assert errors == set() and client.get_transfer(first).state == tpb.TRANSFER_STATE_COMPLETE
            prefill.agent.remove_peer("d-agent", "a write to it was aborted").result(BOUND_S)
            assert not _peer_loaded(prefill, "d-agent")

            refused, errors = push("refused", (5, 8, 13))
            transfer = client.get_transfer(refused)
            assert errors == set(dst) and transfer.state == tpb.TRANSFER_STATE_FAILED
            assert "'d-agent' is unknown here and the instruction carries no metadata" in transfer.failure_reason
            assert "push_timeout_s" not in transfer.failure_reason

            third, errors = push("after", (6, 10, 14))
            assert errors == set() and client.get_transfer(third).state == tpb.TRANSFER_STATE_COMPLETE
            for name in p_caches:
                for s, d in zip((6, 10, 14), dst):
                    assert torch.equal(d_caches[name][d], p_caches[name][s]), (name, s, d)
        finally:
            client.close()
            prefill.shutdown()
            decode.shutdown()
