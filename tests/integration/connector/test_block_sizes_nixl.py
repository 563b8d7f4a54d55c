"""Prefill and decode workers of different block sizes (16 -> 128 and 128 -> 16) pushing over real NIXL (UCX on
loopback, two agents in this process), against a real directory run with --pair-block-sizes: the writes go through
both sides' prepared chunk tables at the common granule, and decode's cache equals prefill's token by token with
every block released (tests/fixtures/block_size_push.py says which prompts: mid-block ends, chunked prefill, prefix
hits on either side)."""

from __future__ import annotations

import os

import pytest

from kvpush.dataplane.agent import TransferAgent
from kvpush.dataplane.config import NixlConfig
from tests.fixtures.block_size_push import run_block_size_cases, run_concurrent_block_size_pushes

pytestmark = pytest.mark.nixl


@pytest.fixture(autouse=True)
def _loopback_ucx(monkeypatch: pytest.MonkeyPatch) -> None:
    # Both agents share this host: keep UCX on loopback (an agent's address lists every interface otherwise).
    monkeypatch.setenv("UCX_NET_DEVICES", os.environ.get("UCX_NET_DEVICES", "lo"))


@pytest.mark.parametrize(("prefill_size", "decode_size"), [(16, 128), (128, 16)])
def test_decode_holds_prefill_kv_token_by_token_across_block_sizes_over_nixl(prefill_size: int, decode_size: int):
    agents: list[TransferAgent] = []

    def new_agent(name: str) -> TransferAgent:
        agent = TransferAgent(name, NixlConfig(transfer_timeout_s=10.0, post_timeout_s=10.0))
        agents.append(agent)
        return agent

    run_block_size_cases(prefill_size, decode_size, new_agent)
    assert len(agents) == 2  # both workers ran on real NIXL agents


@pytest.mark.parametrize(("prefill_size", "decode_size"), [(16, 128), (128, 16)])
def test_many_transfers_in_flight_across_block_sizes_over_nixl(prefill_size: int, decode_size: int):
    """Requests interleaved as a busy engine pair runs them, on real NIXL (tests/fixtures/block_size_push.py,
    run_concurrent_block_size_pushes)."""
    run_concurrent_block_size_pushes(
        prefill_size, decode_size, lambda name: TransferAgent(name, NixlConfig(transfer_timeout_s=10.0,
                                                                               post_timeout_s=10.0)))
