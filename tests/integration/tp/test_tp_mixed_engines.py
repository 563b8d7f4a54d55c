"""Prefill and decode engines of different TP sizes on real vLLM CPU engines: pushes by KV-head slice.

The tiny model has 2 KV heads: a TP 1 engine holds both, each rank of a TP 2 engine one. Prefill TP 1 -> decode
TP 2: the one prefill worker writes head 0 of every block to decode rank 0 and head 1 to decode rank 1 (one
instruction naming both destinations). Prefill TP 2 -> decode TP 1: each prefill rank writes its head into its
position of the decode worker's blocks, and the decode worker completes on both numbered notifications.

Checked against a colocated engine of the decode engine's TP size (decode computes every output token): greedy
and seeded-sampling tokens identical for prompt shapes around the block and chunk boundaries (a 600-token prompt
takes three chunked-prefill steps; seeded sampling only on one-step prompts, see SAMPLED_LENGTHS), every transfer
COMPLETE with a timing from every prefill rank, the exact byte count per rank (vLLM CPU's block-atomic layout moves
whole 128-token blocks of one head's K and V, float32), and no block held afterwards. The last test of each
direction SIGKILLs rank 1 of the TP 2 engine mid-push and checks the request and the transfer end cleanly.
TP 2 engines need `VLLM_CPU_OMP_THREADS_BIND="0|1"` (tests/integration/tp/
test_tp2_engines.py says why).

Both directions run a second model too: gpt-oss's attention (`tiny-gpt-oss`: 2 KV heads, a 128-token window on every
other layer), whose engines keep vLLM's hybrid KV-cache manager on: two KV-cache groups on every rank, so head slices
meet per-group blocks, and a sliding layer's head writes only its window's blocks; the kill test too.
"""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import psutil
import pytest

from kvpush.client.config import ChannelConfig
from kvpush.client.sync import SyncDirectoryClient
from kvpush.localstack.client import call, stream_completion
from kvpush.localstack.model import TinyModelSpec, ensure_tiny_model
from kvpush.localstack.processes import EngineSpec, free_port, launch_engine, start_directory, start_gateway
from kvpush.localstack.shaped_model import ensure_shaped_model, preset_config, pushed_kv_bytes
from kvpush.localstack.stack import DIRECTORY_ARGS, kv_transfer_config
from kvpush.localstack.vllm_bench import wait_kv_usage_zero
from kvpush.v1 import types_pb2 as tpb

pytestmark = [pytest.mark.engines, pytest.mark.nixl]

BLOCK_SIZE = 128
MAX_BATCHED_TOKENS = 256  # a 600-token prompt takes three prefill steps
MODEL_SPEC = TinyModelSpec(num_layers=4)  # 2 KV heads
READY_TIMEOUT_S = 600.0
TRANSFER_WAIT_S = 150.0
PROMPT_LENGTHS = (40, 2 * BLOCK_SIZE, 2 * BLOCK_SIZE + 1, 600)
# Seeded sampling only for prompts of one prefill step: vLLM CPU 0.32 fails a seeded request's partial prefill
# step ("CPU Generator does not use offset" in _bookkeeping_sync), colocated engines included.
SAMPLED_LENGTHS = (40, 2 * BLOCK_SIZE - 56)
OUTPUT_TOKENS = 12
MAX_WRITE_S = 60.0
LEASE_TTL_S = 30.0  # DIRECTORY_ARGS
# The fault case: prefill holds every posted write of a transfer that reaches past HOLD_FROM_TOKEN, after its first
# write, for HOLD_S. The other prompts have at most 600 tokens, so only HELD_PROMPT_LEN's last chunks are held. (A count
# of writes cannot pick the transfer: layers computed before the push instruction arrives merge into fewer writes, and
# a 6-chunk prompt made from 8 to 19 where 24 were expected.)
HOLD_S = 20.0
HOLD_FROM_TOKEN = 1024
HELD_PROMPT_LEN = 1400
FAULT_BOUND_S = LEASE_TTL_S + MAX_WRITE_S + HOLD_S + 30.0
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "UCX_NET_DEVICES": "lo"}
TERMINAL = {tpb.TRANSFER_STATE_COMPLETE, tpb.TRANSFER_STATE_FAILED, tpb.TRANSFER_STATE_CANCELLED,
            tpb.TRANSFER_STATE_EXPIRED}


