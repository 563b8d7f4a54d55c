"""The prefill push state machine: which writes become possible, exactly-once blocks, notify, done/failed."""

from __future__ import annotations

import pytest

from kvpush.api.outcome import PushOutcome, PushStop, StopCause
from kvpush.connector.worker.push_state import PushTransfer

BS = 128


def _push(prompt: int, layers: int = 2) -> PushTransfer:
    push = PushTransfer("t1", "r1", prompt, layers, BS)
    push.set_source_blocks(tuple(range(100, 100 + -(-prompt // BS))))
    return push


def _instruct(push: PushTransfer, skip: int = 0) -> None:
    push.set_instruction("decode-agent", tuple(range(500, 500 + push.total_blocks)), skip, push.prompt_token_count,
                         b"t1")


def _land(push: PushTransfer, writes) -> None:
    for _ in writes:
        push.write_submitted()
    for _ in writes:
        push.write_finished(PushOutcome.DONE, end_time=1.0)
    push.writer_is_quiet()


def test_nothing_is_written_before_the_instruction():
    """Readiness alone plans no write; the instruction then releases the backlog of every ready layer."""
    push = _push(300)
    push.mark_ready(0, 256)
    push.mark_ready(1, 256)
    assert push.next_writes() == []
    _instruct(push)
    writes = push.next_writes()
    assert [(w.layer, w.token_start, w.token_end) for w in writes] == [(0, 0, 256), (1, 0, 256)]
    assert writes[0].src_block_ids == (100, 101) and writes[0].dst_block_ids == (500, 501)


def test_a_chunk_ending_mid_block_leaves_that_block_for_later():
    """Tokens [0, 200) ready: only block 0 is written; the final chunk writes block 1 with the partial block 2."""
    push = _push(300, layers=1)
    _instruct(push)
    push.mark_ready(0, 200)
    first = push.next_writes()
    assert [(w.token_start, w.token_end) for w in first] == [(0, 128)]
    push.mark_ready(0, 300)
    second = push.next_writes()
    assert [(w.token_start, w.token_end, w.notify) for w in second] == [(128, 300, True)]
    assert push.next_writes() == []


def test_every_block_of_every_layer_is_planned_exactly_once():
    """Over many uneven chunks, each (layer, block) appears in exactly one write."""
    push = _push(1061, layers=3)
    _instruct(push)
    seen: list[tuple[int, int]] = []
    for end in (100, 256, 300, 512, 700, 1024, 1061):
        for layer in range(3):
            push.mark_ready(layer, end)
            for w in push.next_writes():
                seen += [(w.layer, b) for b in range(w.token_start // BS, -(-w.token_end // BS))]
    assert sorted(seen) == sorted((layer, b) for layer in range(3) for b in range(push.total_blocks))


def test_decode_prefix_hit_is_skipped():
    """skip_token_count = 256: blocks 0 and 1 are never written."""
    push = _push(400, layers=1)
    _instruct(push, skip=256)
    push.mark_ready(0, 400)
    writes = push.next_writes()
    assert [(w.token_start, w.token_end) for w in writes] == [(256, 400)]


def test_done_only_after_every_write_landed_and_the_writer_is_quiet():
    """DONE needs the notifying write and all earlier ones landed; quiescent needs the data plane's word too."""
    push = _push(256)
    _instruct(push)
    push.mark_ready(0, 256)
    push.mark_ready(1, 256)
    writes = push.next_writes()
    assert writes[-1].notify and not writes[0].notify
    for _ in writes:
        push.write_submitted()
    push.write_finished(PushOutcome.DONE, end_time=1.0)
    assert not push.terminal
    push.write_finished(PushOutcome.DONE, end_time=2.0)
    assert push.outcome == PushOutcome.DONE
    assert not push.quiescent
    push.writer_is_quiet()
    assert push.quiescent


def test_a_failed_write_fails_the_transfer_and_stops_planning():
    """The first failure wins; later readiness plans nothing."""
    push = _push(512, layers=1)
    _instruct(push)
    push.mark_ready(0, 256)
    writes = push.next_writes()
    push.write_submitted()
    push.write_finished(PushOutcome.FAILED, "ERR")
    assert push.outcome == PushOutcome.FAILED and push.reason == "ERR"
    push.mark_ready(0, 512)
    assert push.next_writes() == [] and writes


def test_layers_written_before_prefill_end_counts_writes_that_landed_earlier():
    """Writes ending before prefill_end_time are counted; later ones are not."""
    push = _push(512, layers=1)
    _instruct(push)
    push.mark_ready(0, 256)
    first = push.next_writes()
    _land(push, first)
    push.prefill_ended(5.0)
    push.mark_ready(0, 512)
    second = push.next_writes()
    for _ in second:
        push.write_submitted()
        push.write_finished(PushOutcome.DONE, end_time=9.0)
    assert push.finalize_timeline().writes_before_prefill_end_count == 1


def test_layers_before_prefill_end_count_layers_not_writes():
    """A layer counts once its every write landed before prefill ended: two chunks of two layers make four writes,
    three of them early, and only the layer whose both writes were early counts."""
    push = _push(512, layers=2)
    _instruct(push)
    for layer in (0, 1):
        push.mark_ready(layer, 256)
    early = push.next_writes()
    for layer in (0, 1):
        push.mark_ready(layer, 512)
    late = push.next_writes()
    assert [w.layer for w in early] == [0, 1] and [w.layer for w in late] == [0, 1]
    for write, end in zip(early + late, (1.0, 1.0, 2.0, 9.0)):
        push.write_submitted()
        push.write_finished(PushOutcome.DONE, end_time=end, layer=write.layer)
    push.prefill_ended(5.0)
    timing = push.finalize_timeline()
    assert (timing.writes_before_prefill_end_count, timing.layers_written_before_prefill_end_count) == (3, 1)


def test_bad_instruction_is_refused():
    """A prompt length or block list that cannot fit is refused with a precise error and changes nothing."""
    push = _push(300)
    with pytest.raises(ValueError, match="prompt tokens"):
        push.set_instruction("d", tuple(range(3)), 0, 299, b"")
    with pytest.raises(ValueError, match="cannot hold"):
        push.set_instruction("d", (1, 2), 0, 300, b"")
    assert not push.has_instruction


def test_stop_keeps_the_first_reason():
    """A cancellation after a failure does not overwrite the failure."""
    push = _push(300)
    push.stop(PushStop(StopCause.WRITE_FAILED, "first"))
    push.stop(PushStop(StopCause.CANCELLED, "second"))
    assert (push.outcome, push.reason) == (PushOutcome.FAILED, "first")


def test_each_layer_keeps_when_its_last_write_was_posted_and_ended():
    """Post and end times per layer tell a write posted late from one posted on time that landed late."""
    push = _push(512, layers=2)
    _instruct(push)
    for layer in (0, 1):
        push.mark_ready(layer, 256)
    early = push.next_writes()
    for layer in (0, 1):
        push.mark_ready(layer, 512)
    late = push.next_writes()
    for write, (post, end) in zip(early + late, ((1.0, 1.5), (1.1, 1.6), (2.0, 8.0), (7.0, 7.5))):
        push.write_submitted()
        push.write_started(post, layer=write.layer)
        push.write_finished(PushOutcome.DONE, end_time=end, layer=write.layer)
    timing = push.finalize_timeline()
    assert timing.layer_write_post_times == {0: 2.0, 1: 7.0}
    assert timing.layer_write_end_times == {0: 8.0, 1: 7.5}
    assert timing.first_write_start_time == 1.0


# ---- decode of another block size ---------------------------------------------------------------------------------
def _covered(writes, block_size: int, field: str) -> list[tuple[int, ...]]:
    """Per write, the blocks of `field` (src or dst, of `block_size` tokens) that hold its tokens."""
    return [getattr(w, field)[w.token_start // block_size:-(-w.token_end // block_size)] for w in writes]


def test_decode_blocks_of_another_size_are_listed_in_decode_size():
    """Prefill 128, decode 16: a 300-token prompt needs 19 decode blocks; each write lists decode's blocks holding
    [0, token_end) and the tokens land in the decode blocks of their position."""
    push = _push(300, layers=1)
    dst = tuple(range(700, 719))
    push.set_instruction("d", dst, 0, 300, b"n", dst_block_size_tokens=16)
    push.mark_ready(0, 200)
    (first,) = push.next_writes()
    assert (first.token_start, first.token_end) == (0, 128)
    assert first.src_block_ids == (100,) and first.dst_block_ids == dst[:8]
    push.mark_ready(0, 300)
    (second,) = push.next_writes()
    assert (second.token_start, second.token_end, second.notify) == (128, 300, True)
    assert second.src_block_ids == (100, 101, 102) and second.dst_block_ids == dst
    assert _covered([second], 16, "dst_block_ids") == [dst[8:]]


def test_small_prefill_blocks_into_large_decode_blocks_cut_each_decode_block_by_token_range():
    """Prefill 16, decode 128: chunks of 100 tokens write up to the last full 16-token block, so decode block 0
    gets tokens [0, 96) from one write and [96, 128) from the next: disjoint ranges, every token once."""
    push = PushTransfer("t1", "r1", 300, 2, 16)
    push.set_source_blocks(tuple(range(100, 119)))
    push.set_instruction("d", (500, 501, 502, 503), 0, 300, b"n", dst_block_size_tokens=128)
    writes = []
    for end in (100, 200, 300):
        for layer in range(2):
            push.mark_ready(layer, end)
        writes += push.next_writes()
    for layer in range(2):
        ranges = [(w.token_start, w.token_end) for w in writes if w.layer == layer]
        assert ranges == [(0, 96), (96, 192), (192, 300)]
    assert [w.dst_block_ids for w in writes if w.layer == 0] == [(500,), (500, 501), (500, 501, 502)]
    assert [w.src_block_ids for w in writes if w.layer == 0][-1] == tuple(range(100, 119))
    assert [w.notify for w in writes] == [False] * 5 + [True]


def test_a_decode_prefix_hit_inside_a_prefill_block_starts_the_first_write_there():
    """Decode 48 holds 96 tokens (two of its blocks); prefill 64: the first write starts at 96, inside prefill
    block 1, and the blocks before the hit are never written."""
    push = PushTransfer("t1", "r1", 200, 1, 64)
    push.set_source_blocks((10, 11, 12, 13))
    push.set_instruction("d", (20, 21, 22, 23, 24), 96, 200, b"n", dst_block_size_tokens=48)
    push.mark_ready(0, 200)
    (write,) = push.next_writes()
    assert (write.token_start, write.token_end, write.notify) == (96, 200, True)
    assert write.src_block_ids == (10, 11, 12, 13) and write.dst_block_ids == (20, 21, 22, 23, 24)


def test_too_few_decode_blocks_of_decode_size_are_refused():
    """300 tokens in decode blocks of 16 need 19: 18 are refused, naming decode's block size; nothing changes."""
    push = _push(300)
    with pytest.raises(ValueError, match="18 decode blocks of 16 tokens cannot hold 300 tokens"):
        push.set_instruction("d", tuple(range(18)), 0, 300, b"", dst_block_size_tokens=16)
    assert not push.has_instruction
    with pytest.raises(ValueError, match="negative"):
        push.set_instruction("d", tuple(range(19)), 0, 300, b"", dst_block_size_tokens=-16)
    assert not push.has_instruction
