"""Per-caller admission (admission.py): stream slots with the renewals' reserve, calls in flight and their bytes."""

from __future__ import annotations

import asyncio

import pytest

from kvpush.directory.admission import CallGate, StreamSlots, caller_of
from kvpush.directory.errors import ResourceExhausted
from kvpush.directory.state import Limits


def test_callers_are_principals_or_peer_hosts():
    """With identities a caller is its principal; without, its peer's host (any port)."""
    assert caller_of("engine/d1", "ipv4:127.0.0.1:5000") == "engine/d1"
    assert caller_of("anyone", "ipv4:127.0.0.1:5000") == caller_of("", "ipv4:127.0.0.1:6000") == "peer ipv4:127.0.0.1"
    assert caller_of("", "ipv6:[::1]:5000") == "peer ipv6:[::1]"


def test_stream_slots_keep_the_renewals_share_and_count_per_caller():
    """Of 8 slots, 2 are the renewals' (share 0.25); a caller holds at most 3 of each kind."""
    slots = StreamSlots(Limits(max_open_streams=8, renewal_reserved_share=0.25, max_streams_per_identity=3))
    for caller in ("a", "a", "a", "b", "b", "b"):
        slots.take(caller, renewal=False)
    with pytest.raises(ResourceExhausted, match="a has 3 open streams other than renewals") as refused:
        slots.take("a", renewal=False)
    assert refused.value.limit == "identity_streams"
    with pytest.raises(ResourceExhausted, match="6 streams other than renewals are open; they may use 6 of the 8"):
        slots.take("c", renewal=False)
    slots.take("a", renewal=True)
    slots.take("c", renewal=True)
    with pytest.raises(ResourceExhausted, match="8 streams are open; the cap is 8") as refused:
        slots.take("d", renewal=True)
    assert refused.value.limit == "open_streams"
    slots.give_back("a", renewal=False)
    slots.take("d", renewal=True)  # a renewal may use any free slot
    for caller, renewal in (("a", False), ("a", False), ("b", False), ("b", False), ("b", False), ("a", True),
                            ("c", True), ("d", True)):
        slots.give_back(caller, renewal)
    assert slots.open_count == 0 and not slots.renewals and not slots.others


def test_a_callers_calls_wait_for_a_slot_and_the_queue_and_bytes_are_bounded():
    """Two in flight, one waiting: the next is refused; bytes past the budget are refused; slots come back."""
    async def body():
        gate = CallGate(Limits(max_calls_in_flight_per_caller=2, max_queued_calls_per_caller=1,
                               max_bytes_in_flight_per_caller=100))
        release = asyncio.Event()
        order = []

        async def call(name: str, size: int):
            async with gate.slot("x") as charge:
                charge(size)
                order.append(name)
                await release.wait()

        first = [asyncio.create_task(call(n, 40)) for n in ("a", "b")]
        await asyncio.sleep(0)
        waiting = asyncio.create_task(call("c", 10))
        await asyncio.sleep(0)
        assert gate.in_flight("x") == 2 and order == ["a", "b"]
        with pytest.raises(ResourceExhausted, match="2 calls in flight and 1 waiting") as refused:
            async with gate.slot("x"):
                pass
        assert refused.value.limit == "caller_calls"
        async with gate.slot("y") as charge:  # another caller is not held up
            with pytest.raises(ResourceExhausted, match="would pass the limit of 100") as refused:
                charge(101)
            assert refused.value.limit == "caller_bytes"
        release.set()
        await asyncio.gather(*first, waiting)
        assert order == ["a", "b", "c"] and gate.in_flight("x") == 0 and not gate._callers

    asyncio.run(asyncio.wait_for(body(), 10))
