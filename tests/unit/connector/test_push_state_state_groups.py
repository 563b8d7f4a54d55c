"""Push planning for hybrid models' state layers (vLLM MambaSpec groups): a state layer's one write is its request's
state block, planned only once the layer computed the prompt's last token, never for an earlier chunk."""

from __future__ import annotations

import pytest

from kvpush.api.outcome import PushOutcome
from kvpush.connector.worker.push_state import PushTransfer

BS = 128
STATE_BS = 4096  # vLLM's state block without prefix caching: one per request (max_model_len tokens)
# tiny-granite-4.0-h as vLLM groups it: the Mamba2 layers (group 0) and the attention layers (group 1).
LAYER_GROUPS = (0, 1, 0, 1)
STATE_LAYERS = (0, 2)
ATTENTION_LAYERS = (1, 3)


def _push(prompt: int, state_bs: int = STATE_BS) -> PushTransfer:
    push = PushTransfer("t1", "r1", prompt, len(LAYER_GROUPS), BS, LAYER_GROUPS, state_group_block_sizes={0: state_bs})
    push.set_source_blocks(tuple(range(100, 100 + -(-prompt // state_bs))), 0)
    push.set_source_blocks(tuple(range(200, 200 + -(-prompt // BS))), 1)
    return push


def _instruct(push: PushTransfer, skip: int = 0, state_blocks: tuple[int, ...] | None = None,
              state_bs: int = STATE_BS) -> None:
    prompt = push.prompt_token_count
    state = state_blocks if state_blocks is not None else tuple(range(700, 700 + -(-prompt // state_bs)))
    groups = {0: (state, 0), 1: (tuple(range(600, 600 + -(-prompt // BS))), 0)}
    push.set_instruction("decode-agent", groups[1][0], skip, prompt, b"t1", dst_block_groups=groups)


def _ready(push: PushTransfer, tokens: int) -> None:
    for layer in range(push.layer_count):
        push.mark_ready(layer, tokens)


def test_earlier_chunks_push_attention_only_and_the_last_one_pushes_each_state_once():
    """1,100 tokens in 256-token chunks: attention layers write their full blocks chunk by chunk; each state layer
    writes nothing until the last chunk, then its state block whole, once; the closing write notifies."""
    push = _push(1100)
    _instruct(push)
    state_writes, attention_tokens = [], {layer: [] for layer in ATTENTION_LAYERS}
    for end in (256, 512, 768, 1024):
        _ready(push, end)
        writes = push.next_writes()
        assert {w.layer for w in writes} == set(ATTENTION_LAYERS), end
        assert not any(w.state or w.notify for w in writes)
        for w in writes:
            attention_tokens[w.layer].append((w.token_start, w.token_end))
    _ready(push, 1100)
    writes = push.next_writes()
    state_writes = [w for w in writes if w.state]
    assert [(w.layer, w.src_block_ids, w.dst_block_ids) for w in state_writes] == [(0, (100,), (700,)),
                                                                                   (2, (100,), (700,))]
    assert all((w.token_start, w.token_end) == (0, 1100) for w in state_writes)
    for w in writes:
        if not w.state:
            attention_tokens[w.layer].append((w.token_start, w.token_end))
    assert all(ranges[-1][1] == 1100 for ranges in attention_tokens.values())
    assert [w.notify for w in writes] == [False] * (len(writes) - 1) + [True]
    assert push.all_planned
    _ready(push, 1100)
    assert push.next_writes() == []  # nothing twice
    while push.in_flight:
        push.write_finished(PushOutcome.DONE, bytes_written=1)
    assert push.outcome is PushOutcome.DONE


def test_a_layer_ready_for_the_prompt_before_the_others_pushes_its_state_alone():
    """Readiness is per layer: state layer 0 done with the prompt writes at once; layer 2 only when it is."""
    push = _push(300)
    _instruct(push)
    push.mark_ready(0, 300)
    push.mark_ready(2, 299)
    writes = push.next_writes()
    assert [(w.layer, w.state) for w in writes] == [(0, True)]
    push.mark_ready(2, 300)
    assert [(w.layer, w.state) for w in push.next_writes()] == [(2, True)]


@pytest.mark.parametrize("skip,expected", [(0, True), (128, True), (256, False)])
def test_decode_prefix_hit_short_of_the_prompt_still_needs_the_state(skip, expected):
    """A hit shorter than the prompt gives decode the state at the hit, not after the prompt: the state is still
    written; a hit of the whole prompt leaves nothing."""
    push = _push(256)
    _instruct(push, skip=skip)
    _ready(push, 256)
    writes = push.next_writes()
    assert any(w.state for w in writes) is expected
    assert push.nothing_to_write() is (not expected)


def test_state_blocks_of_a_prefix_caching_mode_are_picked_by_the_prompts_last_token():
    """With state blocks of 128 tokens (vLLM's 'align' mode keeps a state per block), the state after a 300-token
    prompt is in block 2 on both sides."""
    push = _push(300, state_bs=128)
    _instruct(push, state_bs=128)
    _ready(push, 300)
    state = [w for w in push.next_writes() if w.state]
    assert {(w.src_block_ids, w.dst_block_ids) for w in state} == {((102,), (702,))}


def test_an_instruction_without_the_state_block_is_refused():
    push = _push(300, state_bs=128)
    with pytest.raises(ValueError, match="state group 0: decode's 2 blocks"):
        _instruct(push, state_blocks=(700, 701), state_bs=128)


def test_state_groups_must_be_groups_of_this_engine():
    with pytest.raises(ValueError, match="must be groups in"):
        PushTransfer("t1", "r1", 10, 2, BS, (0, 1), state_group_block_sizes={2: STATE_BS})
