"""The fault matrix on real vLLM CPU engines: each fault ends its requests in bound, nothing leaks, no late write lands.

For every case: the affected request ends within its bound with an OpenAI-style error (decode's
kv_load_failure_policy is "fail"), requests the fault does not touch decode exactly what the colocated
engine decodes, and the last test checks 0 KV blocks held on every surviving engine (vLLM's own KV-usage
gauge) and 0 live transfers at the directory. A late write into reused blocks would change the tokens of
the request that reused them: the tests that stall a posted WRITE past a failure run such a request right
after the failure and compare its tokens. Each case prints its measured end time (the fault matrix in the
report comes from these lines).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from kvpush.localstack.processes import start_directory
from kvpush.v1 import types_pb2 as tpb
from tests.faults.conftest import (
    DECODE_BLOCKS,
    DECODE_ID,
    FENCE_BOUND_S,
    HOLD_S,
    HOLDER_ID,
    MAX_WRITE_S,
    PREFILL_ID,
    REAP_S,
    TERMINAL,
    VICTIM_ID,
    directory_args,
    is_openai_error,
)
from tests.integration.connector.conftest import BLOCK_SIZE, abort_after, prompt_of

pytestmark = [pytest.mark.engines, pytest.mark.nixl, pytest.mark.faults]

MAX_TOKENS = 12
# A request that fills every decode block: whatever blocks a failed request held, this one is given them.
FILL_PROMPT_LEN = DECODE_BLOCKS * BLOCK_SIZE - 140
FILL_MAX_TOKENS = 120
# Engine-side time on top of a directory bound: a step, the HTTP answer, a loaded 2-core machine.
SLACK_S = 10.0


def _report(case: str, seconds: float, bound: float) -> None:
    print(f"\nFAULT-MATRIX {case}: ended after {seconds:.2f} s (bound {bound:.1f} s)")


def _reuse_and_check(fault_stack, seed: int) -> None:
    """A local request on decode that needs every block (so it reuses the failed request's) is token-identical."""
    prompt = prompt_of(FILL_PROMPT_LEN, seed=seed)
    tokens = fault_stack.tokens(fault_stack.request(fault_stack.decode, prompt, FILL_MAX_TOKENS))
    assert tokens == fault_stack.reference(prompt, FILL_MAX_TOKENS), "a late write landed in reused blocks"
    # The directory plans by the free blocks decode reported at its last step, and the fill request's last step
    # still held them all: one small step more reports them free again (else the next plans are refused).
    fault_stack.tokens(fault_stack.request(fault_stack.decode, prompt_of(8, seed=seed), 1))


def test_stalled_write_past_expiry_never_lands_in_reused_blocks(fault_stack):
    """EXPIRED while a posted WRITE is stalled: decode is told only after it landed; the next request reusing the
    blocks is exact."""
    prompt = prompt_of(5 * BLOCK_SIZE + 40, seed=901)
    fault_stack.reference(prompt_of(FILL_PROMPT_LEN, seed=902), FILL_MAX_TOKENS)  # warm the reference first
    p_leg, d_leg, transfer_id, started = fault_stack.legs(prompt, MAX_TOKENS, fault_stack.holder, HOLDER_ID, ttl_s=3.0)
    streaming = fault_stack.wait_transfer(transfer_id, {tpb.TRANSFER_STATE_STREAMING} | TERMINAL, timeout_s=30)
    assert streaming.state == tpb.TRANSFER_STATE_STREAMING, "never dispatched within its TTL"
    decode = d_leg.result(timeout=120)
    elapsed = time.monotonic() - started
    assert is_openai_error(decode), (decode.status, decode.text[:300])
    ended = fault_stack.wait_transfer(transfer_id, TERMINAL)
    assert ended.state == tpb.TRANSFER_STATE_EXPIRED, ended.failure_reason
    # The held WRITE (HOLD_S) landed before decode was told: its end is past the hold, not at the 3 s deadline.
    assert elapsed >= HOLD_S, f"decode was told after {elapsed:.2f}s, before the stalled write could land"
    _report("expired with a stalled write (fence)", elapsed, 3.0 + HOLD_S + SLACK_S)
    assert elapsed < 3.0 + MAX_WRITE_S + SLACK_S
    assert p_leg.result(timeout=60).status == 200
    _reuse_and_check(fault_stack, seed=902)


def test_decode_abort_after_dispatch_before_the_writes(fault_stack):
    """Decode aborted while its writes are stalled: CANCELLED only once they ended, blocks then reused cleanly."""
    prompt = prompt_of(4 * BLOCK_SIZE + 9, seed=911)
    transfer_id = fault_stack.plan(len(prompt), HOLDER_ID)
    started = time.monotonic()
    aborter = threading.Thread(target=abort_after, args=(fault_stack.decode, {
        "model": "tiny", "prompt": prompt, "max_tokens": 4,
        "kv_transfer_params": {"transfer_id": transfer_id, "do_remote_prefill": True}}, 1.5))
    aborter.start()
    prefill = fault_stack.request(fault_stack.holder, prompt, 1, {"transfer_id": transfer_id, "do_remote_decode": True})
    assert prefill.status == 200
    aborter.join()
    ended = fault_stack.wait_transfer(transfer_id, TERMINAL, timeout_s=60)
    elapsed = time.monotonic() - started
    assert ended.state == tpb.TRANSFER_STATE_CANCELLED, ended.failure_reason
    _report("decode abort after dispatch", elapsed, HOLD_S + MAX_WRITE_S + SLACK_S)
    assert elapsed < HOLD_S + MAX_WRITE_S + SLACK_S
    _reuse_and_check(fault_stack, seed=912)


def test_allocation_expires_while_the_request_is_queued(fault_stack):
    """Only the decode leg comes: its allocation's transfer expires at its TTL and the request errors within it."""
    prompt = prompt_of(2 * BLOCK_SIZE + 3, seed=921)
    transfer_id = fault_stack.plan(len(prompt), PREFILL_ID, ttl_s=2.0)
    started = time.monotonic()
    decode = fault_stack.request(fault_stack.decode, prompt, MAX_TOKENS,
                                 {"transfer_id": transfer_id, "do_remote_prefill": True})
    elapsed = time.monotonic() - started
    assert is_openai_error(decode), (decode.status, decode.text[:300])
    assert fault_stack.wait_transfer(transfer_id, TERMINAL).state == tpb.TRANSFER_STATE_EXPIRED
    _report("allocation expired while queued", elapsed, 2.0 + REAP_S + SLACK_S)
    assert elapsed < 2.0 + REAP_S + SLACK_S


def test_duplicate_transfer_ids(fault_stack):
    """Two decode legs name one transfer: one decodes exactly, the other errors; nothing else is disturbed."""
    prompt = prompt_of(3 * BLOCK_SIZE + 5, seed=931)
    transfer_id = fault_stack.plan(len(prompt), PREFILL_ID)
    started = time.monotonic()
    _, first, _, _ = fault_stack.legs(prompt, MAX_TOKENS, fault_stack.prefill, PREFILL_ID, transfer_id=transfer_id)
    second = fault_stack.request(fault_stack.decode, prompt, MAX_TOKENS,
                                 {"transfer_id": transfer_id, "do_remote_prefill": True})
    first = first.result(timeout=120)
    elapsed = time.monotonic() - started
    results = sorted([first, second], key=lambda r: r.status)
    assert results[0].status == 200 and is_openai_error(results[1]), [(r.status, r.text[:200]) for r in results]
    assert fault_stack.tokens(results[0]) == fault_stack.reference(prompt, MAX_TOKENS)
    _report("duplicate transfer id", elapsed, SLACK_S)


def test_decode_engine_sigkilled_mid_transfer_and_the_write_fails(fault_stack):
    """The decode engine dies while prefill's WRITE is stalled: the WRITE fails (remote agent gone), prefill frees its
    blocks."""
    prompt = prompt_of(4 * BLOCK_SIZE + 11, seed=941)
    p_leg, d_leg, transfer_id, _started = fault_stack.legs(prompt, MAX_TOKENS, fault_stack.holder, HOLDER_ID,
                                                          decode=fault_stack.decode_victim, decode_id=VICTIM_ID)
    streaming = fault_stack.wait_transfer(transfer_id, {tpb.TRANSFER_STATE_STREAMING} | TERMINAL, timeout_s=30)
    assert streaming.state == tpb.TRANSFER_STATE_STREAMING
    os.killpg(fault_stack.decode_victim.process.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    try:
        status = d_leg.result(timeout=60).status
    except Exception:  # the connection died with the engine
        status = None
    assert status != 200
    ended = fault_stack.wait_transfer(transfer_id, TERMINAL, timeout_s=60)
    elapsed = time.monotonic() - killed_at
    assert ended.state == tpb.TRANSFER_STATE_FAILED, ended.failure_reason
    _report(f"decode SIGKILL ({ended.failure_reason[:60]})", elapsed, FENCE_BOUND_S + SLACK_S)
    assert elapsed < FENCE_BOUND_S + SLACK_S
    assert p_leg.result(timeout=60).status == 200
    assert fault_stack.wait_kv_usage_zero(fault_stack.holder, timeout_s=PUSH_BOUND_S) == 0.0


PUSH_BOUND_S = HOLD_S + MAX_WRITE_S + SLACK_S


def test_directory_sigkilled_mid_transfer_and_restarted(fault_stack):
    """SIGKILL of the directory mid-push, restart on its port: the request ends within TTL + max_write_s, then P/D
    works again."""
    prompt = prompt_of(5 * BLOCK_SIZE + 2, seed=951)
    p_leg, d_leg, transfer_id, _started = fault_stack.legs(prompt, MAX_TOKENS, fault_stack.holder, HOLDER_ID)
    streaming = fault_stack.wait_transfer(transfer_id, {tpb.TRANSFER_STATE_STREAMING} | TERMINAL, timeout_s=30)
    assert streaming.state == tpb.TRANSFER_STATE_STREAMING
    old = fault_stack.directory
    os.killpg(old.process.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    old.process.stop(grace_s=1.0)
    fault_stack.directory = start_directory(fault_stack.log_dir / "restarted", port=old.port,
                                            extra_args=directory_args())
    decode = d_leg.result(timeout=120)
    elapsed = time.monotonic() - killed_at
    # The old directory's transfer is gone: decode fails it once prefill's old lease surely ended.
    assert is_openai_error(decode) or decode.status == 200, (decode.status, decode.text[:300])
    if decode.status == 200:  # the notification beat the kill: every write had landed
        assert fault_stack.tokens(decode) == fault_stack.reference(prompt, MAX_TOKENS)
    _report("directory SIGKILL + restart", elapsed, FENCE_BOUND_S + SLACK_S)
    assert elapsed < FENCE_BOUND_S + 2 * SLACK_S
    assert p_leg.result(timeout=60).status == 200
    fault_stack.wait_registered([PREFILL_ID, HOLDER_ID, DECODE_ID])
    other = prompt_of(2 * BLOCK_SIZE + 70, seed=952)
    _, d_leg, _, _ = fault_stack.legs(other, MAX_TOKENS, fault_stack.prefill, PREFILL_ID)
    assert fault_stack.tokens(d_leg.result(timeout=120)) == fault_stack.reference(other, MAX_TOKENS)
    _reuse_and_check(fault_stack, seed=953)


def test_prefill_killed_mid_push(fault_stack):
    """The prefill engine dies with a WRITE stalled: decode learns at its lease expiry + max_write_s, not before."""
    prompt = prompt_of(5 * BLOCK_SIZE + 33, seed=961)
    p_leg, d_leg, transfer_id, _started = fault_stack.legs(prompt, MAX_TOKENS, fault_stack.holder, HOLDER_ID)
    streaming = fault_stack.wait_transfer(transfer_id, {tpb.TRANSFER_STATE_STREAMING} | TERMINAL, timeout_s=30)
    assert streaming.state == tpb.TRANSFER_STATE_STREAMING
    p_leg.result(timeout=60)
    os.killpg(fault_stack.holder.process.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    decode = d_leg.result(timeout=120)
    elapsed = time.monotonic() - killed_at
    assert is_openai_error(decode), (decode.status, decode.text[:300])
    ended = fault_stack.wait_transfer(transfer_id, TERMINAL)
    assert ended.state == tpb.TRANSFER_STATE_FAILED, ended.failure_reason
    _report("prefill SIGKILL mid-push", elapsed, FENCE_BOUND_S + SLACK_S)
    assert elapsed < FENCE_BOUND_S + SLACK_S
    _reuse_and_check(fault_stack, seed=962)


def test_zz_no_blocks_leak_and_no_transfer_is_live(fault_stack):
    """After every fault: the surviving engines hold no KV block (vLLM's gauge) and the directory no live transfer."""
    for engine in (fault_stack.prefill, fault_stack.decode):
        assert fault_stack.wait_kv_usage_zero(engine) == 0.0, engine.spec.name
    deadline = time.monotonic() + FENCE_BOUND_S + SLACK_S
    while fault_stack.live_transfers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert fault_stack.live_transfers() == []
