"""Peer announcements: a prefill worker's session hears of every decode worker it may be told to push to (when
the session opens, and when one registers later), so it loads the peer before any instruction needs it."""

from __future__ import annotations

from kvpush.directory.state import DirectoryState, Limits
from tests.fixtures.directory import DECODE, PREFILL, ManualClock, make_layout, register_request


def _state() -> DirectoryState:
    return DirectoryState(Limits(lease_ttl_s=10, transfer_ttl_s=60), ManualClock().clock())


def _announced(state: DirectoryState, engine_id: str, tp_rank: int, session: int) -> list[tuple[str, int, str]]:
    messages = state.drain_outbox(engine_id, tp_rank, session)
    assert all(m.WhichOneof("message") == "peer" for m in messages), messages
    return [(m.peer.decode_engine_id, m.peer.decode_tp_rank, m.peer.decode_agent_name) for m in messages]


def test_a_session_opens_with_every_decode_worker_registered_before_it():
    """The announcement carries what an instruction would: agent name, metadata and layout."""
    state = _state()
    state.register(register_request("d1", DECODE))
    state.register(register_request("d2", DECODE))
    prefill, _ = state.register(register_request("p1", PREFILL))
    session, effects = state.open_session("p1", 0, prefill.lease_id)
    assert effects.prefill_outboxes == {("p1", 0)}
    messages = state.drain_outbox("p1", 0, session)
    assert [m.peer.decode_agent_name for m in messages] == ["d1-agent-0", "d2-agent-0"]
    first = messages[0].peer
    assert first.decode_engine_id == "d1" and first.decode_agent_metadata == b"nixl-md-d1-0"
    assert first.decode_layout == make_layout()


def test_a_decode_worker_registered_later_is_announced_to_open_sessions_only():
    """An open session gets it at once (its outbox is named in the effects); a prefill worker without a session
    hears of it when its session opens, once."""
    state = _state()
    connected, _ = state.register(register_request("p1", PREFILL))
    waiting, _ = state.register(register_request("p2", PREFILL))
    session, _ = state.open_session("p1", 0, connected.lease_id)
    assert state.drain_outbox("p1", 0, session) == []
    _, effects = state.register(register_request("d1", DECODE))
    assert effects.prefill_outboxes == {("p1", 0)}
    assert _announced(state, "p1", 0, session) == [("d1", 0, "d1-agent-0")]
    assert list(state.engines.groups["p2"].workers[0].outbox) == []
    later, _ = state.open_session("p2", 0, waiting.lease_id)
    assert _announced(state, "p2", 0, later) == [("d1", 0, "d1-agent-0")]


def test_only_decode_workers_a_plan_could_pair_are_announced():
    """Same rank of an engine with the same TP size, layer count, dtype and compatibility hash; nothing else."""
    state = _state()
    ranks = [state.register(register_request("p1", PREFILL, rank, 2))[0] for rank in (0, 1)]
    sessions = [state.open_session("p1", rank, ranks[rank].lease_id)[0] for rank in (0, 1)]
    for rank in (0, 1):
        state.register(register_request("d-tp2", DECODE, rank, 2))
    state.register(register_request("d-tp1", DECODE))
    state.register(register_request("d-layers", DECODE, 0, 2, layout=make_layout(layer_count=8)))
    state.register(register_request("d-hash", DECODE, 0, 2, layout=make_layout(compatibility_hash="other")))
    state.register(register_request("d-dtype", DECODE, 0, 2, layout=make_layout(dtype="float16")))
    assert _announced(state, "p1", 0, sessions[0]) == [("d-tp2", 0, "d-tp2-agent-0")]
    assert _announced(state, "p1", 1, sessions[1]) == [("d-tp2", 1, "d-tp2-agent-1")]


def test_a_new_session_hears_every_peer_again_and_a_renewed_registration_nothing():
    """A reconnecting worker may have restarted (lost its peers): its new session is told again. The same agent
    registering again (a fresh lease) is no new peer."""
    state = _state()
    state.register(register_request("d1", DECODE))
    prefill, _ = state.register(register_request("p1", PREFILL))
    first, _ = state.open_session("p1", 0, prefill.lease_id)
    assert _announced(state, "p1", 0, first) == [("d1", 0, "d1-agent-0")]
    _, effects = state.register(register_request("d1", DECODE))
    assert not effects.prefill_outboxes and state.drain_outbox("p1", 0, first) == []
    state.close_session("p1", 0, first, "stream broke")
    second, _ = state.open_session("p1", 0, prefill.lease_id)
    assert _announced(state, "p1", 0, second) == [("d1", 0, "d1-agent-0")]


def test_a_decode_registration_mirrored_from_etcd_is_announced():
    """Directory replicas: a decode worker registered at another replica reaches this one's sessions too."""
    state = _state()
    state.mirror_register(register_request("p1", PREFILL), "key-p1")
    session, _ = state.open_session("p1", 0, "key-p1")
    effects = state.mirror_register(register_request("d1", DECODE), "key-d1")
    assert ("p1", 0) in effects.prefill_outboxes
    assert _announced(state, "p1", 0, session) == [("d1", 0, "d1-agent-0")]
    assert not state.mirror_register(register_request("d1", DECODE), "key-d1").prefill_outboxes  # etcd's echo

