"""What one caller may hold of the directory at once: stream slots, and calls and request bytes in flight.

A caller is its principal when identities are on (`engine/<id>`, `operator`), else its peer's host: one
caller cannot take what every other caller needs (docs/security.md).

- `StreamSlots`: open RenewLease, WatchTransfers and StreamPrefill calls. Streams other than renewals may
  use at most `max_open_streams` minus the renewals' reserve (`Limits.renewal_reserved_share`), and at
  most `max_streams_per_identity` per caller; renewals count against the global ceiling and their own
  per-caller count only, so watches and sessions can never take a renewal's slot.
- `CallGate`: unary calls (and a server stream's request) are read only while the caller has fewer than
  `max_calls_in_flight_per_caller` calls being read or handled; more wait unread (their bytes stay with the
  client, behind HTTP/2 flow control), at most `max_queued_calls_per_caller` of them (past it:
  RESOURCE_EXHAUSTED, unread). A read request over the caller's `max_bytes_in_flight_per_caller`, counting
  its calls being handled, is refused at once. With gRPC's receive limit at `max_message_bytes`, a caller's
  buffered requests stay under max_calls_in_flight_per_caller x max_message_bytes.
- `MemoryReturn`: after large requests (refused or handled) the memory they took goes back to the system.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import gc
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from kvpush.directory.errors import ResourceExhausted
from kvpush.directory.records import Limits


def caller_of(principal: str, peer: str) -> str:
    """The caller key: the principal when identities name one, else the peer's host ("ipv4:127.0.0.1")."""
    if principal and principal != "anyone":
        return principal
    host, _, _ = peer.rpartition(":")
    return "peer " + (host or peer)


@dataclass
class StreamSlots:
    """Open streams by caller and kind (module docstring). Plain counting; the servicer takes and gives back."""

    limits: Limits
    renewals: Counter[str] = field(default_factory=Counter)
    others: Counter[str] = field(default_factory=Counter)
    renewal_count: int = 0
    other_count: int = 0

    @property
    def open_count(self) -> int:
        """Every open stream."""
        return self.renewal_count + self.other_count

    def others_cap(self) -> int:
        """Streams other than renewals may use this many of max_open_streams; the rest are the renewals'."""
        reserved = math.ceil(self.limits.max_open_streams * self.limits.renewal_reserved_share)
        return self.limits.max_open_streams - reserved

    def take(self, caller: str, renewal: bool) -> None:
        """Take a slot; ResourceExhausted (naming the cap, `limit` for metrics) when none is left for it."""
        limits = self.limits
        mine = self.renewals if renewal else self.others
        kind = "renewal streams" if renewal else "streams other than renewals"
        if mine[caller] >= limits.max_streams_per_identity:
            raise ResourceExhausted(f"{caller} has {mine[caller]} open {kind}; the cap per caller is "
                                    f"{limits.max_streams_per_identity}", limit="identity_streams")
        if self.open_count >= limits.max_open_streams:
            raise ResourceExhausted(f"{self.open_count} streams are open; the cap is {limits.max_open_streams}",
                                    limit="open_streams")
        if not renewal and self.other_count >= self.others_cap():
            raise ResourceExhausted(f"{self.other_count} streams other than renewals are open; they may use "
                                    f"{self.others_cap()} of the {limits.max_open_streams} slots (the rest are "
                                    "kept for lease renewals)", limit="open_streams")
        mine[caller] += 1
        if renewal:
            self.renewal_count += 1
        else:
            self.other_count += 1

    def give_back(self, caller: str, renewal: bool) -> None:
        """Free a slot `take` gave."""
        mine = self.renewals if renewal else self.others
        mine[caller] -= 1
        if mine[caller] <= 0:
            del mine[caller]
        if renewal:
            self.renewal_count -= 1
        else:
            self.other_count -= 1


@dataclass
class _Caller:
    """One caller's calls in the gate."""

    in_flight: int = 0
    queued: int = 0
    bytes_in_flight: int = 0
    freed: asyncio.Event = field(default_factory=asyncio.Event)


class CallGate:
    """Per-caller bounds on unary calls read or handled at once, calls waiting unread, and request bytes held
    (module docstring). One event loop uses it."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._callers: dict[str, _Caller] = {}

    def in_flight(self, caller: str) -> int:
        """Calls of `caller` being read or handled now."""
        state = self._callers.get(caller)
        return state.in_flight if state is not None else 0

    @contextlib.asynccontextmanager
    async def slot(self, caller: str) -> AsyncIterator[Callable[[int], None]]:
        """Hold one of the caller's in-flight slots, waiting (unread) for one when all are taken; yields a function
        that charges the request's size (ResourceExhausted past the caller's byte budget)."""
        limits = self.limits
        state = self._callers.setdefault(caller, _Caller())
        charged = 0
        try:
            if state.in_flight >= limits.max_calls_in_flight_per_caller:
                if state.queued >= limits.max_queued_calls_per_caller:
                    raise ResourceExhausted(
                        f"{caller} has {state.in_flight} calls in flight and {state.queued} waiting; at most "
                        f"{limits.max_queued_calls_per_caller} may wait", limit="caller_calls")
                state.queued += 1
                try:
                    while state.in_flight >= limits.max_calls_in_flight_per_caller:
                        state.freed.clear()
                        await state.freed.wait()
                finally:
                    state.queued -= 1
            state.in_flight += 1

            def charge(size: int) -> None:
                nonlocal charged
                if state.bytes_in_flight + size > limits.max_bytes_in_flight_per_caller:
                    raise ResourceExhausted(
                        f"{caller} has {state.bytes_in_flight} request bytes in flight; this {size}-byte request "
                        f"would pass the limit of {limits.max_bytes_in_flight_per_caller}", limit="caller_bytes")
                state.bytes_in_flight += size
                charged = size

            try:
                yield charge
            finally:
                state.in_flight -= 1
                state.bytes_in_flight -= charged
                state.freed.set()
        finally:
            if not state.in_flight and not state.queued:
                self._callers.pop(caller, None)


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim (None elsewhere): returns the free pages of every malloc arena to the system."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]
    return trim


class MemoryReturn:
    """Gives the memory of large requests back to the system once they are gone.

    A refused request lives on in the cycle its exception makes (traceback -> frame -> request) until Python's
    collector runs, and the allocator keeps freed pages: a flood of maximal requests would hold its peak for
    good. So while large requests (each at least `LARGE_BYTES`) come, and for `settle_s` after the last one (its
    calls and connections end after it), `tick()` (the reaper's) collects cycles and trims the allocator, at most
    every `interval_s`.
    """

    LARGE_BYTES = 1024 * 1024

    def __init__(self, interval_s: float = 1.0, settle_s: float = 5.0) -> None:
        self.interval_s = interval_s
        self.settle_s = settle_s
        self.return_count = 0
        self._last = -math.inf
        self._last_large = -math.inf
        self._trim = _malloc_trim()

    def note(self, size: int) -> None:
        """A request of `size` bytes was read."""
        if size >= self.LARGE_BYTES:
            self._last_large = time.monotonic()

    async def tick(self) -> bool:
        """Collect and trim if large requests came within `settle_s` and `interval_s` passed; True when it did.
        The trim runs on a thread (it takes the allocator's locks, not the event loop)."""
        now = time.monotonic()
        if now - self._last_large > self.settle_s or now - self._last < self.interval_s:
            return False
        self._last = now
        gc.collect()
        if self._trim is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._trim, 0)
        self.return_count += 1
        return True
