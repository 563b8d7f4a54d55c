"""The per-transfer push state machine of a prefill worker: what may be written, and when it is done.

Pure bookkeeping (no NIXL, no gRPC, no threads), so it is unit-tested on its own. One `PushTransfer`
per transfer, driven by the prefill worker's `PushOwner` on the NIXL I/O thread:

  1. Readiness: `mark_ready(layer, tokens_ready)` records that prompt tokens [0, tokens_ready) of a
     layer are computed (a chunk's forward, or this engine's prefix cache at once for every layer).
  2. Instruction: `set_instruction(...)` records decode's blocks and its prefix hit (skip) once.
  3. `next_writes()` returns the writes that have become possible: for each layer, the blocks from
     where the last write stopped up to the last *full* block computed, or up to the partial last
     block once the whole prompt is computed. A block of a layer is therefore written exactly once
     (a chunk ending mid-block leaves that block to a later chunk), and nothing before decode's
     prefix hit is written. The write that completes every layer carries the notification.
     Blocks here are this (prefill) engine's; decode's may be of another size (token-addressable layouts
     only, which the data plane writes token-exact): a write lists decode's blocks holding [0, token_end) in
     decode's size, and a decode block cut by two writes gets two disjoint token ranges.
     Decode's prefix hit is a multiple of decode's block size, not necessarily of this engine's: the first
     write then starts inside a block, at the hit.
     KV-cache groups (vLLM's hybrid KV-cache manager): each layer belongs to one group, and each group has its
     own block lists on both sides. A layer's writes use its group's blocks, and start at the group's first
     token on decode (a sliding-window group keeps only the prompt's last window there; its earlier blocks are
     decode's null block, never written).
     State groups (vLLM's MambaSpec: Mamba, linear attention, ...; `state_group_block_sizes`): a state layer holds
     no per-token KV but one recurrent state per request, final only once the layer computed the prompt's last
     token. Its one write is the state block holding that token (block `(prompt - 1) // group block size` of its
     group, both sides), planned when the layer is ready for the whole prompt and never for an earlier chunk; a
     decode prefix hit covering the whole prompt leaves nothing to write, any shorter one still needs it.
  4. Outcomes: `write_submitted()` after the data plane accepted a write, `write_finished(outcome, ...)`
     per write, `writer_is_quiet()` once the data plane holds no handle of the transfer; the push is DONE
     when every planned write landed, FAILED on the first failure; `stop(PushStop)` (cancellation, abort,
     timeout) stops new writes. Writes in flight are counted once: planned minus finished. `quiescent` is
     true once nothing is in flight: only then may the blocks be released.
  5. `finalize_timeline()`: the `PushTimeline` (what was measured, with the derived counts).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from kvpush.api.outcome import PUSH_ACTIVE, PushOutcome, PushStop, StopCause


@dataclass(frozen=True)
class PlannedWrite:
    """One write: tokens [token_start, token_end) of one layer, block lists in token order from token 0 (source
    blocks in prefill's block size, destination blocks in decode's)."""

    layer: int
    token_start: int
    token_end: int
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]
    notify: bool
    # A state layer's write: the whole state of one block, src_block_ids[0] into dst_block_ids[0] (the tokens only
    # say which prompt it is the state after).
    state: bool = False


@dataclass
class PushTimeline:
    """What one prefill worker (one TP rank) measured for one transfer; times are unix seconds.

    One write is one layer's blocks of one chunk, so a prompt prefilled in N chunks makes up to N writes
    per layer. Every count is of landed writes; sums are over them. It becomes the rank's TransferTiming
    (`prefill.timing_proto`) and, carried as it is in worker metadata (`metadata.TimelineReport`) and combined
    over ranks by the scheduler half, the response's push timeline (`TimelineReport.json_fields`).
    """

    first_write_start_time: float | None = None   # earliest post of a landed write
    last_write_end_time: float | None = None      # latest completion
    prefill_end_time: float | None = None         # last layer of the last chunk computed (GPU: its kernel)
    post_duration_s: float = 0.0                  # time spent posting, summed (a response key: name kept)
    write_count: int = 0
    descriptor_count: int = 0                     # NIXL descriptors after merging, summed
    bytes_written: int = 0                        # summed
    writes_before_prefill_end_count: int = 0      # writes that landed before prefill_end_time
    layers_written_before_prefill_end_count: int = 0  # layers whose every write landed before it
    state: str = PUSH_ACTIVE                      # PushOutcome value once ended
    reason: str = ""                              # why it did not end DONE
    write_end_times: list[float] = field(default_factory=list, repr=False)
    # layer -> when its last write ended (the directory's per-layer timeline: TransferTiming.layer_writes).
    layer_write_end_times: dict[int, float] = field(default_factory=dict, repr=False)
    # layer -> when its last write was posted (with the end: posted late, or posted on time and slow to land).
    layer_write_post_times: dict[int, float] = field(default_factory=dict, repr=False)
    settled: bool = False                         # True in the one timeline published when the push was settled

    def as_dict(self) -> dict[str, TimelineValue]:
        """Plain values (no per-write or per-layer detail): a span's attributes, a log line's fields."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _PER_WRITE}

    def snapshot(self) -> PushTimeline:
        """A copy to hand to another thread (the per-write list left out)."""
        return dataclasses.replace(self, write_end_times=[], layer_write_end_times=dict(self.layer_write_end_times),
                                   layer_write_post_times=dict(self.layer_write_post_times))

    def summary(self) -> PushTimeline:
        """A copy without the per-write and per-layer detail (those go to the directory, in the rank's
        TransferTiming): what worker metadata carries to the scheduler for the response."""
        return dataclasses.replace(self, write_end_times=[], layer_write_end_times={}, layer_write_post_times={})


