"""TransferAgent: one per worker process; owns the NIXL agent and the one thread that calls it.

Life cycle:
1. `TransferAgent(name, config)` creates the NIXL agent (no thread yet).
2. `register(kv_caches, ...)` (or `register_layout`) describes and registers the KV memory; this and
   `agent_metadata()` may run on the caller's thread before `start()`.
3. `start()` launches the I/O thread ("kvpush-nixl-io"). From then on every NIXL call runs on it:
   public methods enqueue a command and return a Future. NIXL's thread sync is NONE and the progress
   thread is off by default, so this one thread is also what drives UCX progress: it polls
   `check_xfer_state` only while handles are in flight (sleeping poll_min_s..poll_max_s between polls),
   polls notifications every `notif_poll_s`, and otherwise blocks on its command queue.
4. `add_peer(name, metadata, layout)` loads a remote agent and prepares its descriptor tables once;
   `remove_peer(name)` fails that peer's writes, waits for its handles, then drops its tables and
   metadata. A `PushWriter` (prefill) and a `NotificationListener` (decode) attach to the agent and
   run on the same thread.
5. `stop()` fails what is queued, waits (bounded) for what is in flight, releases everything.

A decode worker that only receives pushes just registers, starts and publishes its metadata: the
writes are one-sided; its thread answers UCX wire-up while it polls notifications.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Protocol, TypeVar

import numpy as np

from kvpush.dataplane.config import NixlConfig, create_nixl_agent
from kvpush.dataplane.describe import KVTensor, describe_hybrid_caches, describe_kv_caches
from kvpush.dataplane.io_trace import IoLoopTrace
from kvpush.dataplane.layout import MEMORY_VRAM, KVLayoutSpec, LayoutError, check_head_compatible
from kvpush.dataplane.nixl_api import NixlAgentApi, RegisteredMemory
from kvpush.dataplane.peers import DescriptorTables, Peer
from kvpush.dataplane.plan import TABLE_CHUNK, granule_tokens
from kvpush.observability import get_logger

_log = get_logger("kvpush.dataplane.agent")
_NOTIF_BUFFER_MAX = 10000
_T = TypeVar("_T")


class LoopParticipant(Protocol):
    """Something the I/O thread drives on every iteration (the writer)."""

    def poll(self, now: float) -> bool:
        """Do pending work; return True while it has handles in flight or writes waiting to post."""

    def on_peer_leaving(self, peer: str, reason: str) -> None:
        """Fail everything queued for `peer`; in-flight handles are left to finish or time out."""

    def peer_in_flight(self, peer: str) -> int:
        """Handles still in flight towards `peer`."""

    def shutdown(self, reason: str) -> None:
        """Fail everything queued; called once on stop."""


class _QueuedFuture(Protocol):
    """A queued call's Future as the I/O thread fails it when the agent stops (its result type is the call's)."""

    def set_running_or_notify_cancel(self) -> bool:
        """False when the caller cancelled it."""
        ...

    def set_exception(self, exception: BaseException | None) -> None:
        """Resolve it with `exception`."""
        ...


def _resolve(future: Future[_T], fn: Callable[[], _T]) -> None:
    """Run a queued call on the I/O thread into its Future (skipped when the caller cancelled it)."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except BaseException as exc:
        future.set_exception(exc)


