"""PushTransport writing one transfer to two decode agents by head slice (TP sizes differ): a planned write is
reported once, after both routes' copies ended, with their bytes summed; the transfer is quiet once, after both
routes are; a failure on one route fails the planned write, and a cancel ends both routes."""

from __future__ import annotations

import pytest

from kvpush.api.outcome import PushOutcome
from kvpush.connector.worker.layout_wire import layout_to_proto
from kvpush.connector.worker.ports import HeadRoute
from kvpush.connector.worker.push_state import PlannedWrite
from kvpush.connector.worker.transport import PushTransport
from tests.integration.dataplane.kvbuffers import make_kv
from tests.unit.connector.inmemory_helpers import TransportOutcomes, new_fabric, started_agent

LAYERS, BLOCKS, BS, HEAD = 3, 8, 16, 16
BOUND_S = 5.0
HEAD_BLOCK_BYTES = BS * 2 * HEAD * 2


@pytest.fixture
def split():
    """A prefill agent holding 2 KV heads, two decode agents holding 1 each, a transport routing head r to r."""
    name, fab = new_fabric()
    _pl, p_arrays, p_caches = make_kv(LAYERS, BLOCKS, BS, 2, HEAD, seed=3)
    decodes = [make_kv(LAYERS, BLOCKS, BS, 1, HEAD, seed=None) for _ in range(2)]
    prefill = started_agent(name, p_caches, BS, 2, HEAD)
    agents = [started_agent(name, caches, BS, 1, HEAD) for _l, _a, caches in decodes]
    seen = TransportOutcomes(BOUND_S)
    transport = PushTransport(prefill, seen.on_done, seen.on_quiet)
    for agent in agents:
        transport.ensure_peer(agent.agent_name, agent.agent_metadata(), layout_to_proto(agent.layout))
    routes = [HeadRoute(agent.agent_name, rank, 0, 1, f"t1-{rank}".encode()) for rank, agent in enumerate(agents)]
    try:
        yield fab, transport, routes, seen, p_arrays, [a for _l, a, _c in decodes]
    finally:
        for agent in (prefill, *agents):
            agent.stop()


def test_each_planned_write_is_reported_once_with_both_routes_bytes(split):
    _fab, transport, routes, seen, p_arrays, d_arrays = split
    transport.set_routes("t1", routes)
    with pytest.raises(ValueError, match="already has head routes"):
        transport.set_routes("t1", routes)
    for layer in range(LAYERS):
        transport.submit("t1", "", PlannedWrite(layer, 0, 2 * BS, (1, 4), (6, 2), notify=layer == LAYERS - 1),
                         b"", None, "")
    assert seen.wait(lambda: seen.quiet)
    assert [(q.transfer_id, q.outcome) for q in seen.quiet] == [("t1", PushOutcome.DONE)]
    assert sorted(d.layer for d in seen.done) == list(range(LAYERS))
    assert all(d.transfer_id == "t1" and d.outcome is PushOutcome.DONE for d in seen.done)
    assert [d.bytes_written for d in seen.done] == [2 * 2 * HEAD_BLOCK_BYTES] * LAYERS  # 2 blocks x 2 heads
    for rank in range(2):
        for layer in range(LAYERS):
            assert (d_arrays[rank][layer][[6, 2], 0] == p_arrays[layer][[1, 4], rank]).all()


def test_a_failure_on_one_route_fails_the_planned_write_and_a_cancel_quiets_both_routes(split):
    fab, transport, routes, seen, _p, _d = split
    transport.set_routes("t2", routes)
    fab.fail_next_transfers(1)
    transport.submit("t2", "", PlannedWrite(0, 0, BS, (1,), (6,), notify=False), b"", None, "")
    assert seen.wait(lambda: seen.done)
    (done,) = seen.done
    assert done.transfer_id == "t2" and done.outcome is PushOutcome.FAILED and done.bytes_written == 0
    transport.cancel("t2")
    assert seen.wait(lambda: seen.quiet)
    assert [(q.transfer_id, q.outcome) for q in seen.quiet] == [("t2", PushOutcome.FAILED)]
