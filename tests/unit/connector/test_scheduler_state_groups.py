"""The scheduler halves of a hybrid SSM engine (a state group beside attention), on vLLM's own Request, KVCacheBlocks
and SchedulerOutput: prefill computes all but the last prompt token and names each group's blocks in its own size;
decode asks for the prompt minus one and reports the state block; first_token_from_prefill is not honoured."""

from __future__ import annotations

from kvpush.connector.config import ConnectorConfig
from kvpush.connector.scheduler.decode import DecodeScheduler
from kvpush.connector.scheduler.prefill import PrefillScheduler
from tests.unit.connector.test_scheduler_groups import BS, _blocks, _output, _Reporter, _request

STATE_BS = 4096  # one state block per request (vLLM without prefix caching)
STATE = {0: STATE_BS}  # group 0 is the Mamba layers', as vLLM orders tiny-granite-4.0-h's groups


def _prefill() -> PrefillScheduler:
    config = ConnectorConfig.from_extra_config({"directory_address": "127.0.0.1:1"}, role="prefill", engine_id="p")
    return PrefillScheduler(config, BS, state_group_block_sizes=STATE)


def test_prefill_computes_all_but_the_last_prompt_token_and_names_the_state_block():
    scheduler = _prefill()
    request = _request({"do_remote_decode": True, "first_token_from_prefill": True}, 40, 1)
    scheduler.on_new_request(request)
    assert (request.num_prompt_tokens, request.num_tokens, len(request.prompt_token_ids)) == (39, 39, 39)
    assert request.prompt_token_ids[-1] == 38
    first = scheduler.build_connector_meta(_output(32, new=request, new_blocks=([5], [8, 4])))
    (chunk,) = first.prefill_chunks
    assert (chunk.prompt_token_count, chunk.block_ids, chunk.block_groups) == (39, (5,), ((5,), (8, 4)))
    assert not chunk.sends_first_token  # the token sampled after 39 tokens is not decode's first
    request.num_computed_tokens = 32
    second = scheduler.build_connector_meta(_output(7, cached_blocks=([], [10])))
    (chunk,) = second.prefill_chunks
    assert (chunk.token_start, chunk.token_end, chunk.block_groups) == (32, 39, ((5,), (8, 4, 10)))


def test_a_one_token_prompt_is_left_whole_and_attention_only_engines_never_cut():
    scheduler = _prefill()
    request = _request({"do_remote_decode": True}, 1, 1)
    scheduler.on_new_request(request)
    assert request.num_prompt_tokens == 1
    config = ConnectorConfig.from_extra_config({"directory_address": "127.0.0.1:1"}, role="prefill", engine_id="p")
    plain = PrefillScheduler(config, BS)
    request = _request({"do_remote_decode": True}, 40, 1)
    plain.on_new_request(request)
    assert request.num_prompt_tokens == 40


def _decode() -> tuple[DecodeScheduler, _Reporter]:
    config = ConnectorConfig.from_extra_config({"directory_address": "127.0.0.1:1", "decode_allocation_wait_s": None},
                                               role="decode", engine_id="d")
    reporter = _Reporter()
    return DecodeScheduler(config, BS, reporter, (0, 0), state_group_block_sizes=STATE), reporter


def test_decode_asks_for_the_prompt_minus_one_and_reports_the_state_block():
    """40 prompt tokens: 39 arrive by push (3 attention blocks of 16, one state block); vLLM computes token 40 here."""
    scheduler, reporter = _decode()
    request = _request({"do_remote_prefill": True, "first_token_from_prefill": True}, 40, 8)
    scheduler.on_new_request(request)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (39, True)
    scheduler.update_state_after_alloc(request, _blocks([30], [7, 3, 9]), 39)
    assert reporter.reports == [([30], 0, [([30], 0), ([7, 3, 9], 0)])]
    (receive,) = scheduler.build_connector_meta(_output(0)).receives
    assert (receive.prompt_token_count, receive.block_ids, receive.awaits_first_token) == (39, (30,), False)


def test_decode_with_an_attention_only_engine_still_asks_for_the_whole_prompt():
    config = ConnectorConfig.from_extra_config({"directory_address": "127.0.0.1:1", "decode_allocation_wait_s": None},
                                               role="decode", engine_id="d")
    scheduler = DecodeScheduler(config, BS, _Reporter(), (0, 0))
    request = _request({"do_remote_prefill": True}, 40, 8)
    scheduler.on_new_request(request)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (40, True)
