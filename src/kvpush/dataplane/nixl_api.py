"""The part of NIXL's agent API the data plane calls, as a Protocol, and the opaque handles it passes around.

NIXL's `nixl_agent` (nixl._api, loaded at run time by `config.create_nixl_agent`) and the in-memory stand-in
(`inmemory.InMemoryNixlAgent`) both serve it. Handles are NewTypes of `object`: the data plane only hands them
back to the agent that made them, never looks inside. Parameters are positional-only, as the data plane calls
them, so the two implementations may name them as they like.
"""

from __future__ import annotations

from typing import NewType, Protocol

import numpy as np
from numpy.typing import NDArray

# nixl.nixlRegDList: the registration of KV memory, handed back to deregister it.
RegisteredMemory = NewType("RegisteredMemory", object)
# nixl_prepped_dlist_handle: a descriptor table prepared once (`prep_xfer_dlist`), indexed by transfers.
DlistHandle = NewType("DlistHandle", object)
# nixl.nixlXferDList: explicit descriptors of one transfer (`get_xfer_descs`).
XferDescs = NewType("XferDescs", object)
# nixl_xfer_handle: one WRITE, posted with `transfer` and polled until DONE or ERR.
XferHandle = NewType("XferHandle", object)

# Rows of (address, length, device) or, compressed, (address, length, device, stride, count).
DescriptorRows = NDArray[np.uint64]
# Entry numbers into a prepared table (NIXL takes int32).
TableIndices = NDArray[np.int32]


class XferTelemetry(Protocol):
    """nixl.nixlXferTelemetry: what one transfer cost (times in microseconds)."""

    @property
    def postDuration(self) -> float:
        """Time spent posting."""
        ...

    @property
    def xferDuration(self) -> float:
        """Post to completion."""
        ...

    @property
    def totalBytes(self) -> int:
        """Bytes moved."""
        ...

    @property
    def descCount(self) -> int:
        """Descriptors after NIXL's merge."""
        ...


class NixlAgentApi(Protocol):
    """The `nixl_agent` calls kvpush makes; with thread sync NONE, all of them from one thread."""

    def register_memory(self, regions: DescriptorRows, memory_kind: str, /) -> RegisteredMemory:
        """Register (address, length, device) rows of `memory_kind` ("DRAM" or "VRAM")."""
        ...

    def deregister_memory(self, registered: RegisteredMemory, /) -> None:
        """Undo `register_memory`."""
        ...

    def get_agent_metadata(self) -> bytes:
        """What a peer passes to `add_remote_agent`."""
        ...

    def add_remote_agent(self, metadata: bytes, /) -> str | bytes:
        """Load a peer; returns its name (NIXL: str; older bindings: bytes)."""
        ...

    def remove_remote_agent(self, name: str, /) -> None:
        """Forget a peer loaded with `add_remote_agent`."""
        ...

    def prep_xfer_dlist(self, owner: str, rows: DescriptorRows, memory_kind: str, /) -> DlistHandle:
        """Prepare a table from Nx5 rows; `owner` is "NIXL_INIT_AGENT" for local memory, else the peer's name."""
        ...

    def release_dlist_handle(self, handle: DlistHandle, /) -> None:
        """Release a prepared table."""
        ...

    def get_xfer_descs(self, rows: DescriptorRows, memory_kind: str, /) -> XferDescs:
        """Explicit descriptors from Nx3 (address, length, device) rows."""
        ...

    def make_prepped_xfer(self, operation: str, local: DlistHandle, local_indices: TableIndices,
                          remote: DlistHandle, remote_indices: TableIndices, /) -> XferHandle:
        """A transfer of local table entries into remote table entries, pairwise."""
        ...

    def initialize_xfer(self, operation: str, local: XferDescs, remote: XferDescs, peer: str, /) -> XferHandle:
        """A transfer of explicit local descriptors into explicit remote ones, pairwise."""
        ...

    def transfer(self, handle: XferHandle, notification: bytes, /) -> str:
        """Post; "DONE", "PROC" or "ERR". A non-empty `notification` reaches the peer with the data."""
        ...

    def check_xfer_state(self, handle: XferHandle, /) -> str:
        """"DONE", "PROC" or "ERR"."""
        ...

    def release_xfer_handle(self, handle: XferHandle, /) -> None:
        """Release a transfer (NIXL cancels one in progress, or raises)."""
        ...

    def get_xfer_telemetry(self, handle: XferHandle, /) -> XferTelemetry:
        """What the transfer cost (raises when telemetry is off)."""
        ...

    def send_notif(self, peer: str, message: bytes, /) -> None:
        """Send `message` to a loaded peer."""
        ...

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by sender."""
        ...
