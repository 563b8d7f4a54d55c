"""Typed metadata between the connector's scheduler half and its worker halves.

Life cycle, once per engine step:
  1. The scheduler half builds a `KVPushMetadata` in `build_connector_meta` (scheduler process).
  2. vLLM ships it to every worker process (pickled by the executor) and binds it before the forward.
  3. The worker half reads it in `start_load_kv` / `save_kv_layer` / `get_transfer_results`.
  4. After the step the worker may return a `KVPushWorkerMetadata` (push timelines, by rank); vLLM
     aggregates the ranks' objects and hands the result to the scheduler half's `update_connector_output`.

Everything here is plain data (dataclasses of str/int/float/lists, and `PushTimeline`s), so any executor can move
it (some pickle it between processes).
`WIRE_VERSION` changes whenever a field changes meaning; a worker refuses metadata of another version
(scheduler and workers of one engine always run the same code, so a mismatch is a deployment bug).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvpush.connector.worker.push_state import PushTimeline, TimelineValue

# Wire version history:
#   1: prefill chunks, decode receives, decode cancellations, prefill holds, preemptions; worker timings.
#   2: worker timelines keyed by request, then TP rank (PushTimeline fields), combined by the scheduler.
#   3: first token from prefill: chunks say whether the transfer reports it, holds carry it, receives say
#      whether they wait for it, decode workers report it.
#   4: worker timelines are TimelineReports (a PushTimeline, and the hook's prefill end); a receive's skipped
#      prefix is skip_token_count.
WIRE_VERSION = 4


@dataclass(frozen=True)
class PrefillChunk:
    """One prefill step of one request on a prefill engine: tokens [token_start, token_end) computed now.

    cached_token_count is set on the request's first chunk only: tokens [0, cached_token_count) came
    from this engine's prefix cache (possibly from blocks another request computes in this same step).
    block_ids are the engine's blocks holding tokens [0, token_end), in token order (KV-cache group 0);
    block_groups, with several KV-cache groups, every group's (block_groups[0] == block_ids); else empty.
    """

    request_id: str
    transfer_id: str
    token_start: int
    token_end: int
    prompt_token_count: int
    block_ids: tuple[int, ...]
    cached_token_count: int = 0
    trace_context: str = ""
    # The transfer's DONE result waits for the token this request samples after the prompt, and carries it.
    sends_first_token: bool = False
    # The directory may not know the transfer yet (the leg came before its plan returned): readiness says so.
    plan_in_flight: bool = False
    block_groups: tuple[tuple[int, ...], ...] = ()

    @property
    def is_last(self) -> bool:
        """True when this chunk completes the prompt."""
        return self.token_end >= self.prompt_token_count


@dataclass(frozen=True)
class ReceiveStart:
    """A decode request now waits for pushed KV into block_ids (tokens [skip_token_count, prompt)).

    skip_token_count: decode's own (block-aligned) prefix hit, which the push skips.
    """

    request_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    prompt_token_count: int
    skip_token_count: int
    trace_context: str = ""
    # The receive completes only with prefill's first token (the directory's COMPLETE event carries it).
    awaits_first_token: bool = False

    def pushed_block_ids(self, block_size_tokens: int) -> tuple[int, ...]:
        """The blocks the push writes (those after decode's own prefix hit): the ones a failure invalidates."""
        first = self.skip_token_count // block_size_tokens
        last = -(-self.prompt_token_count // block_size_tokens)
        return self.block_ids[first:last]


def compatibility_hash(*, model: str, dtype: str, cache_dtype: str, kv_layout: str, num_kv_heads: int,
                       head_size: int, layer_count: int, vllm_version: str) -> str:
    """A short hash over everything that makes one engine's KV unreadable by another (KVLayout.compatibility_hash).

    Every engine sets it at registration; the directory pairs a prefill and a decode engine only when equal. The
    block size is not in it: it is a registered field of its own, and token-addressable layouts of different block
    sizes pair (the directory's planning decides, `planning._block_size_mapping`).
    """
    factors = dict(model=model, dtype=dtype, cache_dtype=cache_dtype, kv_layout=kv_layout, num_kv_heads=num_kv_heads,
                   head_size=head_size, layer_count=layer_count, vllm_version=vllm_version)
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class KVPushMetadata(KVConnectorMetadata):
    """Scheduler → worker data for one step.

    prefill_chunks: chunks computed this step (prefill engines).
    held_prefills: request ids whose blocks the scheduler now holds for pushes (request_finished returned True);
        the worker reports each in finished_sending exactly once.
    first_tokens: for held requests whose chunks said `sends_first_token`, the token each sampled after its
        prompt (absent: it finished without one, e.g. aborted); the transfer's DONE result carries it.
    preempted: request ids preempted this step; their transfers fail (their blocks were freed).
    receives: decode requests that started waiting for pushed KV this step.
    cancelled_receives: decode requests aborted while waiting; reported finished once the transfer is terminal.
    failed_receives: decode requests whose allocation report the directory refused, with the reason; the
        worker reports them as load failures at once.
    """

    wire_version: int = WIRE_VERSION
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)
    held_prefills: list[str] = field(default_factory=list)
    first_tokens: dict[str, int] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    receives: list[ReceiveStart] = field(default_factory=list)
    cancelled_receives: list[str] = field(default_factory=list)
    failed_receives: list[tuple[str, str]] = field(default_factory=list)
    # True when the step schedules no tokens (vLLM still runs the connector hooks).
    empty_step: bool = False
    # (free blocks, running requests, waiting requests) as the scheduler saw them this step; the worker
    # reports the latest with each lease renewal (EngineLoad). None: unknown (no block pool bound).
    engine_load: tuple[int, int, int] | None = None
    # The prefill scheduler's count of the steps it built (post_after_output: which step's output left).
    step_seq: int = 0
    # Decode: legs waiting, without blocks, for their prefill's start (decode_allocation_wait_s). vLLM keeps stepping
    # while they wait, so the worker paces back-to-back empty steps as it does while receives are in flight.
    legs_awaiting_prefill: int = 0

    def is_idle(self) -> bool:
        """True when this step carries no connector work at all."""
        return not (self.prefill_chunks or self.held_prefills or self.preempted or self.receives
                    or self.cancelled_receives or self.failed_receives)


@dataclass(slots=True)
class TimelineReport:
    """What is known of one request's push timeline: one TP rank's (merged report by report, newest last), or all
    its ranks' together (`combine_ranks`).

    timeline: the push owner's latest snapshot, without per-write and per-layer detail (`PushTimeline.summary`);
        None until the owner published one.
    hook_prefill_end_time: CPU: when the worker's hook saw the prompt's last layer saved. The owner may not have
        applied that layer yet when the step's worker metadata is built, and the request's response is built in
        that very step; the timeline's own prefill_end_time, once known, takes precedence.
    """

    timeline: PushTimeline | None = None
    hook_prefill_end_time: float | None = None

    @property
    def prefill_end_time(self) -> float | None:
        """When the prompt's last layer was computed, if known."""
        known = self.timeline.prefill_end_time if self.timeline is not None else None
        return known if known is not None else self.hook_prefill_end_time

    def update(self, newer: TimelineReport) -> None:
        """A newer report of the same rank: its timeline supersedes this one, except where it does not know a time
        this one does (None keeps the older time); a newer hook time replaces the older."""
        old, new = self.timeline, newer.timeline
        if new is not None:
            self.timeline = new if old is None else dataclasses.replace(
                new, first_write_start_time=_known(new.first_write_start_time, old.first_write_start_time),
                last_write_end_time=_known(new.last_write_end_time, old.last_write_end_time),
                prefill_end_time=_known(new.prefill_end_time, old.prefill_end_time))
        if newer.hook_prefill_end_time is not None:
            self.hook_prefill_end_time = newer.hook_prefill_end_time

    def json_fields(self) -> dict[str, TimelineValue]:
        """The response's push timeline keys that are known, with their values (the JSON users see)."""
        fields: dict[str, TimelineValue] = {}
        timeline = self.timeline
        if timeline is not None and timeline.first_write_start_time is not None:
            fields["first_write_start_time"] = timeline.first_write_start_time
        if timeline is not None and timeline.last_write_end_time is not None:
            fields["last_write_end_time"] = timeline.last_write_end_time
        if self.prefill_end_time is not None:
            fields["prefill_end_time"] = self.prefill_end_time
        if timeline is not None:
            fields.update(post_duration_s=timeline.post_duration_s, write_count=timeline.write_count,
                          descriptor_count=timeline.descriptor_count, bytes_written=timeline.bytes_written,
                          writes_before_prefill_end_count=timeline.writes_before_prefill_end_count,
                          layers_written_before_prefill_end_count=timeline.layers_written_before_prefill_end_count,
                          settled=timeline.settled, state=timeline.state, reason=timeline.reason)
        return fields


def _known(newer: float | None, older: float | None) -> float | None:
    return newer if newer is not None else older


@dataclass
class KVPushWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker → scheduler data for one step: the push timelines that changed, by request id, then TP rank
    (prefill), and the first tokens that came with completed receives, by request id (decode).

    A rank's `TimelineReport` is a snapshot: a later one of the same rank supersedes it (`TimelineReport.update`).
    `aggregate` only unions the ranks' entries; what the ranks mean together is `combine_ranks`.
    """

    timelines: dict[str, dict[int, TimelineReport]] = field(default_factory=dict)
    # Decode: request id -> prefill's first token, reported with (or before) the request's finished_recving.
    first_tokens: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Add another rank's timelines and first tokens to these (each rank's entry kept as it is)."""
        if not isinstance(other, KVPushWorkerMetadata):
            return self
        for request_id, token in other.first_tokens.items():
            self.first_tokens.setdefault(request_id, token)  # every rank got the same COMPLETE event
        for request_id, by_rank in other.timelines.items():
            mine = self.timelines.setdefault(request_id, {})
            for rank, report in by_rank.items():
                mine.setdefault(rank, TimelineReport()).update(report)
        return self


def combine_ranks(by_rank: dict[int, TimelineReport]) -> TimelineReport:
    """The transfer's push timeline from its ranks' (each rank writes its own heads of every block): earliest
    start, latest ends, summed counts and bytes, the fewest layers written before prefill end (a layer is written
    once every rank wrote its share of it), settled once every rank is, and the worst state (with its reason).
    Ranks the owner has not reported a timeline of yet add only their prefill end."""
    ranks = [by_rank[rank] for rank in sorted(by_rank)]
    ends = [end for end in (rank.prefill_end_time for rank in ranks) if end is not None]
    prefill_end_time = max(ends) if ends else None
    timelines = [rank.timeline for rank in ranks if rank.timeline is not None]
    if not timelines:
        return TimelineReport(hook_prefill_end_time=prefill_end_time)
    starts = [t.first_write_start_time for t in timelines if t.first_write_start_time is not None]
    last_ends = [t.last_write_end_time for t in timelines if t.last_write_end_time is not None]
    worst = max(timelines, key=lambda t: _state_severity(t.state))
    return TimelineReport(PushTimeline(
        first_write_start_time=min(starts) if starts else None,
        last_write_end_time=max(last_ends) if last_ends else None,
        prefill_end_time=prefill_end_time,
        post_duration_s=sum(t.post_duration_s for t in timelines),
        write_count=sum(t.write_count for t in timelines),
        descriptor_count=sum(t.descriptor_count for t in timelines),
        bytes_written=sum(t.bytes_written for t in timelines),
        writes_before_prefill_end_count=sum(t.writes_before_prefill_end_count for t in timelines),
        layers_written_before_prefill_end_count=min(t.layers_written_before_prefill_end_count for t in timelines),
        state=worst.state, reason=worst.reason,
        settled=all(t.settled for t in timelines)))  # the push ended everywhere only once every rank settled it


def combine_rank_timelines(by_rank: dict[int, TimelineReport]) -> dict[str, TimelineValue]:
    """The ranks' combined push timeline as the response's JSON keys that are known (`combine_ranks`)."""
    return combine_ranks(by_rank).json_fields()


def _state_severity(state: str) -> int:
    from kvpush.api.outcome import PushOutcome

    try:
        return PushOutcome(state).severity
    except ValueError:  # "active": not ended yet
        return 0