def _engine_args(tp: int) -> list[str]:
    args = ["--block-size", str(BLOCK_SIZE), "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS), "--max-num-seqs", "8"]
    if tp > 1:
        args = ["--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp", *args]
    return args


def _env(tp: int) -> dict[str, str]:
    return dict(TP_ENV) if tp > 1 else {"UCX_NET_DEVICES": "lo"}


def _kvpush_spec(role: str, tp: int, model_dir: Path, directory: str) -> EngineSpec:
    port = free_port()
    name = f"mixed-{role}-tp{tp}"
    config = kv_transfer_config("kvpush", role, engine_id=name, directory_address=directory,
                                engine_endpoint=f"http://127.0.0.1:{port}",
                                extra={"max_write_s": MAX_WRITE_S, "transfer_timeout_s": 2 * MAX_WRITE_S,
                                       "push_timeout_s": 2 * MAX_WRITE_S,
                                       **({"fault_hold_posted_write_s": HOLD_S, "fault_hold_after_writes": 1,
                                           "fault_hold_from_token": HOLD_FROM_TOKEN} if role == "prefill"
                                          else {})})
    return EngineSpec(name=name, model_dir=model_dir, port=port, kv_transfer_config=config, env=_env(tp),
                      extra_args=_engine_args(tp), log_stats=True)


SLIDING_PRESET = "tiny-gpt-oss"  # 2 KV heads of 32, as MODEL_SPEC


@pytest.fixture(scope="module", params=[(1, 2, ""), (2, 1, ""), (1, 2, SLIDING_PRESET), (2, 1, SLIDING_PRESET)],
                ids=["prefill1-decode2", "prefill2-decode1", f"prefill1-decode2-{SLIDING_PRESET}",
                     f"prefill2-decode1-{SLIDING_PRESET}"])
def mixed_stack(request, session_log_dir):
    prefill_tp, decode_tp, preset = request.param
    log_dir = session_log_dir / f"tp-mixed-{prefill_tp}-{decode_tp}{'-' + preset if preset else ''}"
    log_dir.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_shaped_model(preset) if preset else ensure_tiny_model(MODEL_SPEC)
    directory = start_directory(log_dir, extra_args=[*DIRECTORY_ARGS, "--max-write-s", str(MAX_WRITE_S)])
    engines = []
    gateway = None
    client = SyncDirectoryClient(ChannelConfig(address=directory.address, timeout_s=10.0))
    try:
        engines = [launch_engine(_kvpush_spec("prefill", prefill_tp, model_dir, directory.address), log_dir),
                   launch_engine(_kvpush_spec("decode", decode_tp, model_dir, directory.address), log_dir),
                   launch_engine(EngineSpec(name=f"mixed-colocated-tp{decode_tp}", model_dir=model_dir,
                                            env=_env(decode_tp), extra_args=_engine_args(decode_tp)), log_dir)]
        for engine in engines:
            engine.wait_ready(READY_TIMEOUT_S)
        _wait_all_ranks_registered(client, prefill_tp + decode_tp)
        gateway = start_gateway(log_dir, directory_address=directory.address,
                                extra_args=["--no-first-token-from-prefill"])
        _first_contact(gateway.url, client, prefill_tp + decode_tp)
        yield {"prefill": engines[0], "decode": engines[1], "colocated": engines[2], "gateway": gateway,
               "client": client, "prefill_tp": prefill_tp, "decode_tp": decode_tp, "preset": preset}
    finally:
        client.close()
        if gateway is not None:
            gateway.process.stop(grace_s=5.0)
        for engine in engines:
            engine.process.terminate()
        for engine in engines:
            engine.stop(grace_s=20.0)
        directory.process.stop(grace_s=5.0)
        print(f"tp-mixed logs: {log_dir}")


def _wait_all_ranks_registered(client: SyncDirectoryClient, ranks: int, timeout_s: float = 60.0) -> None:
    """Bounded: an engine answers /health before each rank's connector has registered it."""
    deadline = time.monotonic() + timeout_s
    while len(client.list_engines()) < ranks:
        assert time.monotonic() < deadline, f"ranks registered: {client.list_engines()}"
        time.sleep(0.2)


def _first_contact(gateway_url: str, client: SyncDirectoryClient, ranks: int, attempts: int = 2) -> None:
    """One disaggregated request before the checks, tried again once (a first NIXL contact can outlast a lease on
    this loaded machine: test_tp2_engines.py's _first_contact)."""
    prompt = _prompt(2 * BLOCK_SIZE, seed=99)
    for attempt in range(1, attempts + 1):
        result = call("POST", gateway_url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 2,
                                                                "temperature": 0.0}, timeout_s=180.0)
        if result.status == 200:
            return
        print(f"tp-mixed first contact, attempt {attempt}: HTTP {result.status}: {result.text[:300]}")
        _wait_all_ranks_registered(client, ranks, timeout_s=120.0)
    pytest.fail(f"no disaggregated request passed in {attempts} attempts: {result.text[:400]}")