class TransferAgent:
    """A worker's NIXL agent, its registered KV, its peers and its I/O thread."""

    def __init__(self, name: str | None = None, config: NixlConfig | None = None) -> None:
        """Create the NIXL agent `name` (a unique default) with `config` (NixlConfig() by default)."""
        self._config = (config or NixlConfig()).validate()
        self._name = name or f"kvpush-{uuid.uuid4().hex[:16]}"
        self._nixl = create_nixl_agent(self._name, self._config)
        self._layout: KVLayoutSpec | None = None
        self._tensors: list[KVTensor] = []
        self._reg_descs: RegisteredMemory | None = None
        self._local_tables: DescriptorTables | None = None
        self._peers: dict[str, Peer] = {}  # I/O thread only
        self._peer_layouts: dict[str, KVLayoutSpec] = {}  # guarded by _lock, read by submitters
        self._lock = threading.Lock()
        # SimpleQueue: a C queue, a few times cheaper per put than queue.Queue (the prefill hooks post through it).
        # (what to run, its Future): a call runs into its Future (`_resolve`); a None Future is a post (fire and
        # forget; the loop logs its failure).
        self._commands: queue.SimpleQueue[tuple[Callable[[], None], _QueuedFuture | None]] = queue.SimpleQueue()
        self._participants: list[LoopParticipant] = []
        self._notif_callbacks: list[Callable[[str, bytes], None]] = []
        self._notif_buffer: deque[tuple[str, bytes]] = deque(maxlen=_NOTIF_BUFFER_MAX)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._closed = False
        self._log = _log.bind(agent=self._name)
        # I/O thread only: per-iteration timings for profiling, when configured (io_trace.py).
        self.io_trace = IoLoopTrace(self._config.io_trace_path, self._name) if self._config.io_trace_path else None

    # ---- identity and registration -------------------------------------------------------------
    @property
    def agent_name(self) -> str:
        """This agent's NIXL name (what peers pass as `peer_agent`)."""
        return self._name

    @property
    def config(self) -> NixlConfig:
        """The settings this agent was built with."""
        return self._config

    @property
    def layout(self) -> KVLayoutSpec:
        """The registered KV layout; LayoutError before `register`."""
        if self._layout is None:
            raise LayoutError("no KV memory registered yet")
        return self._layout

    @property
    def nixl(self) -> NixlAgentApi:
        """The underlying nixl_agent; only for calls made on the I/O thread (or before start)."""
        return self._nixl

    def register(
        self,
        kv_caches: Mapping[str, KVTensor | Sequence[KVTensor]],
        block_size_tokens: int,
        num_kv_heads: int,
        head_size: int,
        layout_hint: str | None = None,
        state_groups: Mapping[int, tuple[Sequence[str], int]] | None = None,
    ) -> KVLayoutSpec:
        """Describe vLLM's per-layer KV tensors (see `describe_kv_caches`; with `state_groups`, a hybrid model's
        attention and state layers, `describe_hybrid_caches`) and register their memory (each byte once)."""
        if state_groups:
            layout = describe_hybrid_caches(kv_caches, block_size_tokens, num_kv_heads, head_size, state_groups,
                                            layout_hint)
            # Keep the memory alive while registered.
            self._tensors = [tensor for cache in kv_caches.values()
                             for tensor in (cache if isinstance(cache, Sequence) else (cache,))]
            return self.register_layout(layout)
        tensors_only = {name: cache for name, cache in kv_caches.items() if not isinstance(cache, Sequence)}
        if len(tensors_only) != len(kv_caches):
            lists = [name for name in kv_caches if name not in tensors_only]
            raise LayoutError(f"layers {lists[:4]} hold lists of state tensors: a hybrid model's state layers are "
                              "registered with their KV-cache groups (state_groups)")
        layout, tensors = describe_kv_caches(tensors_only, block_size_tokens, num_kv_heads, head_size, layout_hint)
        self._tensors = tensors  # keep the memory alive while registered
        return self.register_layout(layout)

    def register_layout(self, layout: KVLayoutSpec) -> KVLayoutSpec:
        """Register the memory `layout` describes (its caller keeps that memory alive)."""
        layout.validate()
        if self._layout is not None:
            raise LayoutError("KV memory is already registered on this agent")

        def do() -> KVLayoutSpec:
            regions = np.array(
                [(addr, length, layout.device_id) for addr, length in layout.memory_regions()], dtype=np.uint64
            )
            self._reg_descs = self._nixl.register_memory(regions, layout.memory_kind)
            self._layout = layout
            self._local_tables = DescriptorTables(self._nixl, "NIXL_INIT_AGENT", layout)
            return layout

        result = self._call(do).result(timeout=60)
        self._log.info(
            "kv_registered", layout=layout.layout_name, layers=layout.layer_count, blocks=layout.block_count,
            block_size=layout.block_size_tokens, memory=layout.memory_kind, bytes=layout.total_bytes,
        )
        return result

    def agent_metadata(self) -> bytes:
        """NIXL metadata a peer loads with `add_peer` (call after `register`)."""
        return self._call(self._nixl.get_agent_metadata).result(timeout=30)

    # ---- thread ---------------------------------------------------------------------------------
    def start(self) -> TransferAgent:
        """Start the I/O thread; from now on every NIXL call runs on it."""
        if self._thread is not None:
            raise RuntimeError("TransferAgent already started")
        self._thread = threading.Thread(target=self._loop, name="kvpush-nixl-io", daemon=True)
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        """True while the I/O thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def on_io_thread(self) -> bool:
        """True when called from the I/O thread."""
        return self._thread is not None and threading.current_thread() is self._thread

    def _call(self, fn: Callable[[], _T]) -> Future[_T]:
        """Run `fn` on the I/O thread (or inline before `start`); return its Future."""
        future: Future[_T] = Future()
        if self._closed:
            future.set_exception(RuntimeError("TransferAgent is stopped"))
            return future
        if self._thread is None or self.on_io_thread():
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)
            return future
        self._commands.put((partial(_resolve, future, fn), future))
        return future

    def call_soon(self, fn: Callable[[], _T]) -> Future[_T]:
        """Queue `fn` to run on the I/O thread (for components built on this agent)."""
        return self._call(fn)

    def post(self, fn: Callable[[], None]) -> None:
        """Queue `fn` to run on the I/O thread, in posting order, with no result (inline when called from it).

        The hooks' path: no Future is made or resolved (a third of a post's cost), and an `fn` that raises is
        logged here, since nobody waits on it. Dropped, with a log line, once the agent stopped.
        """
        if self._closed:
            self._log.warning("post_after_stop", fn=repr(fn))
            return
        if self._thread is None or self.on_io_thread():
            self._run_post(fn)
            return
        self._commands.put((fn, None))

    def attach(self, participant: LoopParticipant) -> None:
        """Have the I/O thread drive `participant` on every iteration."""
        self._participants.append(participant)

    def add_notification_callback(self, callback: Callable[[str, bytes], None]) -> None:
        """Deliver every notification (agent name, message) to `callback` on the I/O thread.

        Notifications that arrived before the first callback was added are delivered now.
        """

        def do() -> None:
            self._notif_callbacks.append(callback)
            while self._notif_buffer:
                callback(*self._notif_buffer.popleft())

        self._call(do)

    def remove_notification_callback(self, callback: Callable[[str, bytes], None]) -> None:
        """Stop delivering notifications to `callback` (no-op when it is not registered, or the agent stopped)."""

        def do() -> None:
            if callback in self._notif_callbacks:
                self._notif_callbacks.remove(callback)

        self._call(do)

    def _bind_cuda_device(self) -> None:
        """Make the registered GPU current on the I/O thread (CUDA's current device is per thread).

        Only when torch is already loaded (a GPU engine); this package never imports it.
        """
        torch = sys.modules.get("torch")
        if self._layout is None or self._layout.memory_kind != MEMORY_VRAM or torch is None:
            return
        try:
            torch.cuda.set_device(self._layout.device_id)
        except Exception as exc:
            self._log.warning("cuda_set_device_failed", device=self._layout.device_id, error=repr(exc))

    def _loop(self) -> None:
        self._bind_cuda_device()
        delay = self._config.poll_min_s
        next_notif_poll = 0.0
        trace = self.io_trace
        late_s = 0.0
        while True:
            if trace is not None:
                trace.woke(late_s)
                late_s = 0.0
            if self._drain_ready_commands():
                delay = self._config.poll_min_s  # new work resets the poll back-off
            now = time.monotonic()
            busy = False
            for participant in self._participants:
                try:
                    busy = participant.poll(now) or busy
                except Exception as exc:
                    self._log.exception("io_loop_participant_failed", error=repr(exc))
                    try:
                        participant.shutdown(f"internal data-plane error: {exc!r}")
                    except Exception:
                        self._log.exception("participant_shutdown_failed")
            self._finish_leaving_peers()
            if now >= next_notif_poll:
                started = time.perf_counter()
                self._poll_notifications()
                if trace is not None:
                    trace.call("notif", time.perf_counter() - started)
                next_notif_poll = now + self._config.notif_poll_s
            if trace is not None:
                trace.end_iteration(busy)
            if self._stopping.is_set() and not busy:
                break
            if busy:
                timeout = delay
                delay = min(delay * 2, self._config.poll_max_s)
            else:
                delay = self._config.poll_min_s
                timeout = max(0.0, next_notif_poll - time.monotonic())
            # The only wait: blocks until a command arrives or the poll interval passes.
            waited_from = time.perf_counter()
            try:
                fn, future = self._commands.get(timeout=timeout)
            except queue.Empty:
                late_s = time.perf_counter() - waited_from - timeout
                continue
            self._run_command(fn, future)
            delay = self._config.poll_min_s
        if trace is not None:
            trace.flush()
        self._drain_commands(RuntimeError("TransferAgent stopped"))

    def _drain_ready_commands(self) -> bool:
        ran = False
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return ran
            self._run_command(fn, future)
            ran = True

    def _run_post(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:
            self._log.exception("posted_action_failed", error=repr(exc))

    def _run_command(self, fn: Callable[[], None], future: _QueuedFuture | None) -> None:
        if future is None:
            self._run_post(fn)
        else:
            fn()  # `_resolve`: the outcome goes to the Future

    def _drain_commands(self, exc: BaseException) -> None:
        while True:
            try:
                _fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(exc)

    def _poll_notifications(self) -> None:
        try:
            notifs = self._nixl.get_new_notifs()
        except Exception as exc:
            self._log.warning("get_new_notifs_failed", error=repr(exc))
            return
        for agent, messages in notifs.items():
            name = agent.decode() if isinstance(agent, bytes) else str(agent)
            for message in messages:
                if self._notif_callbacks:
                    for callback in self._notif_callbacks:
                        try:
                            callback(name, bytes(message))
                        except Exception as exc:
                            self._log.error("notification_callback_failed", error=repr(exc))
                else:
                    self._notif_buffer.append((name, bytes(message)))

    # ---- peers ----------------------------------------------------------------------------------
    def peer_layout(self, agent_name: str) -> KVLayoutSpec:
        """The layout of a peer added with `add_peer` (KeyError when unknown or leaving)."""
        with self._lock:
            return self._peer_layouts[agent_name]

    def add_peer(self, agent_name: str, metadata: bytes, layout: KVLayoutSpec) -> Future[str]:
        """Load a remote agent and prepare its descriptor tables; the Future resolves to its name.

        Refused at once (LayoutError / ValueError) when the layout is malformed or cannot exchange KV
        with ours, or the peer is already known.
        """
        layout.validate()
        if self._layout is not None:
            check_head_compatible(self._layout, layout)
        with self._lock:
            if agent_name in self._peer_layouts:
                raise ValueError(f"peer {agent_name!r} is already added")
            self._peer_layouts[agent_name] = layout

        def do() -> str:
            try:
                if agent_name in self._peers:
                    raise ValueError(
                        f"peer {agent_name!r} is still leaving (handles in flight); add it again once "
                        "remove_peer's future has resolved"
                    )
                started = time.monotonic()
                # UCX wire-up, milliseconds to seconds; NIXL's binding releases the GIL meanwhile.
                loaded = self._nixl.add_remote_agent(metadata)
                load_s = time.monotonic() - started
                loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
                if loaded_name != agent_name:
                    self._nixl.remove_remote_agent(loaded_name)
                    raise ValueError(f"metadata is for agent {loaded_name!r}, not {agent_name!r}")
                peer = Peer(agent_name, layout, DescriptorTables(self._nixl, agent_name, layout))
                peer.tables.block_table()  # prepare the common case now, off the first write's path
                if self._layout is not None and self._layout.block_size_tokens != layout.block_size_tokens:
                    # Another block size: writes to it use both sides' chunk tables at the common granule.
                    granule = granule_tokens(self._layout, layout)
                    peer.tables.table(TABLE_CHUNK, granule)
                    self.local_tables().table(TABLE_CHUNK, granule)
                self._peers[agent_name] = peer
            except BaseException:
                with self._lock:
                    self._peer_layouts.pop(agent_name, None)
                raise
            log = self._log.warning if load_s > 1.0 else self._log.info
            log("peer_added", peer=agent_name, blocks=layout.block_count, block_size=layout.block_size_tokens,
                load_ms=round(load_s * 1000, 1))
            return agent_name

        return self._call(do)

    def remove_peer(self, agent_name: str, reason: str = "peer removed") -> Future[None]:
        """Fail every queued write to `agent_name`, then drop it once none of its handles is in flight.

        The Future resolves when its metadata and tables are released.
        """
        with self._lock:
            self._peer_layouts.pop(agent_name, None)
        done: Future[None] = Future()

        def do() -> None:
            peer = self._peers.get(agent_name)
            if peer is None:
                done.set_result(None)
                return
            peer.leaving = True
            peer.leaving_reason = reason
            peer.on_released.append(done)
            for participant in self._participants:
                participant.on_peer_leaving(agent_name, reason)
            self._finish_leaving_peers()

        def forward_error(command: Future[None]) -> None:
            if command.exception() is not None and not done.done():
                done.set_exception(command.exception())

        self._call(do).add_done_callback(forward_error)
        return done

    def peer(self, agent_name: str) -> Peer | None:
        """The peer record (I/O thread only); None when unknown."""
        return self._peers.get(agent_name)

    def local_tables(self) -> DescriptorTables:
        """Descriptor tables of the registered KV (I/O thread only)."""
        if self._local_tables is None:
            raise LayoutError("no KV memory registered yet")
        return self._local_tables

    def _finish_leaving_peers(self) -> None:
        for name in [n for n, p in self._peers.items() if p.leaving]:
            if any(participant.peer_in_flight(name) for participant in self._participants):
                continue
            peer = self._peers.pop(name)
            peer.tables.release()
            try:
                self._nixl.remove_remote_agent(name)
            except Exception as exc:
                self._log.warning("remove_remote_agent_failed", peer=name, error=repr(exc))
            self._log.info("peer_removed", peer=name, reason=peer.leaving_reason)
            for future in peer.on_released:
                if not future.done():
                    future.set_result(None)

    # ---- shutdown -------------------------------------------------------------------------------
    def stop(self, timeout: float = 10.0) -> None:
        """Fail queued writes, wait up to `timeout` for in-flight ones, release peers and memory."""
        if self._closed:
            return
        if self._thread is not None:
            def fail_queued() -> None:
                for participant in self._participants:
                    participant.shutdown("agent stopping")

            self._call(fail_queued)
            self._stopping.set()
            self._thread.join(timeout)
            if self._thread.is_alive():
                self._log.error("io_thread_did_not_stop", timeout_s=timeout)
                self._closed = True
                return
        self._closed = True
        for name in list(self._peers):
            peer = self._peers.pop(name)
            peer.tables.release()
            try:
                self._nixl.remove_remote_agent(name)
            except Exception:
                pass
        if self._local_tables is not None:
            self._local_tables.release()
        if self._reg_descs is not None:
            try:
                self._nixl.deregister_memory(self._reg_descs)
            except Exception as exc:
                self._log.warning("deregister_failed", error=repr(exc))
            self._reg_descs = None
        self._log.info("agent_stopped")

    def __enter__(self) -> TransferAgent:
        """Context manager: start on entry when not started."""
        if self._thread is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop on exit."""
        self.stop()
