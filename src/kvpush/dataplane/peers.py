"""Prepared NIXL descriptor tables of one layout (local or a peer's) and the peer record.

A table is prepared once (`prep_xfer_dlist` with compressed Nx5 rows, see `plan`) and cached for
the life of the registration or peer: the block table eagerly for peers, chunk tables lazily per
granule (only block-size-mismatched pairs need them). Every call here runs on the agent's I/O thread.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from kvpush.dataplane.layout import KVLayoutSpec, slice_heads
from kvpush.dataplane.nixl_api import DlistHandle, NixlAgentApi
from kvpush.dataplane.plan import TABLE_BLOCK, block_table_rows, chunk_table_rows


class DescriptorTables:
    """Cached prepared dlists of one layout, as seen by one NIXL agent.

    `owner` is "NIXL_INIT_AGENT" for our own memory, else the remote agent's name.
    """

    def __init__(self, nixl: NixlAgentApi, owner: str, layout: KVLayoutSpec) -> None:
        """Bind to `nixl` (the agent that prepares) for memory `layout` owned by `owner`."""
        self._nixl = nixl
        self._owner = owner
        self._layout = layout
        self._handles: dict[tuple[str, int], DlistHandle] = {}
        self._head_tables: dict[tuple[int, int], DescriptorTables] = {}

    @property
    def layout(self) -> KVLayoutSpec:
        """The layout these tables index."""
        return self._layout

    def block_table(self) -> DlistHandle:
        """The prepared block table (one entry per layer, plane, block)."""
        return self.table(TABLE_BLOCK, self._layout.block_size_tokens)

    def table(self, kind: str, granule: int) -> DlistHandle:
        """The prepared table of `kind` ("block" or "chunk") at `granule` tokens, prepared on first use."""
        key = (kind, granule)
        handle = self._handles.get(key)
        if handle is None:
            rows = block_table_rows(self._layout) if kind == TABLE_BLOCK else chunk_table_rows(self._layout, granule)
            handle = self._nixl.prep_xfer_dlist(self._owner, rows, self._layout.memory_kind)
            self._handles[key] = handle
        return handle

    def heads(self, start: int, count: int) -> DescriptorTables:
        """The tables of this layout cut to KV heads [start, start + count) (`layout.slice_heads`), made once."""
        key = (start, count)
        tables = self._head_tables.get(key)
        if tables is None:
            sliced = slice_heads(self._layout, start, count)
            tables = self if sliced is self._layout else DescriptorTables(self._nixl, self._owner, sliced)
            self._head_tables[key] = tables
        return tables

    def release(self) -> None:
        """Release every prepared dlist (no handle using them may be in flight)."""
        for tables in self._head_tables.values():
            if tables is not self:
                tables.release()
        self._head_tables.clear()
        for handle in self._handles.values():
            try:
                self._nixl.release_dlist_handle(handle)
            except Exception:
                pass
        self._handles.clear()


@dataclass
class Peer:
    """A remote agent we write into: its layout, its tables, whether it is leaving."""

    name: str
    layout: KVLayoutSpec
    tables: DescriptorTables
    leaving: bool = False
    leaving_reason: str = ""
    on_released: list[Future[None]] = field(default_factory=list)
