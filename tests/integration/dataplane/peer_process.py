"""A decode-side peer in its own process: its own TransferAgent over zeroed KV, driven through a pipe.

Commands (tuples over the pipe): ("dump", None) -> list of the per-layer arrays; ("notifs", (count,
timeout_s)) -> notifications received so far, once `count` arrived or the timeout passed;
("exit", None) -> stops the agent and returns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from kvpush.connector.worker.layout_wire import layout_to_proto
from kvpush.dataplane.config import NixlConfig
from tests.integration.dataplane.kvbuffers import make_kv


@dataclass(frozen=True)
class PeerSpec:
    """Shape of the peer's KV and its agent's name."""

    name: str
    layers: int
    blocks: int
    block_size: int
    heads: int
    head_size: int
    hint: str
    config: dict = field(default_factory=dict)
    listener: bool = True


def decode_peer_main(conn: Connection, spec: PeerSpec) -> None:
    """Run the peer until told to exit (spawned process entry point)."""
    from kvpush.dataplane import NotificationListener, TransferAgent

    layout, arrays, caches = make_kv(spec.layers, spec.blocks, spec.block_size, spec.heads, spec.head_size,
                                     spec.hint, seed=None)
    agent = TransferAgent(spec.name, NixlConfig(**spec.config))
    agent.register(caches, spec.block_size, spec.heads, spec.head_size, spec.hint)
    agent.start()
    notes: list[tuple[str, bytes]] = []
    if spec.listener:
        NotificationListener(agent, lambda name, msg: notes.append((name, msg)))
    conn.send((agent.agent_metadata(), layout_to_proto(layout).SerializeToString()))
    while True:
        cmd, arg = conn.recv()
        if cmd == "dump":
            conn.send([a.copy() for a in arrays])
        elif cmd == "notifs":
            count, timeout_s = arg
            deadline = time.monotonic() + timeout_s
            while len(notes) < count and time.monotonic() < deadline:
                time.sleep(0.005)
            conn.send(list(notes))
        elif cmd == "exit":
            agent.stop()
            conn.send("bye")
            return