def _prompt(length: int, seed: int) -> list[int]:
    return [5 + (seed * 31 + i * 17 + (i * i) % 7) % (MODEL_SPEC.vocab_size - 20) for i in range(length)]


def _complete(url: str, prompt: list[int], sampling: dict) -> tuple[list[int], str]:
    """A streamed completion's token ids, in order, and the transfer the gateway names."""
    result = stream_completion(url + "/v1/completions", {"model": "tiny", "prompt": prompt,
                                                         "max_tokens": OUTPUT_TOKENS, "ignore_eos": True,
                                                         "return_token_ids": True, **sampling}, timeout_s=120.0)
    assert result.status == 200 and not result.error, (result.status, result.error[:400])
    tokens = [token for event in result.events for choice in event.get("choices", [])
              for token in choice.get("token_ids") or []]
    return tokens, result.headers.get("x-kvpush-transfer-id", "")


def _terminal(client: SyncDirectoryClient, transfer_id: str) -> tpb.Transfer:
    deadline = time.monotonic() + TRANSFER_WAIT_S
    while True:
        record = client.get_transfer(transfer_id)
        if record.state in TERMINAL or time.monotonic() > deadline:
            return record
        time.sleep(0.05)


def _check_transfer(stack, transfer_id: str, length: int) -> None:
    record = _terminal(stack["client"], transfer_id)
    assert record.state == tpb.TRANSFER_STATE_COMPLETE, (length, record.state, record.failure_reason)
    prefill_tp = stack["prefill_tp"]
    assert sorted(rank.tp_rank for rank in record.rank_timings) == list(range(prefill_tp)), record.rank_timings
    # Every KV head of every written block once (`pushed_kv_bytes`: whole 128-token blocks, a sliding layer's from its
    # window); the model's 2 KV heads split evenly over the prefill ranks.
    config = preset_config(stack["preset"]) if stack["preset"] else MODEL_SPEC.kv_config()
    expected = pushed_kv_bytes(config, length, BLOCK_SIZE, block_atomic=True)
    assert record.bytes_written == expected, (length, record.bytes_written)
    for rank in record.rank_timings:  # each prefill rank writes the heads it holds
        assert rank.timing.bytes_written == expected // prefill_tp, (length, rank)


def test_ranks_register_with_their_head_counts(mixed_stack):
    workers = mixed_stack["client"].list_engines()
    for worker in workers:
        assert worker.layout.model_kv_head_count == MODEL_SPEC.num_kv_heads
        assert worker.layout.kv_head_count == MODEL_SPEC.num_kv_heads // worker.tp_size
    assert len({w.layout.compatibility_hash for w in workers}) == 1


def test_greedy_streams_are_token_identical_to_a_colocated_engine(mixed_stack):
    for seed, length in enumerate(PROMPT_LENGTHS):
        prompt = _prompt(length, seed)
        reference, _ = _complete(mixed_stack["colocated"].url, prompt, {"temperature": 0.0})
        tokens, transfer_id = _complete(mixed_stack["gateway"].url, prompt, {"temperature": 0.0})
        assert transfer_id, "the gateway names the transfer"
        _check_transfer(mixed_stack, transfer_id, length)
        assert len(tokens) == OUTPUT_TOKENS
        assert tokens == reference, f"{length}-token prompt: disaggregated {tokens} != colocated {reference}"


def test_seeded_sampling_streams_are_token_identical_to_a_colocated_engine(mixed_stack):
    for seed, length in enumerate(SAMPLED_LENGTHS, start=7):
        prompt = _prompt(length, seed)
        sampling = {"temperature": 1.0, "top_p": 0.9, "seed": 1234 + seed}
        reference, _ = _complete(mixed_stack["colocated"].url, prompt, sampling)
        tokens, transfer_id = _complete(mixed_stack["gateway"].url, prompt, sampling)
        _check_transfer(mixed_stack, transfer_id, length)
        assert tokens == reference, f"{length}-token prompt, seeded: disaggregated {tokens} != colocated {reference}"


def test_no_block_is_held_afterwards(mixed_stack):
    for name in ("prefill", "decode"):
        assert wait_kv_usage_zero(mixed_stack[name].url, 60.0) == 0.0, name
    live = [t for t in mixed_stack["client"].list_transfers(limit=1000) if t.state not in TERMINAL]
    assert live == []


