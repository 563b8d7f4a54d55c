"""Shared helpers for the unit tests on the in-memory NIXL stand-in (src/kvpush/dataplane/inmemory.py)."""

from __future__ import annotations

import itertools
import threading
import uuid

from kvpush.connector.config import ConnectorConfig
from kvpush.dataplane.agent import TransferAgent
from kvpush.dataplane.config import BACKEND_INMEMORY, NixlConfig
from kvpush.dataplane.inmemory import InMemoryFabric, fabric

_names = itertools.count()


def new_fabric() -> tuple[str, InMemoryFabric]:
    """A fabric of its own for one test (name, fabric)."""
    name = f"test-{uuid.uuid4().hex[:8]}"
    return name, fabric(name)


def nixl_config(fabric_name: str, **kw) -> NixlConfig:
    """NixlConfig for an in-memory agent on `fabric_name` (short bounds: tests wait on them)."""
    values = {"post_timeout_s": 2.0, "transfer_timeout_s": 2.0, **kw}
    return NixlConfig(backends=(BACKEND_INMEMORY,), backend_params={BACKEND_INMEMORY: {"fabric": fabric_name}},
                      **values).validate()


def started_agent(fabric_name: str, caches, block_size: int, heads: int, head_size: int, hint: str = "cpu_attn",
                  **kw) -> TransferAgent:
    """A started TransferAgent on the fabric with `caches` registered."""
    agent = TransferAgent(f"agent-{next(_names)}", nixl_config(fabric_name, **kw))
    agent.register(caches, block_size, heads, head_size, hint)
    return agent.start()


def connector_config(address: str, role: str, engine_id: str, **extra) -> ConnectorConfig:
    """A connector config for an engine of `role` talking to the directory at `address` (5 s bounds)."""
    return ConnectorConfig.from_extra_config({"directory_address": address, "push_timeout_s": 5.0,
                                              "transfer_timeout_s": 5.0, **extra}, role=role, engine_id=engine_id)


class TransportOutcomes:
    """A PushTransport's callbacks (write done, writer quiet) recorded, with a bounded wait on them."""

    def __init__(self, bound_s: float = 5.0) -> None:
        self.done: list = []
        self.quiet: list = []
        self.cv = threading.Condition()
        self._bound_s = bound_s

    def on_done(self, done) -> None:
        with self.cv:
            self.done.append(done)
            self.cv.notify_all()

    def on_quiet(self, quiet) -> None:
        with self.cv:
            self.quiet.append(quiet)
            self.cv.notify_all()

    def wait(self, predicate) -> bool:
        with self.cv:
            return self.cv.wait_for(predicate, self._bound_s)
