"""The connector's view of the NIXL data plane (`kvpush.dataplane`), one adapter per worker.

Life cycle: `create_transport(config, kv_caches, ...)` builds a `TransferAgent`, registers the KV
memory and starts the agent's I/O thread. A prefill worker wraps it in a `PushTransport` (peers added
from push instructions, writes submitted as `PlannedWrite`s, outcomes turned into `WriteDone` /
`WriterQuiet` callbacks on the I/O thread); a decode worker attaches a `NotificationListener`.
Everything here returns at once: NIXL calls happen on the agent's one thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from kvpush.connector.config import ConnectorConfig
from kvpush.connector.worker.layout_wire import layout_from_proto
from kvpush.connector.worker.ports import PostGuard, ReadyEvent
from kvpush.connector.worker.push_machine import WriteDone, WriterQuiet
from kvpush.connector.worker.push_state import PlannedWrite
from kvpush.dataplane import NixlConfig
from kvpush.observability import get_logger
from kvpush.v1 import types_pb2 as tpb

if TYPE_CHECKING:
    import torch

    from kvpush.dataplane.agent import TransferAgent
    from kvpush.dataplane.writer import WriteOutcome

_log = get_logger("connector.worker.transport")


def nixl_config_from(config: ConnectorConfig) -> NixlConfig:
    """The data-plane settings the connector config asks for.

    A write may wait for its layer's ready event as long as the prefill side holds the blocks (push_timeout_s);
    once posted it ends within max_write_s (the block-lifetime fence relies on it: docs/connector.md).
    """
    return NixlConfig(backends=config.nixl_backends, enable_prog_thread=config.nixl_enable_prog_thread,
                      num_threads=config.nixl_num_threads, poll_max_s=config.nixl_poll_max_s,
                      notif_poll_s=config.nixl_notif_poll_s, transfer_timeout_s=config.max_write_s,
                      post_timeout_s=config.push_timeout_s, fault_hold_posted_s=config.fault_hold_posted_write_s,
                      fault_hold_after_writes=config.fault_hold_after_writes,
                      check_in_post_order=config.nixl_check_in_post_order,
                      io_trace_path=config.nixl_io_trace_path).validate()


def create_agent(config: ConnectorConfig, kv_caches: dict[str, torch.Tensor], block_size_tokens: int,
                 num_kv_heads: int, head_size: int, agent_name: str) -> TransferAgent:
    """Build the worker's TransferAgent, register its KV memory and start its I/O thread."""
    from kvpush.dataplane.agent import TransferAgent

    agent = TransferAgent(agent_name, nixl_config_from(config))
    agent.register(kv_caches, block_size_tokens, num_kv_heads, head_size)
    agent.start()
    return agent


class PushTransport:
    """Prefill side: peers, writes and cancellations on the data plane (see the module docstring)."""

    def __init__(self, agent: TransferAgent, on_write_done: Callable[[WriteDone], None],
                 on_writer_quiet: Callable[[WriterQuiet], None]) -> None:
        from kvpush.dataplane.writer import PushWriter

        self._agent = agent
        self._on_write_done = on_write_done
        self._on_writer_quiet = on_writer_quiet
        self._writer = PushWriter(agent, on_request_done=self._request_done, on_transfer_done=self._transfer_done)

    def has_peer(self, agent_name: str) -> bool:
        """True while the data plane holds the decode worker's agent (loaded or loading, not leaving)."""
        try:
            self._agent.peer_layout(agent_name)
        except KeyError:
            return False
        return True

    def ensure_peer(self, agent_name: str, metadata: bytes, layout_proto: tpb.KVLayout | None) -> None:
        """Load a decode worker's agent once (queued on the I/O thread ahead of any write to it); a known agent
        (loaded or loading) is skipped, and a load that fails is logged."""
        if self.has_peer(agent_name):
            return
        if not metadata or layout_proto is None:
            raise ValueError(f"decode agent {agent_name!r} is unknown here and the instruction carries no metadata")
        loading = self._agent.add_peer(agent_name, bytes(metadata), layout_from_proto(layout_proto))

        def loaded(future: Future[str]) -> None:
            error = None if future.cancelled() else future.exception()
            if error is not None:
                _log.warning("decode peer not loaded", peer=agent_name, error=repr(error))

        loading.add_done_callback(loaded)

    def peer_block_size_tokens(self, agent_name: str) -> int:
        """The block size of a decode worker's layout (its agent loaded or loading); ValueError when unknown."""
        try:
            return self._agent.peer_layout(agent_name).block_size_tokens
        except KeyError:
            raise ValueError(f"decode agent {agent_name!r} is unknown here") from None

    def submit(self, transfer_id: str, peer_agent: str, write: PlannedWrite, notification: bytes,
               ready_event: ReadyEvent | None, traceparent: str, post_guard: PostGuard | None = None) -> None:
        """Queue one planned write; raises (nothing queued) when the data plane refuses it.

        post_guard (I/O thread, at post time): None to post, else why the write may no longer be posted.
        """
        from kvpush.dataplane.writer import WriteRequest

        self._writer.submit(WriteRequest(
            transfer_id=transfer_id, peer_agent=peer_agent, layers=(write.layer,), src_block_ids=write.src_block_ids,
            dst_block_ids=write.dst_block_ids, token_start=write.token_start, token_end=write.token_end,
            notify=notification if write.notify else None, ready_event=ready_event, traceparent=traceparent,
            post_guard=post_guard))

    def when_computed(self, event: ReadyEvent, callback: Callable[[float], None]) -> None:
        """Call `callback(unix time)` from the I/O thread once the GPU passed `event` (see PushWriter.when_complete)."""
        self._writer.when_complete(event, callback)

    def cancel(self, transfer_id: str) -> None:
        """Drop the transfer's queued writes; WriterQuiet follows once none of its handles is in flight."""
        future = self._writer.cancel(transfer_id)

        def done(f: Future[WriteOutcome]) -> None:
            outcome = f.result()
            if outcome.write_count == 0:  # the writer never had it: no on_transfer_done will come
                self._on_writer_quiet(WriterQuiet(transfer_id, outcome.outcome, outcome.error or "cancelled"))

        future.add_done_callback(done)

    def _request_done(self, outcome: WriteOutcome) -> None:
        now = time.time()
        self._on_write_done(WriteDone(
            transfer_id=outcome.transfer_id, outcome=outcome.outcome, error=outcome.error or "",
            layer=outcome.layers[0] if outcome.layers else -1,
            start_time=now - outcome.transfer_seconds if outcome.ok else None, end_time=now,
            post_duration_s=outcome.post_seconds, descriptor_count=outcome.descriptor_count,
            bytes_written=outcome.bytes))

    def _transfer_done(self, outcome: WriteOutcome) -> None:
        self._on_writer_quiet(WriterQuiet(outcome.transfer_id, outcome.outcome, outcome.error or ""))
