"""The scheduler halves with several KV-cache groups (vLLM's hybrid KV-cache manager), on vLLM's own Request,
KVCacheBlocks and SchedulerOutput objects: prefill chunks carry every group's blocks, decode reports each group's
blocks and where a sliding-window group's kept blocks start."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from vllm import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.request import Request

from kvpush.connector.config import ConnectorConfig
from kvpush.connector.scheduler.decode import DecodeScheduler
from kvpush.connector.scheduler.prefill import PrefillScheduler

BS = 16


def _request(leg: dict[str, object], prompt: int, max_tokens: int) -> Request:
    return Request(request_id="r1", prompt_token_ids=list(range(prompt)), pooling_params=None,
                   sampling_params=SamplingParams(max_tokens=max_tokens,
                                                  extra_args={"kv_transfer_params": {"transfer_id": "t1", **leg}}))


def _output(tokens: int, new: Request | None = None, new_blocks: tuple[list[int], ...] | None = None,
            cached_blocks: tuple[list[int], ...] | None = None) -> SchedulerOutput:
    output = SchedulerOutput.make_empty()
    scheduled_new = [NewRequestData.from_request(new, new_blocks)] if new is not None else []
    cached = CachedRequestData.make_empty()
    if cached_blocks is not None:
        cached = dataclasses.replace(cached, req_ids=["r1"], new_block_ids=[cached_blocks],
                                     new_token_ids=[[]], all_token_ids={}, num_computed_tokens=[32],
                                     num_output_tokens=[0])
    return dataclasses.replace(output, scheduled_new_reqs=scheduled_new, scheduled_cached_reqs=cached,
                               num_scheduled_tokens={"r1": tokens}, total_num_scheduled_tokens=tokens)


def test_prefill_chunks_carry_every_groups_blocks():
    """Two groups, two chunks: each chunk names both groups' blocks for tokens [0, token_end); group 0's list is
    also block_ids (what one-group readers use)."""
    config = ConnectorConfig.from_extra_config({"directory_address": "127.0.0.1:1"}, role="prefill", engine_id="p")
    scheduler = PrefillScheduler(config, BS)
    request = _request({"do_remote_decode": True}, 40, 1)
    scheduler.on_new_request(request)
    first = scheduler.build_connector_meta(_output(32, new=request, new_blocks=([7, 3], [8, 4])))
    (chunk,) = first.prefill_chunks
    assert (chunk.block_ids, chunk.block_groups) == ((7, 3), ((7, 3), (8, 4)))
    request.num_computed_tokens = 32
    second = scheduler.build_connector_meta(_output(8, cached_blocks=([9], [10])))
    (chunk,) = second.prefill_chunks
    assert (chunk.token_end, chunk.block_ids, chunk.block_groups) == (40, (7, 3, 9), ((7, 3, 9), (8, 4, 10)))


class _Reporter:
    def __init__(self) -> None:
        self.reports: list[tuple[list[int], int, list[tuple[list[int], int]]]] = []

    def report_allocation(self, transfer_id: str, block_ids: list[int], prompt_token_count: int,
                          skip_token_count: int, on_refused: Callable[[str], None],
                          block_groups: Sequence[tuple[Sequence[int], int]] = ()) -> None:
        self.reports.append((block_ids, skip_token_count, [(list(ids), first) for ids, first in block_groups]))

    def cancel_transfer(self, transfer_id: str, reason: str) -> None:
        raise AssertionError("no cancellation expected")


def _decode(windows: tuple[int, ...]) -> tuple[DecodeScheduler, _Reporter]:
    # Allocation at once: these tests are about the report's groups, not when it goes out.
    config = ConnectorConfig.from_extra_config({"directory_address": "127.0.0.1:1", "decode_allocation_wait_s": None},
                                               role="decode", engine_id="d")
    reporter = _Reporter()
    return DecodeScheduler(config, BS, reporter, windows), reporter


def _blocks(*groups: list[int]) -> KVCacheBlocks:
    return KVCacheBlocks(tuple([KVCacheBlock(i) for i in ids] for ids in groups))


def test_decode_reports_each_group_and_where_the_sliding_window_starts():
    """100 prompt tokens, sliding group padded with the null block (id 0) for its first 4 blocks: that group's
    first token is 64; the full group's is 0; block_ids repeat group 0's."""
    scheduler, reporter = _decode((32, 0))
    request = _request({"do_remote_prefill": True}, 100, 4)
    scheduler.on_new_request(request)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (100, True)
    scheduler.update_state_after_alloc(request, _blocks([0, 0, 0, 0, 11, 12, 13], [20, 21, 22, 23, 24, 25, 26]), 100)
    ((block_ids, skip, groups),) = reporter.reports
    assert block_ids == [0, 0, 0, 0, 11, 12, 13] and skip == 0
    assert groups == [([0, 0, 0, 0, 11, 12, 13], 64), ([20, 21, 22, 23, 24, 25, 26], 0)]


def test_a_full_attention_group_never_gets_a_window_start():
    """A full-attention group starts at token 0 whatever its ids (id 0 there is a real block only if vLLM says so;
    the null block is never given to full attention for a remote load)."""
    scheduler, reporter = _decode((0, 32))
    request = _request({"do_remote_prefill": True}, 40, 4)
    scheduler.on_new_request(request)
    scheduler.update_state_after_alloc(request, _blocks([5, 6, 7], [0, 0, 9]), 40)
    ((_, _, groups),) = reporter.reports
    assert groups == [([5, 6, 7], 0), ([0, 0, 9], 32)]


def test_one_group_reports_no_groups():
    scheduler, reporter = _decode(())
    request = _request({"do_remote_prefill": True}, 40, 4)
    scheduler.on_new_request(request)
    scheduler.update_state_after_alloc(request, _blocks([5, 6, 7]), 40)
    assert reporter.reports == [([5, 6, 7], 0, [])]
