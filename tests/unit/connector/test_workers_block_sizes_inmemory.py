"""Prefill and decode workers of different block sizes (16 -> 128, 128 -> 16, 32 -> 48, 48 -> 32) on the in-memory
NIXL, against a real directory run with --pair-block-sizes: decode's cache equals prefill's token by token, every
block released (tests/fixtures/block_size_push.py says which prompts: mid-block ends, chunked prefill, prefix hits on
either side). Without the switch the directory refuses to pair them."""

from __future__ import annotations

import grpc
import pytest

from kvpush.dataplane.agent import TransferAgent
from tests.fixtures.block_size_push import (
    plan_refusal_without_the_switch,
    run_block_size_cases,
    run_concurrent_block_size_pushes,
    run_reuse_before_prefill_result,
)
from tests.unit.connector.inmemory_helpers import new_fabric, nixl_config


# 32 and 48: neither a multiple of the other (16-token chunks on both sides).
@pytest.mark.parametrize(("prefill_size", "decode_size"), [(16, 128), (128, 16), (32, 48), (48, 32)])
def test_decode_holds_prefill_kv_token_by_token_across_block_sizes(prefill_size: int, decode_size: int):
    fabric_name, _ = new_fabric()
    run_block_size_cases(prefill_size, decode_size, lambda name: TransferAgent(name, nixl_config(fabric_name)))


@pytest.mark.parametrize(("prefill_size", "decode_size"), [(16, 128), (128, 16), (32, 48)])
def test_many_transfers_in_flight_across_block_sizes(prefill_size: int, decode_size: int):
    """Requests interleaved as a busy engine pair runs them (tests/fixtures/block_size_push.py,
    run_concurrent_block_size_pushes): every receive complete with prefill's KV, no load error, blocks reused."""
    fabric_name, _ = new_fabric()
    run_concurrent_block_size_pushes(prefill_size, decode_size,
                                     lambda name: TransferAgent(name, nixl_config(fabric_name)))


def test_without_the_switch_the_directory_refuses_to_pair_them():
    """The same registered workers, a directory with default limits: FAILED_PRECONDITION naming the field, both
    values, both engines and the switch."""
    fabric_name, _ = new_fabric()
    refused = plan_refusal_without_the_switch(16, 128, lambda name: TransferAgent(name, nixl_config(fabric_name)))
    assert refused.code == grpc.StatusCode.FAILED_PRECONDITION
    assert refused.details == ("no compatible prefill/decode pair: block_size_tokens 16 of prefill 'p' differs from "
                               "128 of decode 'd' (engines of different block sizes pair only when the directory "
                               "runs with --pair-block-sizes)")


@pytest.mark.parametrize(("prefill_size", "decode_size"), [(16, 128), (128, 128)])
def test_decode_blocks_reused_before_the_directory_has_prefill_result(prefill_size: int, decode_size: int):
    """A receive completed on the notification, its blocks reused at once: the next allocation waits for the
    directory to learn the first transfer ended instead of being refused (tests/fixtures/block_size_push.py,
    run_reuse_before_prefill_result)."""
    fabric_name, _ = new_fabric()
    run_reuse_before_prefill_result(prefill_size, decode_size,
                                    lambda name: TransferAgent(name, nixl_config(fabric_name)))
