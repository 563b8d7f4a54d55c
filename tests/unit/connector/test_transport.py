"""PushTransport on the in-memory NIXL: peers from instructions, PlannedWrites in, WriteDone / WriterQuiet out."""

from __future__ import annotations

import pytest

from kvpush.api.outcome import PushOutcome
from kvpush.connector.worker.layout_wire import layout_to_proto
from kvpush.connector.worker.push_state import PlannedWrite
from kvpush.connector.worker.transport import PushTransport
from tests.integration.dataplane.kvbuffers import block_bytes, make_kv
from tests.unit.connector.inmemory_helpers import TransportOutcomes, new_fabric, started_agent

LAYERS, BLOCKS, BS, HEADS, HEAD = 2, 8, 16, 2, 16
BOUND_S = 5.0


def test_writes_land_and_each_reports_its_layer_then_the_transfer_is_quiet():
    """ensure_peer loads decode from the instruction's metadata once; each PlannedWrite becomes one WriteDone
    (its layer, bytes, a start time before its end); the closing write's transfer reports WriterQuiet DONE."""
    name, _ = new_fabric()
    p_layout, p_arrays, p_caches = make_kv(LAYERS, BLOCKS, BS, HEADS, HEAD, seed=3)
    d_layout, d_arrays, d_caches = make_kv(LAYERS, BLOCKS, BS, HEADS, HEAD, seed=None)
    prefill = started_agent(name, p_caches, BS, HEADS, HEAD)
    decode = started_agent(name, d_caches, BS, HEADS, HEAD)
    seen = TransportOutcomes(BOUND_S)
    transport = PushTransport(prefill, seen.on_done, seen.on_quiet)
    try:
        with pytest.raises(ValueError, match="no metadata"):
            transport.ensure_peer(decode.agent_name, b"", None)
        transport.ensure_peer(decode.agent_name, decode.agent_metadata(), layout_to_proto(decode.layout))
        transport.ensure_peer(decode.agent_name, b"", None)  # known now: nothing to load
        for layer in range(LAYERS):
            write = PlannedWrite(layer, 0, 2 * BS, (1, 4), (6, 2), notify=layer == LAYERS - 1)
            transport.submit("t1", decode.agent_name, write, b"t1", None, "")
        assert seen.wait(lambda: seen.quiet)
        assert sorted(d.layer for d in seen.done) == list(range(LAYERS))
        assert all(d.outcome is PushOutcome.DONE and d.start_time <= d.end_time for d in seen.done)
        assert sum(d.bytes_written for d in seen.done) == LAYERS * 2 * p_layout.block_bytes_per_layer
        assert [(q.transfer_id, q.outcome) for q in seen.quiet] == [("t1", PushOutcome.DONE)]
        for layer in range(LAYERS):
            assert block_bytes(d_layout, d_arrays, layer, 6) == block_bytes(p_layout, p_arrays, layer, 1)
    finally:
        prefill.stop()
        decode.stop()


def test_cancelling_a_transfer_the_data_plane_never_had_is_quiet_at_once():
    """No write of it was ever submitted: cancel still answers WriterQuiet (CANCELLED), so the worker can
    settle the push without waiting for a transfer outcome that will never come."""
    name, _ = new_fabric()
    _, _, p_caches = make_kv(LAYERS, BLOCKS, BS, HEADS, HEAD, seed=3)
    prefill = started_agent(name, p_caches, BS, HEADS, HEAD)
    seen = TransportOutcomes(BOUND_S)
    transport = PushTransport(prefill, seen.on_done, seen.on_quiet)
    try:
        transport.cancel("never-seen")
        assert seen.wait(lambda: seen.quiet)
        assert [(q.transfer_id, q.outcome) for q in seen.quiet] == [("never-seen", PushOutcome.CANCELLED)]
        assert seen.done == []
    finally:
        prefill.stop()
