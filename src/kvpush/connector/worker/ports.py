"""What the workers need of their collaborators, as Protocols: the directory link, the data plane, the owner loop.

The workers are typed against these, not against the classes that implement them (DirectoryLink,
PushTransport, TransferAgent), so the unit tests' recording fakes and the production objects are checked alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvpush.connector.worker.push_state import PlannedWrite
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb

# A check the data plane runs before posting: None to post, else why the write may no longer be posted.
PostGuard = Callable[[], "str | None"]


@dataclass(frozen=True, slots=True)
class HeadRoute:
    """One decode worker a transfer's writes go to, and which KV heads (PushInstruction.head_slice and
    more_destinations): heads [source_head_start, +head_count) of this worker into [destination_head_start, ...)
    of `agent_name`'s, closed by `notification`."""

    agent_name: str
    source_head_start: int
    destination_head_start: int
    head_count: int
    notification: bytes


class ReadyEvent(Protocol):
    """A CUDA event recorded after a layer's KV was written (`torch.cuda.Event`): complete once the GPU passed it."""

    def query(self) -> bool:
        """True once complete; never blocks."""
        ...


class LoopParticipant(Protocol):
    """Polled by the owner thread on every iteration."""

    def poll(self, now: float) -> bool:
        """Do what is due; True while busy (the loop then does not sleep)."""
        ...

    def on_peer_leaving(self, peer: str, reason: str) -> None:
        """A peer is being removed."""
        ...

    def peer_in_flight(self, peer: str) -> int:
        """Handles of this participant still in flight towards `peer`."""
        ...

    def shutdown(self, reason: str) -> None:
        """The loop stops."""
        ...


class OwnerLoop(Protocol):
    """The thread that owns push state: `TransferAgent` (its NIXL I/O thread) in production."""

    def post(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the owner thread, in posting order (inline when called from it); log what it raises."""
        ...

    def attach(self, participant: LoopParticipant) -> None:
        """Have the owner thread call `participant.poll(now)` on every iteration."""
        ...


class Lease(Protocol):
    """The worker's registration: whether its lease still holds."""

    registration_count: int
    ttl_s: float

    def holds_lease(self, generation: int, margin_s: float) -> bool:
        """True while the lease of registration `generation` holds with `margin_s` to spare."""
        ...


class PrefillSessionPort(Protocol):
    """The StreamPrefill session: thread-safe queues towards the directory."""

    def send_ready(self, events: Iterable[dpb.LayerReady]) -> None:
        """Queue readiness events."""
        ...

    def send_result(self, result: dpb.WriteResult) -> None:
        """Queue a WriteResult."""
        ...


class PrefillDirectory(Protocol):
    """The prefill worker's directory link: its session (None before it opens) and registration."""

    @property
    def session(self) -> PrefillSessionPort | None:
        """The open StreamPrefill session."""
        ...

    @property
    def registration(self) -> Lease | None:
        """The registration whose lease the link renews."""
        ...


class PushTransportPort(Protocol):
    """The prefill worker's view of the data plane (`transport.PushTransport`)."""

    def has_peer(self, agent_name: str) -> bool:
        """True while the data plane holds the decode worker's agent."""
        ...

    def ensure_peer(self, agent_name: str, metadata: bytes, layout_proto: tpb.KVLayout | None) -> None:
        """Load a decode worker's agent once; raise ValueError / RuntimeError when it cannot be."""
        ...

    def peer_block_size_tokens(self, agent_name: str) -> int:
        """The block size of a decode worker's layout (its agent loaded or loading); ValueError when unknown."""
        ...

    def submit(self, transfer_id: str, peer_agent: str, write: PlannedWrite, notification: bytes,
               ready_event: ReadyEvent | None, traceparent: str, post_guard: PostGuard | None = None) -> None:
        """Queue one planned write; raise (nothing queued) when refused."""
        ...

    def set_routes(self, transfer_id: str, routes: Sequence[HeadRoute]) -> None:
        """Write the transfer's KV by head slice to these decode agents (TP sizes differ); before its first write."""
        ...

    def when_computed(self, event: ReadyEvent, callback: Callable[[float], None]) -> None:
        """Call `callback(unix time)` on the I/O thread once the GPU passed `event`."""
        ...

    def cancel(self, transfer_id: str) -> None:
        """Drop the transfer's queued writes; WriterQuiet follows."""
        ...


class DecodeDirectory(Protocol):
    """The decode worker's directory link."""

    @property
    def registration(self) -> Lease | None:
        """The registration whose lease the link renews."""
        ...

    def cancel_transfer(self, transfer_id: str, reason: str) -> None:
        """Cancel a transfer at the directory (submitted, never awaited)."""
        ...

    def get_transfer(self, transfer_id: str, done: Callable[[tpb.Transfer | None, str], None]) -> None:
        """Look a transfer up; `done(transfer or None, error)` runs on the link's thread."""
        ...
