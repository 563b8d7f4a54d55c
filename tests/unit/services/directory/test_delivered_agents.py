"""Which decode agents' metadata a prefill stream's instructions carry: the first instruction to an agent carries
it, later ones do not, until the worker reports the agent dropped (or the agent's metadata changed)."""

from __future__ import annotations

from kvpush.directory.servicer import DeliveredAgents
from kvpush.v1 import directory_pb2 as dpb
from tests.fixtures.directory import make_layout


def _instruction(agent: str, metadata: bytes) -> dpb.PushInstruction:
    return dpb.PushInstruction(transfer_id="t", decode_engine_id="d1", decode_agent_name=agent,
                               decode_agent_metadata=metadata, decode_layout=make_layout(), decode_block_ids=[1],
                               prompt_token_count=16, notification=b"t")


def _sent(agents: DeliveredAgents, agent: str, metadata: bytes) -> tuple[bytes, bool]:
    """What the instruction carries once the stream wrote it: (metadata, has a layout)."""
    instruction = _instruction(agent, metadata)
    agents.strip_delivered(instruction)
    return instruction.decode_agent_metadata, instruction.HasField("decode_layout")


def test_a_dropped_agent_gets_its_metadata_with_the_next_instruction():
    agents = DeliveredAgents()
    assert _sent(agents, "d1-agent-0", b"md-1") == (b"md-1", True)
    assert _sent(agents, "d1-agent-0", b"md-1") == (b"", False)
    agents.forget("d1-agent-0")
    assert _sent(agents, "d1-agent-0", b"md-1") == (b"md-1", True)
    assert _sent(agents, "d1-agent-0", b"md-1") == (b"", False)


def test_forgetting_one_agent_leaves_the_others_delivered():
    agents = DeliveredAgents()
    for agent in ("d1-agent-0", "d2-agent-0"):
        _sent(agents, agent, b"md-" + agent.encode())
    agents.forget("d1-agent-0")
    agents.forget("never-sent")
    assert _sent(agents, "d2-agent-0", b"md-d2-agent-0") == (b"", False)
    assert _sent(agents, "d1-agent-0", b"md-d1-agent-0") == (b"md-d1-agent-0", True)


def test_new_metadata_under_a_delivered_name_is_sent_and_forget_drops_every_version():
    agents = DeliveredAgents()
    _sent(agents, "d1-agent-0", b"before-restart")
    assert _sent(agents, "d1-agent-0", b"after-restart") == (b"after-restart", True)
    agents.forget("d1-agent-0")
    assert _sent(agents, "d1-agent-0", b"before-restart") == (b"before-restart", True)
    assert _sent(agents, "d1-agent-0", b"after-restart") == (b"after-restart", True)