def _rank_worker(engine, rank: int) -> psutil.Process:
    """The vLLM worker process of TP rank `rank` of an engine (vLLM titles it VLLM::Worker_TP<rank>)."""
    for child in psutil.Process(engine.process.pid).children(recursive=True):
        try:
            if any(f"Worker_TP{rank}" in part for part in child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no Worker_TP{rank} process under engine {engine.spec.name}")


def test_zz_a_rank_of_the_tp2_side_killed_mid_push_ends_cleanly(mixed_stack):
    """Last of each stack (it takes the TP 2 engine down): rank 1 of the TP 2 side is SIGKILLed mid-transfer.

    Decode TP 2: killed while the push streams and is held mid-way (prefill holds every posted write of a transfer
    reaching past HOLD_FROM_TOKEN for HOLD_S, and this prompt is longer). Prefill TP 2: the rank is
    stopped (SIGSTOP) before the request, so it can neither compute nor write its head, then killed once decode
    allocated: decode, written by both prefill ranks, must not complete on rank 0's part alone. The
    request ends within the fence (lease TTL + max_write_s), the transfer ends FAILED or CANCELLED, never COMPLETE,
    and the surviving engine holds no block and still serves."""
    client, gateway = mixed_stack["client"], mixed_stack["gateway"]
    victim_role = "decode" if mixed_stack["decode_tp"] == 2 else "prefill"
    survivor = mixed_stack["prefill" if victim_role == "decode" else "decode"]
    victim = _rank_worker(mixed_stack[victim_role], 1)
    known = {t.transfer_id for t in client.list_transfers(limit=1000)}
    prompt = _prompt(HELD_PROMPT_LEN, seed=31)
    if victim_role == "prefill":
        victim.suspend()
    # Prefill TP 2 with rank 1 stopped cannot finish a forward: decode allocates (it waits for both ranks' parts)
    # and the push streams at most rank 0's first layers.
    wanted = {tpb.TRANSFER_STATE_STREAMING} if victim_role == "decode" else {
        tpb.TRANSFER_STATE_ALLOCATED, tpb.TRANSFER_STATE_STREAMING}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(call, "POST", gateway.url + "/v1/completions",
                             {"model": "tiny", "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0.0,
                              "ignore_eos": True, "return_token_ids": True}, None, FAULT_BOUND_S)
        deadline = time.monotonic() + 120.0
        transfer = None
        while transfer is None or transfer.state not in wanted:
            assert time.monotonic() < deadline, "the transfer never got under way"
            fresh = [t for t in client.list_transfers(limit=1000) if t.transfer_id not in known]
            transfer = fresh[0] if fresh else None
            assert transfer is None or transfer.state not in TERMINAL, (transfer.state, transfer.failure_reason)
            time.sleep(0.1)
        if victim_role == "decode":
            time.sleep(3.0)  # a few chunks pushed; the writes past HOLD_FROM_TOKEN are held for HOLD_S
        at_kill = client.get_transfer(transfer.transfer_id).state
        assert at_kill not in TERMINAL, at_kill
        victim.kill()
        killed_at = time.monotonic()
        result = answer.result(timeout=FAULT_BOUND_S + 30.0)
    ended = _terminal(client, transfer.transfer_id)
    elapsed = time.monotonic() - killed_at
    print(f"\nFAULT {victim_role} TP 2 rank 1 SIGKILL at {tpb.TransferState.Name(at_kill)}: HTTP {result.status}, "
          f"transfer {tpb.TransferState.Name(ended.state)} after {elapsed:.1f} s ({ended.failure_reason[:80]})")
    assert ended.state in (tpb.TRANSFER_STATE_FAILED, tpb.TRANSFER_STATE_CANCELLED), ended.state
    assert elapsed < FAULT_BOUND_S
    if result.status == 200:  # decode recomputed what the push did not bring (kv_load_failure_policy)
        assert victim_role == "prefill", "the killed decode engine answered"
        reference = call("POST", mixed_stack["colocated"].url + "/v1/completions",
                         {"model": "tiny", "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0.0,
                          "ignore_eos": True, "return_token_ids": True}, timeout_s=120.0)
        assert result.body["choices"][0]["token_ids"] == reference.body["choices"][0]["token_ids"]
    else:
        assert result.status >= 400, result.status
    assert wait_kv_usage_zero(survivor.url, FAULT_BOUND_S) == 0.0, survivor.spec.name
    live = [t for t in client.list_transfers(limit=1000) if t.state not in TERMINAL]
    assert live == []
    still = call("POST", survivor.url + "/v1/completions", {"model": "tiny", "prompt": _prompt(40, 3),
                                                            "max_tokens": 2, "temperature": 0.0}, timeout_s=120.0)
    assert still.status == 200, still.text[:300]
