"""An in-memory NIXL agent: the subset of `nixl_agent` the data plane calls, moving bytes with memmove.

Chosen with `NixlConfig(backends=("INMEMORY",))` (`create_nixl_agent` returns an `InMemoryNixlAgent`), so a
`TransferAgent`, its I/O thread, `PushWriter`, `NotificationListener` and both connector workers run unchanged
on it, in one process, in milliseconds. Agents meet in an `InMemoryFabric` (one per process by default, or
one per test): `get_agent_metadata()` names the agent, `add_remote_agent` looks it up there. A WRITE copies
its descriptors' bytes (host memory: both agents live in this process) into the peer's registered memory;
a descriptor outside registered memory fails the transfer, as NIXL would.

What a test controls, on the fabric:
- `hold = True`: posted transfers stay "PROC" until `complete(...)` (in any order the test picks), so
  notification order, cancellation of in-flight writes and timeouts can be exercised;
- `fail_next_transfers(n)`: the next n `transfer()` calls end in "ERR" (nothing copied);
- `posted`: every transfer posted so far (agent, peer, descriptor count, notification), in order.
Real NIXL keeps its own integration tests (tests/integration/dataplane); this stand-in is for the logic
around it.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from kvpush.dataplane.nixl_api import (
    DescriptorRows,
    DlistHandle,
    RegisteredMemory,
    TableIndices,
    XferDescs,
    XferHandle,
    XferTelemetry,
)

BACKEND_INMEMORY = "INMEMORY"
_METADATA_PREFIX = b"kvpush-inmemory:"


@dataclass
class _Xfer:
    """One posted (or postable) WRITE: (src address, dst address, length) triples towards `peer`."""

    owner: InMemoryNixlAgent
    peer: str
    copies: list[tuple[int, int, int]]
    state: str = "INIT"          # INIT -> PROC -> DONE | ERR
    notification: bytes = b""
    serial: int = 0


_H = TypeVar("_H")


@dataclass(frozen=True, slots=True)
class _Registration:
    """What `register_memory` registered: (address, length) regions."""

    regions: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class _Descs:
    """Explicit descriptors of one transfer: (address, length) pairs."""

    pairs: tuple[tuple[int, int], ...]


def _own(handle: object, kind: type[_H]) -> _H:
    """`handle` as this stand-in made it; a handle of another kind is refused, as NIXL refuses a foreign one."""
    if not isinstance(handle, kind):
        raise RuntimeError(f"not an in-memory {kind.__name__.strip('_')} handle: {handle!r}")
    return handle


@dataclass
class PostedTransfer:
    """What one `transfer()` call asked for (the fabric's record, for assertions)."""

    agent: str
    peer: str
    descriptor_count: int
    byte_count: int
    notification: bytes
    serial: int


@dataclass
class InMemoryFabric:
    """Where in-memory agents find each other, and the knobs a test turns (see the module docstring)."""

    hold: bool = False
    agents: dict[str, InMemoryNixlAgent] = field(default_factory=dict)
    posted: list[PostedTransfer] = field(default_factory=list)
    _fail_next: int = 0
    _held: list[_Xfer] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _serials: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def fail_next_transfers(self, count: int = 1) -> None:
        """Make the next `count` transfer() calls end in ERR, copying nothing."""
        with self._lock:
            self._fail_next += count

    def held(self) -> list[_Xfer]:
        """Transfers posted while `hold` was on that have not completed yet, oldest first."""
        with self._lock:
            return [x for x in self._held if x.state == "PROC"]

    def complete(self, xfer: _Xfer | None = None, ok: bool = True) -> None:
        """Complete one held transfer (default: every one), copying its bytes unless `ok` is False."""
        for held in [xfer] if xfer is not None else self.held():
            held.owner._finish(held, ok)

    def _take_failure(self) -> bool:
        with self._lock:
            if self._fail_next > 0:
                self._fail_next -= 1
                return True
            return False


_FABRICS: dict[str, InMemoryFabric] = {}
_FABRICS_LOCK = threading.Lock()


def fabric(name: str = "default") -> InMemoryFabric:
    """The process's fabric called `name` (made on first use): NixlConfig.backend_params["INMEMORY"]["fabric"]."""
    with _FABRICS_LOCK:
        return _FABRICS.setdefault(name, InMemoryFabric())


_default_fabric = fabric  # InMemoryNixlAgent's `fabric` parameter shadows the function


class InMemoryNixlAgent:
    """The `nixl_agent` calls kvpush makes, on host memory in this process (see the module docstring).

    Like NIXL with thread sync NONE, it expects its calls from one thread (the TransferAgent's I/O thread);
    only the fabric's `complete` and a peer's notification delivery cross threads, under its lock.
    """

    def __init__(self, name: str, fabric: InMemoryFabric | None = None) -> None:
        self.name = name
        self.fabric: InMemoryFabric = fabric if fabric is not None else _default_fabric()
        self._regions: list[tuple[int, int]] = []
        self._remote: set[str] = set()
        self._dlists: dict[DlistHandle, list[tuple[int, int]]] = {}
        self._dlist_owner: dict[DlistHandle, str] = {}
        self._dlist_ids = itertools.count(1)
        self._notifs: dict[str, list[bytes]] = defaultdict(list)
        self._lock = threading.Lock()
        with self.fabric._lock:
            # A new agent of an earlier one's name replaces it (a restarted worker): peers that load the
            # name from now on reach the new one, as they would a re-registered NIXL agent.
            self.fabric.agents[name] = self

    # ---- memory and peers ---------------------------------------------------------------------
    def register_memory(self, regions: DescriptorRows, memory_kind: str) -> RegisteredMemory:
        """Register (address, length, device) rows; only host memory can be copied here."""
        if memory_kind != "DRAM":
            raise RuntimeError(f"in-memory NIXL moves host memory only, not {memory_kind}")
        added = [(int(addr), int(length)) for addr, length, _device in np.asarray(regions).reshape(-1, 3)]
        self._regions.extend(added)
        return RegisteredMemory(_Registration(tuple(added)))

    def deregister_memory(self, descs: RegisteredMemory) -> None:
        """Forget registered regions."""
        for region in _own(descs, _Registration).regions:
            if region in self._regions:
                self._regions.remove(region)

    def get_agent_metadata(self) -> bytes:
        """What a peer passes to add_remote_agent."""
        return _METADATA_PREFIX + self.name.encode()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        """Load a peer by its metadata; returns its name."""
        if not bytes(metadata).startswith(_METADATA_PREFIX):
            raise RuntimeError("not in-memory agent metadata")
        name = bytes(metadata)[len(_METADATA_PREFIX):].decode()
        if name not in self.fabric.agents:
            raise RuntimeError(f"no in-memory agent {name!r} on this fabric")
        self._remote.add(name)
        return name.encode()

    def remove_remote_agent(self, name: str) -> None:
        """Forget a peer."""
        self._remote.discard(name)

    # ---- descriptor lists ---------------------------------------------------------------------
    def prep_xfer_dlist(self, owner: str, rows: DescriptorRows, memory_kind: str) -> DlistHandle:
        """Prepare a descriptor list from Nx5 (address, length, device, stride, count) rows; returns its handle."""
        descs: list[tuple[int, int]] = []
        for addr, length, _device, stride, count in np.asarray(rows, dtype=np.uint64).reshape(-1, 5):
            descs.extend((int(addr) + j * int(stride), int(length)) for j in range(int(count)))
        handle = DlistHandle(next(self._dlist_ids))
        self._dlists[handle] = descs
        self._dlist_owner[handle] = owner
        return handle

    def release_dlist_handle(self, handle: DlistHandle) -> None:
        """Release a prepared list."""
        self._dlists.pop(handle, None)
        self._dlist_owner.pop(handle, None)

    def get_xfer_descs(self, descs: DescriptorRows, memory_kind: str) -> XferDescs:
        """(address, length) pairs from Nx3 (address, length, device) rows."""
        return XferDescs(_Descs(tuple((int(addr), int(length)) for addr, length, _device
                                      in np.asarray(descs).reshape(-1, 3))))

    def make_prepped_xfer(self, op: str, local: DlistHandle, local_indices: TableIndices, remote: DlistHandle,
                          remote_indices: TableIndices) -> XferHandle:
        """A WRITE of local list entries into remote list entries, pairwise."""
        self._check_op(op)
        src, dst = self._dlists[local], self._dlists[remote]
        copies = []
        for i, j in zip(np.asarray(local_indices).tolist(), np.asarray(remote_indices).tolist(), strict=True):
            (s_addr, s_len), (d_addr, d_len) = src[i], dst[j]
            if s_len != d_len:
                raise RuntimeError(f"descriptor lengths differ: {s_len} vs {d_len}")
            copies.append((s_addr, d_addr, s_len))
        return XferHandle(_Xfer(self, self._peer_of(remote), copies))

    def initialize_xfer(self, op: str, local: XferDescs, remote: XferDescs, peer: str) -> XferHandle:
        """A WRITE of explicit local descriptors into explicit remote ones, pairwise."""
        self._check_op(op)
        local_pairs, remote_pairs = _own(local, _Descs).pairs, _own(remote, _Descs).pairs
        if len(local_pairs) != len(remote_pairs):
            raise RuntimeError("descriptor lists differ in length")
        copies = []
        for (s_addr, s_len), (d_addr, d_len) in zip(local_pairs, remote_pairs):
            if s_len != d_len:
                raise RuntimeError(f"descriptor lengths differ: {s_len} vs {d_len}")
            copies.append((s_addr, d_addr, s_len))
        return XferHandle(_Xfer(self, peer, copies))

    # ---- transfers ----------------------------------------------------------------------------
    def transfer(self, handle: XferHandle, notification: bytes = b"") -> str:
        """Post: copy now (or hold, see the fabric), deliver the notification with the data; PROC, DONE or ERR."""
        xfer = _own(handle, _Xfer)
        if xfer.peer not in self._remote:
            raise RuntimeError(f"peer {xfer.peer!r} is not loaded")
        xfer.notification = bytes(notification)
        xfer.serial = next(self.fabric._serials)
        self.fabric.posted.append(PostedTransfer(self.name, xfer.peer, len(xfer.copies),
                                                 sum(n for *_, n in xfer.copies), xfer.notification, xfer.serial))
        if self.fabric._take_failure():
            xfer.state = "ERR"
            return "ERR"
        xfer.state = "PROC"
        if self.fabric.hold:
            with self.fabric._lock:
                self.fabric._held.append(xfer)
            return "PROC"
        self._finish(xfer, True)
        return xfer.state

    def check_xfer_state(self, handle: XferHandle) -> str:
        """PROC until completed, then DONE or ERR."""
        return _own(handle, _Xfer).state

    def release_xfer_handle(self, handle: XferHandle) -> None:
        """Release a finished (or never posted) transfer."""
        if _own(handle, _Xfer).state == "PROC":
            raise RuntimeError("cannot release a transfer in progress")

    def get_xfer_telemetry(self, handle: XferHandle) -> XferTelemetry:
        """No telemetry here (NIXL raises when it has none)."""
        raise RuntimeError("in-memory NIXL keeps no telemetry")

    # ---- notifications ------------------------------------------------------------------------
    def send_notif(self, peer: str, message: bytes) -> None:
        """Deliver a notification to a loaded peer."""
        if peer not in self._remote:
            raise RuntimeError(f"peer {peer!r} is not loaded")
        self.fabric.agents[peer]._deliver(self.name, bytes(message))

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by sender."""
        with self._lock:
            notifs, self._notifs = dict(self._notifs), defaultdict(list)
        return notifs

    # ---- internals ----------------------------------------------------------------------------
    def _finish(self, xfer: _Xfer, ok: bool) -> None:
        with self.fabric._lock:
            if xfer.state != "PROC":
                return
            if xfer in self.fabric._held:
                self.fabric._held.remove(xfer)
        peer = self.fabric.agents.get(xfer.peer)
        if not ok or peer is None or not all(self._inside(src, n) and peer._inside(dst, n)
                                             for src, dst, n in xfer.copies):
            xfer.state = "ERR"
            return
        for src, dst, n in xfer.copies:
            ctypes.memmove(dst, src, n)
        xfer.state = "DONE"
        if xfer.notification:
            peer._deliver(self.name, xfer.notification)

    def _deliver(self, sender: str, message: bytes) -> None:
        with self._lock:
            self._notifs[sender].append(message)

    def _inside(self, addr: int, length: int) -> bool:
        return any(start <= addr and addr + length <= start + size for start, size in self._regions)

    def _peer_of(self, dlist: DlistHandle) -> str:
        # Prepared remote lists are prepared with the peer's name as owner; the writer pairs them with it.
        return self._dlist_owner.get(dlist, "")

    @staticmethod
    def _check_op(op: str) -> None:
        if op != "WRITE":
            raise RuntimeError(f"in-memory NIXL supports WRITE only, not {op}")
