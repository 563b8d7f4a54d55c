"""Planning names why two engines cannot pair: both engine ids, the registered field that differs and both values;
only when every registered field is equal does the refusal fall back to the compatibility hash, naming what only
the hash covers. The gRPC answer is FAILED_PRECONDITION with that text. Engines of different block sizes pair unless
the directory runs with --no-pair-block-sizes (`Limits.pair_block_sizes`), and only where the data plane maps them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest

from kvpush.directory.errors import FailedPrecondition
from kvpush.directory.planning import can_push_to, incompatibility
from kvpush.directory.state import DirectoryState, Limits
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import directory_pb2_grpc as dgrpc
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import DECODE, PREFILL, ManualClock, make_layout, register_request, running_directory


def _refusal(prefill: dpb.RegisterEngineRequest, *decodes: dpb.RegisterEngineRequest,
             pair_block_sizes: bool = False) -> str:
    """The FailedPrecondition message of a plan over `prefill` and `decodes` (all registered, tp ranks complete)."""
    state = DirectoryState(Limits(pair_block_sizes=pair_block_sizes), ManualClock().clock())
    for request in (prefill, *decodes):
        state.register(request)
    with pytest.raises(FailedPrecondition) as refused:
        state.plan(dpb.PlanTransferRequest(), None)
    assert state.check_invariants() == []
    return str(refused.value)


def _pair(edit: Callable[[tpb.KVLayout], None]) -> str:
    """The refusal for prefill 'p0' (the fixture's layout) and decode 'd0' (that layout after `edit`)."""
    decode_layout = make_layout()
    edit(decode_layout)
    return _refusal(register_request("p0", PREFILL), register_request("d0", DECODE, layout=decode_layout))


def _set(**fields: object) -> Callable[[tpb.KVLayout], None]:
    def edit(layout: tpb.KVLayout) -> None:
        for name, value in fields.items():
            setattr(layout, name, value)
    return edit


def _plans(prefill: dpb.RegisterEngineRequest, decode: dpb.RegisterEngineRequest,
           pair_block_sizes: bool = False) -> tuple[str, str]:
    """(prefill, decode) engine ids of a plan over one prefill and one decode engine."""
    state = DirectoryState(Limits(pair_block_sizes=pair_block_sizes), ManualClock().clock())
    state.register(prefill)
    state.register(decode)
    planned, _ = state.plan(dpb.PlanTransferRequest(prompt_token_count=300), None)
    assert state.check_invariants() == []
    return planned.prefill_engine_id, planned.decode_engine_id


@pytest.mark.parametrize(("prefill_size", "decode_size"), [(16, 128), (128, 16), (32, 48), (48, 32)])
def test_token_addressable_layouts_of_different_block_sizes_pair_with_the_switch(prefill_size: int,
                                                                                 decode_size: int):
    """GPU layouts (tokens have addresses, contiguous per segment) map through chunks of gcd(sizes) tokens."""
    prefill = register_request("p0", PREFILL, layout=make_layout(block_size_tokens=prefill_size))
    decode = register_request("d0", DECODE, layout=make_layout(block_size_tokens=decode_size))
    assert _plans(prefill, decode, pair_block_sizes=True) == ("p0", "d0")


@pytest.mark.parametrize(("prefill_size", "decode_size"), [(16, 128), (128, 16)])
def test_different_block_sizes_pair_by_default_and_are_refused_with_the_switch_off(prefill_size: int,
                                                                                    decode_size: int):
    """The same engines with --no-pair-block-sizes: refused, naming the field, both values, both engines and the
    switch; the directory is left as it was (no transfer). A directory of default limits plans them."""
    prefill = register_request("p0", PREFILL, layout=make_layout(block_size_tokens=prefill_size))
    decode = register_request("d0", DECODE, layout=make_layout(block_size_tokens=decode_size))
    assert _refusal(prefill, decode) == (
        f"no compatible prefill/decode pair: block_size_tokens {prefill_size} of prefill 'p0' differs from "
        f"{decode_size} of decode 'd0' (engines of different block sizes pair only when the directory runs with "
        "--pair-block-sizes)")
    state = DirectoryState(Limits(pair_block_sizes=False), ManualClock().clock())
    state.register(prefill)
    state.register(decode)
    with pytest.raises(FailedPrecondition, match="--pair-block-sizes"):
        state.plan(dpb.PlanTransferRequest(prompt_token_count=300), None)
    assert (state.active_transfer_count("p0"), state.active_transfer_count("d0")) == (0, 0)
    default = DirectoryState(Limits(), ManualClock().clock())
    default.register(prefill)
    default.register(decode)
    default.plan(dpb.PlanTransferRequest(prompt_token_count=300), None)
    assert (default.active_transfer_count("p0"), default.active_transfer_count("d0")) == (1, 1)


def test_block_atomic_layouts_of_different_block_sizes_name_the_field_both_values_and_both_engines():
    """vLLM CPU attention tiles tokens inside a block: its KV moves only as whole blocks of one size, switch or not
    (without it, the same reason: the switch would not help)."""
    atomic_16, atomic_128 = make_layout(), make_layout(block_size_tokens=128)
    atomic_16.block_atomic = atomic_128.block_atomic = True
    message = _refusal(register_request("p0", PREFILL, layout=atomic_16),
                       register_request("d0", DECODE, layout=atomic_128), pair_block_sizes=True)
    assert _refusal(register_request("p0", PREFILL, layout=atomic_16),
                    register_request("d0", DECODE, layout=atomic_128)) == message
    assert message.startswith("no compatible prefill/decode pair: block_size_tokens 16 of prefill 'p0' differs "
                              "from 128 of decode 'd0' (prefill's layout is block_atomic")
    assert "start both with one --block-size" in message
    assert "pairs tried" not in message  # one pair only
    message = _refusal(register_request("p0", PREFILL, layout=atomic_128),
                       register_request("d0", DECODE, layout=atomic_16), pair_block_sizes=True)
    assert "block_size_tokens 128 of prefill 'p0' differs from 16 of decode 'd0'" in message


def test_block_atomic_layouts_of_one_block_size_still_pair():
    atomic_p, atomic_d = make_layout(), make_layout()
    atomic_p.block_atomic = atomic_d.block_atomic = True
    assert _plans(register_request("p0", PREFILL, layout=atomic_p),
                  register_request("d0", DECODE, layout=atomic_d)) == ("p0", "d0")


def test_a_token_addressable_layout_and_a_tiled_one_of_another_block_size_are_refused():
    decode_layout = make_layout(block_size_tokens=128)
    decode_layout.block_atomic = True
    message = _refusal(register_request("p0", PREFILL), register_request("d0", DECODE, layout=decode_layout),
                       pair_block_sizes=True)
    assert ("block_size_tokens 16 of prefill 'p0' differs from 128 of decode 'd0' (decode's layout is "
            "block_atomic") in message


def test_tokens_with_gaps_cannot_be_mapped_between_block_sizes():
    """A segment whose tokens are not adjacent would need one descriptor per token: refused, naming the plane."""
    decode_layout = make_layout(block_size_tokens=128)
    plane = decode_layout.planes[0]
    plane.token_stride_bytes, plane.segment_bytes_per_token = 256, 128
    message = _refusal(register_request("p0", PREFILL), register_request("d0", DECODE, layout=decode_layout),
                       pair_block_sizes=True)
    assert "block_size_tokens 16 of prefill 'p0' differs from 128 of decode 'd0'" in message
    assert "decode's planes[0] has gaps between tokens" in message


def test_sizes_whose_chunk_tables_overflow_nixl_indices_are_refused():
    """16 and 17 tokens share only 1-token chunks: decode's table of 32 layers x 17 chunks x 4M blocks is past int32;
    the same sizes with few blocks pair."""
    prefill = register_request("p0", PREFILL, layout=make_layout(layer_count=32))
    decode = register_request("d0", DECODE, layout=make_layout(layer_count=32, block_size_tokens=17,
                                                               block_count=1 << 22))
    message = _refusal(prefill, decode, pair_block_sizes=True)
    assert "block_size_tokens 16 of prefill 'p0' differs from 17 of decode 'd0'" in message
    assert "1-token chunks with 2281701376 entries, past NIXL's int32 index range" in message
    small = register_request("d0", DECODE, layout=make_layout(layer_count=32, block_size_tokens=17))
    assert _plans(prefill, small, pair_block_sizes=True) == ("p0", "d0")


def test_peer_announcements_follow_the_block_size_rule():
    """A prefill worker is told of decode workers it may push to: with the switch, the token-addressable one of
    another block size (registered before its session opened or while it is open), never the tiled one of another
    block size; without it, neither."""
    tiled = make_layout(block_size_tokens=128)
    tiled.block_atomic = True
    announced = {}
    for switch in (False, True):
        state = DirectoryState(Limits(pair_block_sizes=switch), ManualClock().clock())
        worker, _ = state.register(register_request("p0", PREFILL))
        state.register(register_request("d-gpu", DECODE, layout=make_layout(block_size_tokens=128)))
        state.register(register_request("d-cpu", DECODE, layout=tiled))
        groups = state.engines.groups
        prefill_worker = groups["p0"].workers[0]
        assert can_push_to(prefill_worker, groups["d-gpu"].workers[0], pair_block_sizes=switch) is switch
        assert not can_push_to(prefill_worker, groups["d-cpu"].workers[0], pair_block_sizes=switch)
        session, _ = state.open_session("p0", 0, worker.lease_id)
        # One registered while the session is open is announced (or not) by the same rule.
        state.register(register_request("d-late", DECODE, layout=make_layout(block_size_tokens=128)))
        announced[switch] = [m.peer.decode_engine_id for m in state.drain_outbox("p0", 0, session)]
    assert announced == {False: [], True: ["d-gpu", "d-late"]}


def test_different_tp_sizes_name_both_sizes():
    prefill = register_request("p0", PREFILL)
    decodes = [register_request("d0", DECODE, rank, 2) for rank in (0, 1)]
    message = _refusal(prefill, *decodes)
    assert ("tp_size 1 of prefill 'p0' and 2 of decode 'd0' differ and prefill 'p0' registered no "
            "layout.kv_head_count / layout.model_kv_head_count") in message


def test_different_layer_counts():
    message = _pair(lambda layout: layout.CopyFrom(make_layout(layer_count=8)))
    assert "layer_count 4 of prefill 'p0' differs from 8 of decode 'd0'" in message


def test_different_dtypes():
    message = _pair(_set(dtype="float16"))
    assert "dtype 'bfloat16' of prefill 'p0' differs from 'float16' of decode 'd0'" in message


def test_a_cpu_tiled_layout_and_a_token_addressable_one():
    message = _pair(_set(block_atomic=True))
    assert "block_atomic False of prefill 'p0' differs from True of decode 'd0'" in message
    assert "tiles" in message


def test_fused_and_separate_kv_planes():
    def split(layout: tpb.KVLayout) -> None:
        half = tpb.KVPlane(block_stride_bytes=2048, block_bytes=2048, segment_count=1, token_stride_bytes=128,
                           segment_bytes_per_token=128)
        del layout.planes[:]
        layout.planes.extend([half, tpb.KVPlane(offset_bytes=2048 * 64, **{
            f.name: getattr(half, f.name) for f in tpb.KVPlane.DESCRIPTOR.fields if f.name != "offset_bytes"})])

    message = _pair(split)
    assert "plane count 1 of prefill 'p0' differs from 2 of decode 'd0'" in message


def test_an_hnd_layout_against_an_nhd_one_names_the_segment_count():
    def hnd(layout: tpb.KVLayout) -> None:
        plane = layout.planes[0]
        plane.segment_count, plane.segment_stride_bytes, plane.segment_bytes_per_token = 2, 2048, 128

    message = _pair(hnd)
    assert "planes[0].segment_count 1 of prefill 'p0' differs from 2 of decode 'd0'" in message
    assert "HND" in message


def test_another_head_size_names_the_token_bytes():
    def smaller_heads(layout: tpb.KVLayout) -> None:
        layout.planes[0].segment_bytes_per_token = 128

    message = _pair(smaller_heads)
    assert "planes[0].segment_bytes_per_token 256 of prefill 'p0' differs from 128 of decode 'd0'" in message


def test_different_models_with_equal_layouts_name_the_models():
    prefill = register_request("p0", PREFILL, layout=make_layout(compatibility_hash="hash-a"))
    decode = register_request("d0", DECODE, layout=make_layout(compatibility_hash="hash-b"))
    prefill.model, decode.model = "llama", "qwen"
    message = _refusal(prefill, decode)
    assert ("compatibility hash hash-a of prefill 'p0' differs from hash-b of decode 'd0' (they serve different "
            "models: 'llama' and 'qwen')") in message


def test_only_the_hash_differs_names_what_only_the_hash_covers():
    prefill = register_request("p0", PREFILL, layout=make_layout(compatibility_hash="hash-a"))
    decode = register_request("d0", DECODE, layout=make_layout(compatibility_hash="hash-b"))
    prefill.model = decode.model = "llama"
    message = _refusal(prefill, decode)
    assert "compatibility hash hash-a of prefill 'p0' differs from hash-b of decode 'd0'" in message
    assert "every registered layout field is equal" in message and "vLLM release" in message


def test_a_field_is_named_before_the_hash_it_also_changes():
    """Real engines hash their layer count too: the refusal names the layer count, not the hash."""
    prefill = register_request("p0", PREFILL, layout=make_layout(compatibility_hash="hash-4"))
    decode = register_request("d0", DECODE, layout=make_layout(layer_count=8, compatibility_hash="hash-8"))
    message = _refusal(prefill, decode)
    assert "layer_count 4 of prefill 'p0' differs from 8 of decode 'd0'" in message
    assert "hash" not in message


def test_memory_kind_and_block_count_alone_still_pair():
    """Not compared (as before): each side's memory kind and block count are its own."""
    state = DirectoryState(Limits(), ManualClock().clock())
    decode_layout = make_layout(block_count=128)
    decode_layout.memory_kind = tpb.MEMORY_KIND_VRAM
    state.register(register_request("p0", PREFILL))
    state.register(register_request("d0", DECODE, layout=decode_layout))
    planned, _ = state.plan(dpb.PlanTransferRequest(), None)
    assert (planned.prefill_engine_id, planned.decode_engine_id) == ("p0", "d0")


def test_several_failing_pairs_name_the_first_pair_tried_and_a_compatible_pair_still_wins():
    """Decodes are tried most free blocks first: d-big's reason is named; adding a compatible decode plans it."""
    state = DirectoryState(Limits(), ManualClock().clock())
    state.register(register_request("p0", PREFILL))
    state.register(register_request("d-big", DECODE, layout=make_layout(block_count=256, dtype="float16")))
    state.register(register_request("d-small", DECODE, layout=make_layout(block_count=32, layer_count=8)))
    with pytest.raises(FailedPrecondition) as refused:
        state.plan(dpb.PlanTransferRequest(), None)
    message = str(refused.value)
    assert "dtype 'bfloat16' of prefill 'p0' differs from 'float16' of decode 'd-big'" in message
    assert message.endswith("(the first of 2 pairs tried)") and "d-small" not in message
    state.register(register_request("d-fits", DECODE, layout=make_layout(block_count=8)))
    planned, _ = state.plan(dpb.PlanTransferRequest(), None)
    assert planned.decode_engine_id == "d-fits"


def test_incompatibility_is_empty_for_equal_layouts():
    state = DirectoryState(Limits(), ManualClock().clock())
    state.register(register_request("p0", PREFILL, layout=make_layout(compatibility_hash="h")))
    state.register(register_request("d0", DECODE, layout=make_layout(block_count=8, compatibility_hash="h")))
    groups = state.engines.groups
    assert incompatibility(groups["p0"], groups["d0"]) == ""


def test_the_grpc_answer_is_failed_precondition_with_the_field():
    """Over gRPC: FAILED_PRECONDITION, and the details carry the field, both values and both engine ids."""
    async def scenario() -> grpc.aio.AioRpcError:
        async with running_directory() as directory:
            async with grpc.aio.insecure_channel(directory.address) as channel:
                stub = dgrpc.KVDirectoryServiceStub(channel)
                tiled_128 = make_layout(block_size_tokens=128)
                tiled_16 = make_layout()
                tiled_128.block_atomic = tiled_16.block_atomic = True
                await stub.RegisterEngine(register_request("p0", PREFILL, layout=tiled_16))
                await stub.RegisterEngine(register_request("d0", DECODE, layout=tiled_128))
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.PlanTransfer(dpb.PlanTransferRequest())
                return refused.value

    refused = asyncio.run(scenario())
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "block_size_tokens 16 of prefill 'p0' differs from 128 of decode 'd0'" in (refused.details() or "")