# Per-write and per-layer detail: in the rank's TransferTiming, not in the response's push timeline.
_PER_WRITE = ("write_end_times", "layer_write_end_times", "layer_write_post_times")
# A push timeline's plain values (as_dict).
TimelineValue = float | int | str | bool | None


class PushTransfer:
    """One transfer's push state on one prefill worker (see the module docstring)."""

    def __init__(self, transfer_id: str, request_id: str, prompt_token_count: int, layer_count: int,
                 block_size_tokens: int, layer_groups: tuple[int, ...] = (),
                 state_group_block_sizes: dict[int, int] | None = None) -> None:
        if prompt_token_count <= 0 or layer_count <= 0 or block_size_tokens <= 0:
            raise ValueError("prompt_token_count, layer_count and block_size_tokens must be positive")
        if layer_groups and (len(layer_groups) != layer_count or min(layer_groups) < 0):
            raise ValueError(f"layer_groups must name a group (>= 0) for each of the {layer_count} layers")
        # Each layer's KV-cache group (all 0: one group).
        self.layer_groups = tuple(layer_groups) or (0,) * layer_count
        self.group_count = max(self.layer_groups) + 1
        # State groups and the tokens one of their blocks covers (the same on both sides: planning pairs only
        # equal groups); their layers are state layers (module docstring).
        self.state_group_block_sizes = dict(state_group_block_sizes or {})
        if any(not 0 <= group < self.group_count or size <= 0
               for group, size in self.state_group_block_sizes.items()):
            raise ValueError(f"state groups {self.state_group_block_sizes} must be groups in [0, {self.group_count}) "
                             "with a positive block size")
        self.state_layers = frozenset(layer for layer, group in enumerate(self.layer_groups)
                                      if group in self.state_group_block_sizes)
        self.transfer_id = transfer_id
        self.request_id = request_id
        self.prompt_token_count = prompt_token_count
        self.layer_count = layer_count
        self.block_size_tokens = block_size_tokens
        self.src_block_groups: list[tuple[int, ...]] = [()] * self.group_count
        self.tokens_ready = [0] * layer_count
        self.outcome: PushOutcome | None = None  # None while the push runs
        self.stopped_by: PushStop | None = None  # why it ended, unless every write it owed landed
        # The data plane's own view: once it reported the transfer quiet, none of its handles is in flight.
        self.writes_submitted = 0
        self.writer_quiet = False
        self.timeline = PushTimeline()
        # Set by the instruction.
        self.peer_agent = ""
        self.dst_block_groups: list[tuple[int, ...]] = [()] * self.group_count
        self.dst_block_size_tokens = block_size_tokens
        self.skip_token_count = 0
        # Per layer: the first token written (decode's prefix hit, or its group's first token if later).
        self.layer_skip_tokens = [0] * layer_count
        self.notification = b""
        self._blocks_planned: list[int] = []  # per layer: blocks [0, n) are written or in flight
        # Layers whose readiness grew since the last next_writes (all of them once the instruction arrives):
        # planning looks only at these, so a save costs the same whatever the layer count.
        self._layers_to_plan: set[int] = set()
        self._layers_fully_planned = 0
        self._layer_writes_in_flight = [0] * layer_count
        self._layer_last_end_time: list[float | None] = [None] * layer_count
        self._layer_last_post_time: list[float | None] = [None] * layer_count
        self._writes_planned = 0
        self._writes_finished = 0   # outcomes counted (landed, failed, refused)
        self._writes_abandoned = 0  # never reported by the data plane, given up on past every bound
        self._writes_landed = 0
        self._notify_planned = False
        # Per layer, the token ranges planned so far (in order): a block is written at most once (check_invariants).
        self.planned_ranges: list[list[tuple[int, int]]] = [[] for _ in range(layer_count)]

    @property
    def reason(self) -> str:
        """Why the push did not end DONE ("" while it runs or once DONE)."""
        return self.stopped_by.detail if self.stopped_by is not None else ""

    @property
    def in_flight(self) -> int:
        """Planned writes whose outcome is not counted yet."""
        return self._writes_planned - self._writes_finished - self._writes_abandoned

    @property
    def writes_planned(self) -> int:
        """Writes handed out by next_writes."""
        return self._writes_planned

    @property
    def writes_landed(self) -> int:
        """Writes that landed."""
        return self._writes_landed

    @property
    def notify_planned(self) -> bool:
        """True once the closing write (the one carrying the notification) was planned."""
        return self._notify_planned

    @property
    def all_planned(self) -> bool:
        """True once every layer's blocks up to the prompt's end were planned."""
        return self._all_planned()

    # ---------------------------------------------------------------- inputs

    @property
    def total_blocks(self) -> int:
        """Blocks holding the prompt."""
        return -(-self.prompt_token_count // self.block_size_tokens)

    @property
    def has_instruction(self) -> bool:
        """True once decode's blocks are known."""
        return bool(self.peer_agent)

    @property
    def fully_computed(self) -> bool:
        """True once every layer of every prompt token is computed."""
        return min(self.tokens_ready) >= self.prompt_token_count

    @property
    def quiescent(self) -> bool:
        """True when no write of this transfer is in flight (every outcome counted, and the data plane agrees)."""
        return self.in_flight == 0 and (self.writes_submitted == 0 or self.writer_quiet)

    @property
    def terminal(self) -> bool:
        """True once DONE, FAILED or CANCELLED."""
        return self.outcome is not None

    @property
    def src_block_ids(self) -> tuple[int, ...]:
        """This engine's blocks of KV-cache group 0."""
        return self.src_block_groups[0]

    @property
    def dst_block_ids(self) -> tuple[int, ...]:
        """Decode's blocks of KV-cache group 0."""
        return self.dst_block_groups[0]

    def set_source_blocks(self, block_ids: tuple[int, ...], group: int = 0) -> None:
        """Record this engine's blocks of `group` for tokens [0, n) (each chunk extends the list; earlier ids never
        change, except that a sliding-window group's blocks behind its window may read as null: those are never
        written from, so they are not compared)."""
        if not 0 <= group < self.group_count:
            raise ValueError(f"transfer {self.transfer_id}: KV-cache group {group} outside [0, {self.group_count})")
        known = self.src_block_groups[group]
        keep = 0 if self.group_count > 1 else min(len(block_ids), len(known))
        if block_ids[:keep] != known[:keep]:
            raise ValueError(f"transfer {self.transfer_id}: source blocks changed under a live push")
        if len(block_ids) > len(known):
            self.src_block_groups[group] = tuple(block_ids)

    def mark_ready(self, layer: int, tokens_ready: int) -> None:
        """Tokens [0, tokens_ready) of `layer` are computed (monotonic; clamps to the prompt)."""
        if not 0 <= layer < self.layer_count:
            raise ValueError(f"layer {layer} out of range [0, {self.layer_count})")
        tokens_ready = min(tokens_ready, self.prompt_token_count)
        if tokens_ready > self.tokens_ready[layer]:
            self.tokens_ready[layer] = tokens_ready
            self._layers_to_plan.add(layer)

    def set_instruction(self, peer_agent: str, dst_block_ids: tuple[int, ...], skip_token_count: int,
                        prompt_token_count: int, notification: bytes, dst_block_size_tokens: int = 0,
                        dst_block_groups: dict[int, tuple[tuple[int, ...], int]] | None = None) -> None:
        """Record where to write; raise ValueError if it cannot fit this transfer.

        dst_block_size_tokens: decode's block size (0: this engine's), which `dst_block_ids` count in.
        dst_block_groups: per KV-cache group, decode's blocks and the group's first token (several groups; then
        `dst_block_ids` is ignored). Every group of this engine's layers must be there.
        """
        if self.has_instruction:
            raise ValueError(f"transfer {self.transfer_id} already has an instruction")
        if not peer_agent:
            raise ValueError("instruction has no decode agent")
        if prompt_token_count != self.prompt_token_count:
            raise ValueError(
                f"decode expects {prompt_token_count} prompt tokens, this prefill computes {self.prompt_token_count}")
        if not 0 <= skip_token_count <= self.prompt_token_count:
            raise ValueError(f"skip_token_count {skip_token_count} outside [0, {self.prompt_token_count}]")
        dst_block_size = dst_block_size_tokens or self.block_size_tokens
        if dst_block_size < 0:
            raise ValueError(f"decode block size {dst_block_size} is negative")
        dst_blocks = -(-self.prompt_token_count // dst_block_size)
        groups = dst_block_groups if dst_block_groups is not None else {0: (tuple(dst_block_ids), 0)}
        if self.group_count > 1 and dst_block_groups is None:
            raise ValueError(f"this engine's layers are in {self.group_count} KV-cache groups; the instruction "
                             "has no decode_block_groups")
        if dst_block_groups is not None and len(dst_block_groups) != self.group_count:
            # Otherwise one group's layers would be written into another's blocks (null ones included).
            raise ValueError(f"decode's layers are in {len(dst_block_groups)} KV-cache groups, this engine's in "
                             f"{self.group_count}")
        missing = [group for group in range(self.group_count) if group not in groups]
        if missing:
            raise ValueError(f"the instruction has no decode blocks for KV-cache groups {missing}")
        group_first_tokens = [0] * self.group_count
        for group in range(self.group_count):
            block_ids, first_token = groups[group]
            if group in self.state_group_block_sizes:
                if first_token or len(block_ids) <= self._state_block_index(group):
                    raise ValueError(f"state group {group}: decode's {len(block_ids)} blocks (first_token "
                                     f"{first_token}) do not hold the state after token {self.prompt_token_count} "
                                     f"(blocks of {self.state_group_block_sizes[group]} tokens)")
                continue
            if not 0 <= first_token <= self.prompt_token_count or first_token % dst_block_size:
                raise ValueError(f"KV-cache group {group}: first_token {first_token} is not a multiple of "
                                 f"{dst_block_size} in [0, {self.prompt_token_count}]")
            if len(block_ids) < dst_blocks:
                raise ValueError(f"{len(block_ids)} decode blocks of {dst_block_size} tokens cannot hold "
                                 f"{self.prompt_token_count} tokens (KV-cache group {group})")
            group_first_tokens[group] = first_token
        self.peer_agent = peer_agent
        self.dst_block_size_tokens = dst_block_size
        self.dst_block_groups = [tuple(groups[group][0][:self._group_blocks(group, dst_blocks)])
                                 for group in range(self.group_count)]
        self.skip_token_count = skip_token_count
        self.notification = notification
        self.layer_skip_tokens = [max(skip_token_count, group_first_tokens[group]) for group in self.layer_groups]
        # A state layer owes its one write unless decode's hit covers the whole prompt (module docstring).
        for layer in self.state_layers:
            self.layer_skip_tokens[layer] = skip_token_count if skip_token_count >= self.prompt_token_count else 0
        self._blocks_planned = [skip // self.block_size_tokens for skip in self.layer_skip_tokens]
        self._layers_fully_planned = sum(1 for first in self._blocks_planned if first >= self.total_blocks)
        self._layers_to_plan = set(range(self.layer_count))

    def _state_block_index(self, group: int) -> int:
        """The block of state group `group` holding the state after the prompt's last token."""
        return (self.prompt_token_count - 1) // self.state_group_block_sizes[group]

    def _group_blocks(self, group: int, attention_blocks: int) -> int:
        """How many of a group's blocks a push uses: a state group's up to its state block."""
        if group in self.state_group_block_sizes:
            return self._state_block_index(group) + 1
        return attention_blocks

    # ---------------------------------------------------------------- planning

    def _writable_blocks(self, layer: int) -> int:
        ready = self.tokens_ready[layer]
        if ready >= self.prompt_token_count:
            return self.total_blocks
        return ready // self.block_size_tokens

    def next_writes(self) -> list[PlannedWrite]:
        """Writes that became possible since the last call (empty without an instruction or once stopped)."""
        if self.terminal or not self.has_instruction:
            return []
        writes: list[PlannedWrite] = []
        layers, self._layers_to_plan = sorted(self._layers_to_plan), set()
        for layer in layers:
            if layer in self.state_layers:
                write = self._state_write(layer)
                if write is not None:
                    writes.append(write)
                continue
            start_block = self._blocks_planned[layer]
            end_block = self._writable_blocks(layer)
            if end_block <= start_block:
                continue
            token_start = max(start_block * self.block_size_tokens, self.layer_skip_tokens[layer])
            token_end = min(end_block * self.block_size_tokens, self.prompt_token_count)
            self._blocks_planned[layer] = end_block
            if end_block >= self.total_blocks:
                self._layers_fully_planned += 1
            if token_end <= token_start:
                continue
            group = self.layer_groups[layer]
            src_block_ids = self.src_block_groups[group]
            if len(src_block_ids) < end_block:
                raise ValueError(f"transfer {self.transfer_id}: no source block ids for tokens up to {token_end}"
                                 + (f" (KV-cache group {group})" if self.group_count > 1 else ""))
            self.planned_ranges[layer].append((token_start, token_end))
            dst_end_block = -(-token_end // self.dst_block_size_tokens)
            writes.append(PlannedWrite(layer, token_start, token_end, src_block_ids[:end_block],
                                       self.dst_block_groups[group][:dst_end_block], notify=False))
        if writes and self._all_planned():
            last = writes[-1]
            writes[-1] = dataclasses.replace(last, notify=True)
            self._notify_planned = True
        self._writes_planned += len(writes)
        for write in writes:
            self._layer_writes_in_flight[write.layer] += 1
        return writes

    def _state_write(self, layer: int) -> PlannedWrite | None:
        """A state layer's one write, once it computed the whole prompt (never for an earlier chunk: the state is
        final only after the last one); None before, after it was planned, or when nothing is owed."""
        if self._blocks_planned[layer] >= self.total_blocks or self.tokens_ready[layer] < self.prompt_token_count:
            return None
        self._blocks_planned[layer] = self.total_blocks
        self._layers_fully_planned += 1
        if self.layer_skip_tokens[layer] >= self.prompt_token_count:
            return None
        group = self.layer_groups[layer]
        index = self._state_block_index(group)
        src_block_ids = self.src_block_groups[group]
        if len(src_block_ids) <= index:
            raise ValueError(f"transfer {self.transfer_id}: no source state block for token "
                             f"{self.prompt_token_count} (KV-cache group {group})")
        self.planned_ranges[layer].append((0, self.prompt_token_count))
        return PlannedWrite(layer, 0, self.prompt_token_count, (src_block_ids[index],),
                            (self.dst_block_groups[group][index],), notify=False, state=True)

    def _all_planned(self) -> bool:
        return self._layers_fully_planned == self.layer_count

    def nothing_to_write(self) -> bool:
        """True when the instruction leaves nothing to push (decode's prefix hit covers the prompt)."""
        return self.has_instruction and min(self.layer_skip_tokens) >= self.prompt_token_count

    # ---------------------------------------------------------------- outcomes

    def write_submitted(self) -> None:
        """The data plane accepted one planned write."""
        self.writes_submitted += 1

    def writer_is_quiet(self) -> None:
        """The data plane reported that none of this transfer's handles is in flight."""
        self.writer_quiet = True

    def write_started(self, start_time: float, layer: int | None = None) -> None:
        """Record a post of `layer` (when known): the earliest is the first write start, a layer keeps its latest."""
        if self.timeline.first_write_start_time is None or start_time < self.timeline.first_write_start_time:
            self.timeline.first_write_start_time = start_time
        if layer is not None and 0 <= layer < self.layer_count:
            last = self._layer_last_post_time[layer]
            self._layer_last_post_time[layer] = start_time if last is None else max(last, start_time)

    def write_finished(self, outcome: PushOutcome, error: str = "", end_time: float | None = None,
                       post_duration_seconds: float = 0.0, descriptor_count: int = 0, bytes_written: int = 0,
                       layer: int | None = None, cause: StopCause = StopCause.WRITE_FAILED) -> None:
        """Count one planned write's outcome (of `layer`, when known); the first failure makes the transfer FAILED."""
        end_time = time.time() if end_time is None else end_time
        if self.in_flight <= 0:
            raise AssertionError(f"transfer {self.transfer_id}: more outcomes than writes")
        self._writes_finished += 1
        ok = outcome is PushOutcome.DONE
        if layer is not None and 0 <= layer < self.layer_count and self._layer_writes_in_flight[layer] > 0:
            self._layer_writes_in_flight[layer] -= 1
            if ok:
                last = self._layer_last_end_time[layer]
                self._layer_last_end_time[layer] = end_time if last is None else max(last, end_time)
        if not ok:
            self.stop(PushStop(cause, error or "write failed"))
            return
        self._writes_landed += 1
        timeline = self.timeline
        timeline.write_count += 1
        timeline.post_duration_s += post_duration_seconds
        timeline.descriptor_count += descriptor_count
        timeline.bytes_written += bytes_written
        timeline.write_end_times.append(end_time)
        if timeline.last_write_end_time is None or end_time > timeline.last_write_end_time:
            timeline.last_write_end_time = end_time
        if self.outcome is None and self._notify_planned and self._writes_landed == self._writes_planned:
            self.outcome = PushOutcome.DONE

    def prefill_ended(self, end_time: float) -> None:
        """Record when the last layer of the last chunk was computed."""
        if self.timeline.prefill_end_time is None:
            self.timeline.prefill_end_time = end_time

    def finalize_timeline(self) -> PushTimeline:
        """Fill the derived counts and the state, and return the timeline (owned by this object)."""
        timeline = self.timeline
        end = timeline.prefill_end_time
        if end is not None:
            timeline.writes_before_prefill_end_count = sum(1 for t in timeline.write_end_times if t < end)
            timeline.layers_written_before_prefill_end_count = sum(
                1 for layer in range(self.layer_count) if self._layer_written(layer)
                and (self._layer_last_end_time[layer] or end) < end)
        timeline.layer_write_end_times = {layer: end for layer, end in enumerate(self._layer_last_end_time)
                                          if end is not None}
        timeline.layer_write_post_times = {layer: post for layer, post in enumerate(self._layer_last_post_time)
                                           if post is not None and layer in timeline.layer_write_end_times}
        timeline.state = PUSH_ACTIVE if self.outcome is None else self.outcome.value
        timeline.reason = self.reason
        return timeline

    def _layer_written(self, layer: int) -> bool:
        """Every write this layer owes was planned and landed, and at least one was made."""
        return (bool(self._blocks_planned) and self._blocks_planned[layer] >= self.total_blocks
                and self._layer_writes_in_flight[layer] == 0 and self._layer_last_end_time[layer] is not None)

    def stop(self, stop: PushStop) -> None:
        """End the push (first stop wins; DONE only with nothing to write); later outcomes still count in_flight."""
        if self.outcome is None:
            self.outcome = stop.outcome
            self.stopped_by = stop

    def abandon_in_flight(self) -> None:
        """Give up on writes the data plane never reported (past every bound): count them as failed, now quiet."""
        if self.in_flight:
            self.stop(PushStop(StopCause.UNREPORTED_WRITES,
                               f"{self.in_flight} writes never reported by the data plane"))
        self._writes_abandoned += self.in_flight
        self._layer_writes_in_flight = [0] * self.layer_count
        self.writer_quiet = True

    def layers_written(self) -> int:
        """Layers fully written for every token owed (for progress reports)."""
        if not self.has_instruction:
            return 0
        return sum(1 for planned in self._blocks_planned if planned >= self.total_blocks) if self.in_flight == 0 else 0
