"""The connector's view of the NIXL data plane (`kvpush.dataplane`), one adapter per worker.

Life cycle: `create_transport(config, kv_caches, ...)` builds a `TransferAgent`, registers the KV
memory and starts the agent's I/O thread. A prefill worker wraps it in a `PushTransport` (peers added
from push instructions, writes submitted as `PlannedWrite`s, outcomes turned into `WriteDone` /
`WriterQuiet` callbacks on the I/O thread); a decode worker attaches a `NotificationListener`.
Everything here returns at once: NIXL calls happen on the agent's one thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpush.connector.config import ConnectorConfig
from kvpush.connector.worker.layout_wire import layout_from_proto
from kvpush.connector.worker.ports import HeadRoute, PostGuard, ReadyEvent
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
                      fault_hold_from_token=config.fault_hold_from_token,
                      check_in_post_order=config.nixl_check_in_post_order,
                      io_trace_path=config.nixl_io_trace_path).validate()


def create_agent(config: ConnectorConfig, kv_caches: dict[str, torch.Tensor], block_size_tokens: int,
                 num_kv_heads: int, head_size: int, agent_name: str,
                 state_groups: dict[int, tuple[list[str], int]] | None = None) -> TransferAgent:
    """Build the worker's TransferAgent, register its KV memory (a hybrid model's state layers too: `state_groups`,
    by group index, their layer names and tokens per block) and start its I/O thread."""
    from kvpush.dataplane.agent import TransferAgent

    agent = TransferAgent(agent_name, nixl_config_from(config))
    agent.register(kv_caches, block_size_tokens, num_kv_heads, head_size, state_groups=state_groups)
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
        # Transfers written by head slice (TP sizes differ), by transfer id; and their writer-side ids.
        self._fans: dict[str, _Fan] = {}
        self._fan_of: dict[str, tuple[_Fan, int]] = {}
        self._fans_lock = threading.Lock()

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

    def set_routes(self, transfer_id: str, routes: Sequence[HeadRoute]) -> None:
        """Write `transfer_id` by head slice to these decode agents (TP sizes differ); before its first write.

        Each route is a transfer of its own in the data plane (its own peer, head slice and notification); a
        planned write is reported once every route's copy of it ended, and the transfer is quiet once every
        route's is.
        """
        if not routes:
            raise ValueError(f"transfer {transfer_id}: no head routes")
        ids = [transfer_id] if len(routes) == 1 else [f"{transfer_id}{_ROUTE_MARK}{k}" for k in range(len(routes))]
        fan = _Fan(transfer_id, tuple(routes), tuple(ids))
        with self._fans_lock:
            if transfer_id in self._fans:
                raise ValueError(f"transfer {transfer_id} already has head routes")
            self._fans[transfer_id] = fan
            for k, writer_id in enumerate(ids):
                self._fan_of[writer_id] = (fan, k)

    def submit(self, transfer_id: str, peer_agent: str, write: PlannedWrite, notification: bytes,
               ready_event: ReadyEvent | None, traceparent: str, post_guard: PostGuard | None = None) -> None:
        """Queue one planned write; raises (nothing queued) when the data plane refuses it.

        post_guard (I/O thread, at post time): None to post, else why the write may no longer be posted.
        """
        from kvpush.dataplane.layout import HeadSlice
        from kvpush.dataplane.writer import WriteRequest

        with self._fans_lock:
            fan = self._fans.get(transfer_id)
        if fan is not None and write.state:
            raise ValueError("state layers are pushed only between engines of one TP size (no head routes)")
        if fan is not None:
            requests = [WriteRequest(
                transfer_id=writer_id, peer_agent=route.agent_name, layers=(write.layer,),
                src_block_ids=write.src_block_ids, dst_block_ids=write.dst_block_ids, token_start=write.token_start,
                token_end=write.token_end, notify=route.notification if write.notify else None,
                ready_event=ready_event, traceparent=traceparent, post_guard=post_guard,
                head_slice=HeadSlice(route.source_head_start, route.destination_head_start, route.head_count))
                for route, writer_id in zip(fan.routes, fan.writer_ids, strict=True)]
            with self._fans_lock:
                fan.pending.setdefault(write.layer, []).append(_FanWrite(len(fan.routes)))
            try:
                for request in requests:
                    self._writer.submit(request)
            except Exception:
                # Routes already queued report their outcomes; the caller stops the transfer, which cancels them.
                with self._fans_lock:
                    fan.pending[write.layer][-1].refused = True
                raise
            return
        self._writer.submit(WriteRequest(
            transfer_id=transfer_id, peer_agent=peer_agent, layers=(write.layer,), src_block_ids=write.src_block_ids,
            dst_block_ids=write.dst_block_ids, token_start=write.token_start, token_end=write.token_end,
            notify=notification if write.notify else None, ready_event=ready_event, traceparent=traceparent,
            post_guard=post_guard, state=write.state))

    def when_computed(self, event: ReadyEvent, callback: Callable[[float], None]) -> None:
        """Call `callback(unix time)` from the I/O thread once the GPU passed `event` (see PushWriter.when_complete)."""
        self._writer.when_complete(event, callback)

    def cancel(self, transfer_id: str) -> None:
        """Drop the transfer's queued writes; WriterQuiet follows once none of its handles is in flight."""
        with self._fans_lock:
            fan = self._fans.get(transfer_id)
        if fan is not None:
            for writer_id in fan.writer_ids:
                self._cancel_route(fan, writer_id)
            return
        future = self._writer.cancel(transfer_id)

        def done(f: Future[WriteOutcome]) -> None:
            outcome = f.result()
            if outcome.write_count == 0:  # the writer never had it: no on_transfer_done will come
                self._on_writer_quiet(WriterQuiet(transfer_id, outcome.outcome, outcome.error or "cancelled"))

        future.add_done_callback(done)

    def _cancel_route(self, fan: _Fan, writer_id: str) -> None:
        future = self._writer.cancel(writer_id)

        def done(f: Future[WriteOutcome]) -> None:
            outcome = f.result()
            if outcome.write_count == 0:  # the writer never had this route: no on_transfer_done will come for it
                self._transfer_done(outcome)

        future.add_done_callback(done)

    def _request_done(self, outcome: WriteOutcome) -> None:
        with self._fans_lock:
            routed = self._fan_of.get(outcome.transfer_id)
            merged = self._merge_write(routed, outcome) if routed is not None else outcome
        if merged is None:
            return
        self._report_write(merged)

    def _merge_write(self, routed: tuple[_Fan, int], outcome: WriteOutcome) -> WriteOutcome | None:
        """One route's copy of a planned write ended: the planned write's outcome once every route's did."""
        from dataclasses import replace

        fan, k = routed
        layer = outcome.layers[0] if outcome.layers else -1
        writes = fan.pending.get(layer, [])
        entry = next((w for w in writes if k not in w.routes_done), None)
        if entry is None:
            return None  # a route's copy of a write refused before it was queued everywhere: already counted
        entry.routes_done.add(k)
        entry.bytes += outcome.bytes
        entry.descriptors += outcome.descriptor_count
        entry.post_seconds += outcome.post_seconds
        entry.transfer_seconds = max(entry.transfer_seconds, outcome.transfer_seconds)
        if not outcome.ok and entry.failed is None:
            entry.failed = outcome
        if len(entry.routes_done) < entry.route_count or entry.refused:
            return None
        writes.remove(entry)
        base = entry.failed or outcome
        return replace(base, transfer_id=fan.transfer_id, bytes=entry.bytes if entry.failed is None else 0,
                       descriptor_count=entry.descriptors, post_seconds=entry.post_seconds,
                       transfer_seconds=entry.transfer_seconds)

    def _report_write(self, outcome: WriteOutcome) -> None:
        now = time.time()
        self._on_write_done(WriteDone(
            transfer_id=outcome.transfer_id, outcome=outcome.outcome, error=outcome.error or "",
            layer=outcome.layers[0] if outcome.layers else -1,
            start_time=now - outcome.transfer_seconds if outcome.ok else None, end_time=now,
            post_duration_s=outcome.post_seconds, descriptor_count=outcome.descriptor_count,
            bytes_written=outcome.bytes))

    def _transfer_done(self, outcome: WriteOutcome) -> None:
        with self._fans_lock:
            routed = self._fan_of.get(outcome.transfer_id)
            if routed is not None:
                fan, k = routed
                if k in fan.quiet:
                    return
                fan.quiet[k] = outcome
                if len(fan.quiet) < len(fan.routes):
                    return
                del self._fans[fan.transfer_id]
                for writer_id in fan.writer_ids:
                    self._fan_of.pop(writer_id, None)
                from kvpush.dataplane.writer import WriteOutcome

                worst = next((o for o in fan.quiet.values() if not o.ok), outcome)
                outcome = WriteOutcome(fan.transfer_id, worst.outcome, sum(o.bytes for o in fan.quiet.values()),
                                       0, 0.0, 0.0, worst.error)
        self._on_writer_quiet(WriterQuiet(outcome.transfer_id, outcome.outcome, outcome.error or ""))


# Joins a transfer id and a route number into the data plane's id for that route (never in a transfer id:
# the directory's ids are printable).
_ROUTE_MARK = "\x1f"


@dataclass
class _FanWrite:
    """One planned write of a head-routed transfer, until every route's copy of it ended."""

    route_count: int
    routes_done: set[int] = field(default_factory=set)
    bytes: int = 0
    descriptors: int = 0
    post_seconds: float = 0.0
    transfer_seconds: float = 0.0
    failed: WriteOutcome | None = None
    refused: bool = False


@dataclass
class _Fan:
    """A transfer written to several decode agents by head slice."""

    transfer_id: str
    routes: tuple[HeadRoute, ...]
    writer_ids: tuple[str, ...]
    pending: dict[int, list[_FanWrite]] = field(default_factory=dict)  # layer -> its planned writes, in order
    quiet: dict[int, WriteOutcome] = field(default_factory=dict)  # route -> how its writer transfer ended
