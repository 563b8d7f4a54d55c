"""Push planning with several KV-cache groups (vLLM's hybrid KV-cache manager): each layer is written with its own
group's blocks on both sides, and a sliding-window group only from its first token on decode."""

from __future__ import annotations

import pytest

from kvpush.api.outcome import PushOutcome
from kvpush.connector.worker.push_state import PushTransfer

BS = 128
NULL = 0  # decode's null block: what vLLM leaves behind a sliding window
# Gemma 3's pattern: sliding, full, sliding, full (group 0 sliding, group 1 full, as vLLM orders them).
LAYER_GROUPS = (0, 1, 0, 1)


def _push(prompt: int) -> PushTransfer:
    push = PushTransfer("t1", "r1", prompt, len(LAYER_GROUPS), BS, LAYER_GROUPS)
    blocks = -(-prompt // BS)
    push.set_source_blocks(tuple(range(100, 100 + blocks)), 0)
    push.set_source_blocks(tuple(range(200, 200 + blocks)), 1)
    return push


def _decode_groups(prompt: int, sliding_first_block: int) -> dict[int, tuple[tuple[int, ...], int]]:
    blocks = -(-prompt // BS)
    sliding = tuple(NULL if i < sliding_first_block else 500 + i for i in range(blocks))
    full = tuple(600 + i for i in range(blocks))
    return {0: (sliding, sliding_first_block * BS), 1: (full, 0)}


def _instruct(push: PushTransfer, sliding_first_block: int, skip: int = 0) -> None:
    groups = _decode_groups(push.prompt_token_count, sliding_first_block)
    push.set_instruction("decode-agent", groups[0][0], skip, push.prompt_token_count, b"t1",
                         dst_block_groups=groups)


def _ready_all(push: PushTransfer, tokens: int) -> None:
    for layer in range(push.layer_count):
        push.mark_ready(layer, tokens)


def test_each_layer_writes_its_groups_blocks_and_the_sliding_group_only_its_window():
    """1061 tokens (9 blocks), sliding group's first 7 decode blocks null: sliding layers write blocks 7-8 from
    their group's lists, full layers every block from theirs; no write touches a null block."""
    push = _push(1061)
    _instruct(push, sliding_first_block=7)
    _ready_all(push, 1061)
    writes = push.next_writes()
    by_layer = {w.layer: w for w in writes}
    assert sorted(by_layer) == [0, 1, 2, 3]
    for layer in (0, 2):
        w = by_layer[layer]
        assert (w.token_start, w.token_end) == (7 * BS, 1061)
        assert w.src_block_ids[7:] == (107, 108) and w.dst_block_ids[7:] == (507, 508)
        assert NULL not in w.dst_block_ids[w.token_start // BS:]
    for layer in (1, 3):
        w = by_layer[layer]
        assert (w.token_start, w.token_end) == (0, 1061)
        assert w.src_block_ids == tuple(range(200, 209)) and w.dst_block_ids == tuple(range(600, 609))
    assert sum(w.notify for w in writes) == 1 and push.all_planned


def test_chunked_prefill_plans_sliding_layers_only_once_their_window_is_computed():
    """Chunks of 256 tokens: a sliding layer plans nothing until tokens past its first token are ready; every
    (layer, block) it owes is planned exactly once and DONE follows the last landed write."""
    push = _push(1061)
    _instruct(push, sliding_first_block=7)
    planned: dict[int, list[tuple[int, int]]] = {layer: [] for layer in range(4)}
    all_writes = []
    for end in (256, 512, 768, 1024, 1061):
        _ready_all(push, end)
        writes = push.next_writes()
        all_writes += writes
        for w in writes:
            planned[w.layer].append((w.token_start, w.token_end))
        if end <= 7 * BS:
            assert not [w for w in writes if LAYER_GROUPS[w.layer] == 0], end
    assert planned[0] == planned[2] == [(896, 1024), (1024, 1061)]
    assert planned[1] == planned[3] == [(0, 256), (256, 512), (512, 768), (768, 1024), (1024, 1061)]
    for _ in all_writes:
        push.write_submitted()
    for _ in all_writes:
        push.write_finished(PushOutcome.DONE, end_time=1.0)
    assert push.outcome is PushOutcome.DONE


def test_decode_prefix_hit_past_the_window_start_wins():
    """skip (decode's own hit) beyond the sliding group's first token: every layer starts at the hit."""
    push = _push(1061)
    _instruct(push, sliding_first_block=2, skip=4 * BS)
    _ready_all(push, 1061)
    assert {(w.layer, w.token_start) for w in push.next_writes()} == {(0, 512), (1, 512), (2, 512), (3, 512)}


def test_a_window_covering_the_whole_prompt_writes_every_block():
    """A prompt shorter than the window: no null block, sliding layers write everything like full ones."""
    push = _push(50)
    _instruct(push, sliding_first_block=0)
    _ready_all(push, 50)
    assert sorted((w.layer, w.token_start, w.token_end) for w in push.next_writes()) \
        == [(0, 0, 50), (1, 0, 50), (2, 0, 50), (3, 0, 50)]


@pytest.mark.parametrize("groups, message", [
    (None, "no decode_block_groups"),
    ({0: ((500, 501, 502), 0)}, "decode's layers are in 1 KV-cache groups, this engine's in 2"),
    ({0: ((500, 501, 502), 0), 2: ((600, 601, 602), 0)}, "no decode blocks for KV-cache groups [1]"),
    ({0: ((500, 501, 502), 100), 1: ((600, 601, 602), 0)}, "first_token 100 is not a multiple of 128"),
    ({0: ((500, 501, 502), 0), 1: ((600, 601), 0)}, "cannot hold 300 tokens (KV-cache group 1)"),
])
def test_an_instruction_that_does_not_fit_the_groups_is_refused_and_changes_nothing(groups, message):
    """Missing or short group lists, or a first token off a block boundary: ValueError, no instruction kept."""
    push = _push(300)
    with pytest.raises(ValueError, match=__import__("re").escape(message)):
        push.set_instruction("decode-agent", (500, 501, 502), 0, 300, b"t1", dst_block_groups=groups)
    assert not push.has_instruction
    _ready_all(push, 300)
    assert push.next_writes() == []


def test_layer_groups_must_name_a_group_per_layer():
    with pytest.raises(ValueError, match="layer_groups"):
        PushTransfer("t1", "r1", 300, 4, BS, (0, 1))


def test_a_one_group_engine_refuses_decode_blocks_of_several_groups():
    """Prefill without the hybrid manager, decode with it: refused, rather than writing every layer into group 0's
    blocks (a sliding group's null blocks among them)."""
    push = PushTransfer("t1", "r1", 300, 2, BS)
    push.set_source_blocks((100, 101, 102))
    with pytest.raises(ValueError, match="decode's layers are in 2 KV-cache groups, this engine's in 1"):
        push.set_instruction("decode-agent", (0, 501, 502), 0, 300, b"t1",
                             dst_block_groups={0: ((0, 501, 502), 128), 1: ((600, 601, 602), 0)})
    assert not push.has_instruction


def test_one_group_behaves_as_before():
    """No layer groups: the single-list instruction plans every layer from the skip, group 0's blocks."""
    push = PushTransfer("t1", "r1", 300, 2, BS)
    push.set_source_blocks((100, 101, 102))
    push.set_instruction("decode-agent", (500, 501, 502), 0, 300, b"t1")
    _ready_all(push, 300)
    writes = push.next_writes()
    assert [(w.layer, w.src_block_ids, w.dst_block_ids) for w in writes] \
        == [(0, (100, 101, 102), (500, 501, 502)), (1, (100, 101, 102), (500, 501, 502))]


def test_readiness_to_the_directory_names_every_groups_source_blocks():
    """The first readiness of a two-group push carries group 0's blocks as source_block_ids and both groups'
    as source_block_groups (for tokens [0, token_end))."""
    from kvpush.connector.metadata import PrefillChunk
    from kvpush.connector.worker.push_machine import LayerSaved, PushBook, PushRules

    book = PushBook(PushRules(len(LAYER_GROUPS), BS, 5.0, 1.0, layer_groups=LAYER_GROUPS))
    chunk = PrefillChunk("r1", "t1", 0, 200, 300, (100, 101), block_groups=((100, 101), (200, 201)))
    book.step_started([chunk], {}, [], {}, 0.0)
    (ready,) = book.layer_saved(LayerSaved(0, None, 0.0), 0.0).ready
    assert (ready.source_block_ids, ready.source_block_groups) == ((100, 101), ((100, 101), (200, 201)))
