"""Prefill engine, scheduler half: turns vLLM's scheduling decisions into per-step prefill chunks.

Life cycle of a prefill-leg request (kv_transfer_params: transfer_id + do_remote_decode) here:
  1. `on_new_request`: the request is tracked under its transfer id (malformed params: logged, left local).
  2. `build_connector_meta`, every step it is scheduled: a `PrefillChunk` says which prompt tokens this
     step computes and which blocks hold tokens [0, token_end). The request's block ids come from the
     step's `SchedulerOutput` (new requests carry all of them, running ones the blocks added this step),
     which every supported vLLM release fills the same way (`kvpush.connector.compat`). The first chunk also
     says how many tokens came from this engine's prefix cache (ready at once, never recomputed, still pushed).
  3. `request_finished`: if any chunk went to the workers, return (True, params): vLLM keeps the
     blocks until the workers report the request in finished_sending (pushes done, failed, cancelled or
     timed out). The params carry the transfer id and the push timeline known so far. A leg with
     `first_token_from_prefill` also hands the workers the token it sampled after the prompt (with the
     hold, in the next step's metadata): the transfer's DONE result carries it to the directory, which
     passes it to decode with the COMPLETE event.
  4. `update_connector_output`: finished_sending releases the hold; worker timelines are merged.
`has_pending_push_work` is True while any hold is open, so the engine keeps stepping (and the workers
keep reporting) after its last request finished. Nothing here touches the network.

Hybrid SSM models (state groups): decode recomputes the prompt's last token on top of the pushed state (vLLM
always recomputes the last prompt token after a full load), so the state must be the one after all but that token.
`on_new_request` drops a prefill leg's last prompt token (as vLLM's own NIXL and Mooncake connectors do), so the
whole push, attention and state, covers the prompt minus one; decode's half asks for that many. The token such a
leg samples is then not decode's first token, so `first_token_from_prefill` is not honoured for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpush.api import params as transfer_params
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.metadata import KVPushMetadata, KVPushWorkerMetadata, PrefillChunk, TimelineReport, combine_ranks
from kvpush.connector.worker.push_state import PushTimeline
from kvpush.observability import get_logger

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

_log = get_logger("connector.scheduler.prefill")

# Keys of the push timeline the workers report (PushTimeline.as_dict, combined over ranks): every response's push
# timeline has them all, None until known.
_TIMELINE_KEYS = tuple(PushTimeline().as_dict())


@dataclass
class _TrackedPrefill:
    """What the scheduler half remembers about one prefill-leg request."""

    request: Request
    transfer_id: str
    traceparent: str
    chunks_sent: int = 0
    preempted: bool = False
    block_ids: list[int] = field(default_factory=list)  # the request's blocks, as of this step (group 0)
    # With several KV-cache groups, every group's blocks (block_groups[0] is block_ids); else empty.
    block_groups: list[list[int]] = field(default_factory=list)
    sends_first_token: bool = False  # first_token_from_prefill: DONE carries the token sampled after the prompt
    plan_in_flight: bool = False  # the leg came before its PlanTransfer returned: readiness says so
    # The response's push timeline, as far as this half measured it: its first chunk (when, and how many prompt
    # tokens came from this engine's prefix cache), and the workers' timelines combined over ranks.
    prefill_start_time: float | None = None
    cached_token_count: int = 0
    push: TimelineReport | None = None

    def response_timeline(self, finished_time: float) -> dict[str, object]:
        """The response's push timeline (kv_transfer_params.push_timeline): the JSON users see."""
        # Every key the workers may fill is present from the start, so a late merge never resizes the dict.
        timeline: dict[str, object] = {key: None for key in _TIMELINE_KEYS}
        if self.push is not None:
            timeline.update(self.push.json_fields())
        if self.chunks_sent:
            timeline.update(prefill_start_time=self.prefill_start_time, cached_token_count=self.cached_token_count,
                            chunk_count=self.chunks_sent)
        timeline["request_finished_time"] = finished_time
        return timeline


class PrefillScheduler:
    """Scheduler half for kv_role=kv_producer. See the module docstring for the life cycle."""

    def __init__(self, config: ConnectorConfig, block_size_tokens: int,
                 state_group_block_sizes: dict[int, int] | None = None) -> None:
        self._config = config
        self._block_size_tokens = block_size_tokens
        # State groups (hybrid SSM models) and the tokens one of their blocks covers (module docstring).
        self._state_group_block_sizes = dict(state_group_block_sizes or {})
        self._tracked: dict[str, _TrackedPrefill] = {}
        # Requests whose blocks we hold for pushes, until finished_sending.
        self._held: dict[str, float] = {}
        # The push timelines inside the kv_transfer_params handed to vLLM for held requests: vLLM serializes the
        # response only after update_from_output returns, so timelines the workers report in that same step still land.
        self._response_timelines: dict[str, dict[str, object]] = {}
        self._newly_held: list[str] = []
        self._newly_held_first_tokens: dict[str, int] = {}
        # Each rank's latest push timeline of a request, until its blocks are released.
        self._rank_timelines: dict[str, dict[int, TimelineReport]] = {}
        # post_after_output, where the worker half shares this process (output_signal): the steps built, and those
        # whose output was processed (vLLM processes each built step once, in order), and the worker's callback.
        self._step_seq = 0
        self._processed_step_seq = 0
        self.on_output_leaving: Callable[[int], None] | None = None

    def on_new_request(self, request: Request) -> None:
        """Track a prefill-leg request by its transfer id."""
        try:
            params = transfer_params.parse(request.kv_transfer_params)
        except transfer_params.TransferParamsError as exc:
            _log.error("kv_transfer_params refused; request runs without a push", request_id=request.request_id,
                       error=str(exc))
            return
        if params is None or not params.is_prefill_leg:
            return
        sends_first_token = params.first_token_from_prefill
        if self._state_group_block_sizes and drop_last_prompt_token(request):
            if sends_first_token:
                _log.warning("first_token_from_prefill is not honoured on a hybrid SSM model: prefill stops one "
                             "token short of the prompt", request_id=request.request_id)
            sends_first_token = False
        self._tracked[request.request_id] = _TrackedPrefill(request, params.transfer_id, params.traceparent,
                                                            sends_first_token=sends_first_token,
                                                            plan_in_flight=params.plan_in_flight)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """A prefill engine never loads external KV."""
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Nothing to do: a prefill engine loads no external KV (its chunks' blocks come with each step)."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVPushMetadata:
        """Describe this step's prefill chunks, new holds and preemptions for the workers."""
        self._step_seq += 1
        meta = KVPushMetadata(empty_step=scheduler_output.total_num_scheduled_tokens == 0, step_seq=self._step_seq)
        self._response_timelines.clear()  # responses of earlier steps are being serialized: hands off
        for request_id in scheduler_output.preempted_req_ids or ():
            tracked = self._tracked.get(request_id)
            if tracked is not None and tracked.chunks_sent:
                tracked.preempted = True
                meta.preempted.append(request_id)
        if self._tracked:
            self._track_block_ids(scheduler_output)
            self._add_chunks(scheduler_output, meta)
        meta.held_prefills, self._newly_held = self._newly_held, []
        meta.first_tokens, self._newly_held_first_tokens = self._newly_held_first_tokens, {}
        return meta

    def step_output_processed(self) -> None:
        """The oldest unprocessed step's output is leaving (update_from_output's last connector call): tell the
        in-process worker half, whose launch-bound steps push only then."""
        if self._processed_step_seq < self._step_seq:
            self._processed_step_seq += 1
            if self.on_output_leaving is not None:
                self.on_output_leaving(self._processed_step_seq)

    def _track_block_ids(self, scheduler_output: SchedulerOutput) -> None:
        """Bring each tracked request's block ids up to this step, per KV-cache group."""
        for new_request in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new_request.req_id)
            if tracked is not None:
                tracked.block_ids = list(new_request.block_ids[0])
                if len(new_request.block_ids) > 1:
                    tracked.block_groups = [tracked.block_ids, *(list(ids) for ids in new_request.block_ids[1:])]
        cached = scheduler_output.scheduled_cached_reqs
        # vLLM 0.25-0.33 name resumed requests here; 0.34 sends them in scheduled_new_reqs, whole table (above).
        resumed = getattr(cached, "resumed_req_ids", None) or ()
        for request_id, new_block_ids in zip(cached.req_ids, cached.new_block_ids):
            tracked = self._tracked.get(request_id)
            if tracked is None or new_block_ids is None:
                continue
            if request_id in resumed:  # back from preemption: the list replaces the old blocks
                tracked.block_ids = list(new_block_ids[0])
                if len(new_block_ids) > 1:
                    tracked.block_groups = [tracked.block_ids, *(list(ids) for ids in new_block_ids[1:])]
            else:
                tracked.block_ids.extend(new_block_ids[0])
                for group_ids, new_ids in zip(tracked.block_groups[1:], new_block_ids[1:]):
                    group_ids.extend(new_ids)

    def _add_chunks(self, scheduler_output: SchedulerOutput, meta: KVPushMetadata) -> None:
        now = time.time()
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            tracked = self._tracked.get(request_id)
            if tracked is None or tracked.preempted:
                continue
            request = tracked.request
            prompt_tokens = request.num_prompt_tokens
            token_start = request.num_computed_tokens  # build_connector_meta runs before vLLM advances it
            if token_start >= prompt_tokens:
                continue  # a decode step: nothing of the prompt left to push
            token_end = min(token_start + num_tokens, prompt_tokens)
            block_ids = tracked.block_ids
            needed = [self._blocks_for(group, token_end) for group in range(max(1, len(tracked.block_groups)))]
            needed_blocks = needed[0]
            short = any(len(ids) < n for ids, n in zip(tracked.block_groups, needed, strict=False))
            if len(block_ids) < needed_blocks or short:  # never seen; pushing would read blocks we cannot name
                _log.error("scheduler output lacks the request's block ids; its push stops here",
                           request_id=request_id, transfer_id=tracked.transfer_id, token_end=token_end,
                           block_count=len(block_ids), block_size_tokens=self._block_size_tokens)
                tracked.preempted = True
                if tracked.chunks_sent:
                    meta.preempted.append(request_id)  # the workers drop what they hold of it
                continue
            meta.prefill_chunks.append(PrefillChunk(
                request_id=request_id, transfer_id=tracked.transfer_id, token_start=token_start,
                token_end=token_end, prompt_token_count=prompt_tokens,
                block_ids=tuple(block_ids[:needed_blocks]),
                cached_token_count=token_start if tracked.chunks_sent == 0 else 0,
                trace_context=tracked.traceparent, sends_first_token=tracked.sends_first_token,
                plan_in_flight=tracked.plan_in_flight,
                block_groups=tuple(tuple(ids[:n]) for ids, n in zip(tracked.block_groups, needed, strict=False)),
            ))
            if tracked.chunks_sent == 0:
                tracked.prefill_start_time = now
                tracked.cached_token_count = token_start
            tracked.chunks_sent += 1

    def _blocks_for(self, group: int, token_end: int) -> int:
        """A group's blocks holding tokens [0, token_end): a state group's up to the one with the latest state."""
        state_block_size = self._state_group_block_sizes.get(group)
        if state_block_size is not None:
            return (token_end - 1) // state_block_size + 1
        return -(-token_end // self._block_size_tokens)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, object] | None]:
        """Hold the blocks while pushes may still read them; return the transfer id and push timeline."""
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is None:
            return False, None
        timeline = tracked.response_timeline(time.time())
        params = transfer_params.prefill_response_params(tracked.transfer_id, timeline)
        if tracked.chunks_sent == 0:
            # Nothing ever reached the workers: no write can read these blocks. The transfer ends by its TTL
            # at the directory (or decode's cancellation).
            return False, params
        _log.debug("holding blocks for pushes", request_id=request.request_id, transfer_id=tracked.transfer_id,
                   blocks=len(block_ids))
        self._held[request.request_id] = time.monotonic()
        self._newly_held.append(request.request_id)
        if tracked.sends_first_token:
            # vLLM appended the sampled token before finishing the request (max_tokens=1 on a prefill leg).
            outputs = list(request.output_token_ids or ())
            if outputs and isinstance(outputs[0], int) and outputs[0] >= 0:
                self._newly_held_first_tokens[request.request_id] = outputs[0]
        self._response_timelines[request.request_id] = timeline
        return True, params

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Release holds the workers reported done; merge their push timelines into tracked requests."""
        worker_meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(worker_meta, KVPushWorkerMetadata):
            for request_id, by_rank in worker_meta.timelines.items():
                if request_id not in self._tracked and request_id not in self._held:
                    continue  # released already: a late snapshot changes no response
                ranks = self._rank_timelines.setdefault(request_id, {})
                for rank, report in by_rank.items():
                    ranks.setdefault(rank, TimelineReport()).update(report)
                combined = combine_ranks(ranks)
                tracked = self._tracked.get(request_id)
                if tracked is not None:
                    tracked.push = combined
                response_timeline = self._response_timelines.get(request_id)
                if response_timeline is not None:
                    response_timeline.update(combined.json_fields())
        # Only the step that finished a request can still change its response; later timelines are logged.
        self._response_timelines.clear()
        for request_id in connector_output.finished_sending or ():
            _log.debug("blocks released", request_id=request_id)
            self._held.pop(request_id, None)
            self._rank_timelines.pop(request_id, None)

    def has_pending_push_work(self) -> bool:
        """True while any finished request's blocks are held for pushes."""
        return bool(self._held or self._newly_held)

    def held_request_count(self) -> int:
        """How many finished requests still hold blocks for pushes (for tests and metrics)."""
        return len(self._held)


def drop_last_prompt_token(request: Request) -> bool:
    """Make a hybrid model's prefill leg compute all but its last prompt token (module docstring); False (nothing
    changed) for a one-token prompt. The request is vLLM's own, not yet scheduled: its prompt, all-token list and
    prompt count lose that token together, and at most one sampled token remains to make."""
    if request.num_prompt_tokens <= 1 or request.prompt_token_ids is None:
        return False
    request.prompt_token_ids.pop()
    request._all_token_ids.pop()  # vLLM keeps prompt and output tokens here, with no setter
    request.num_prompt_tokens -= 1
    request.max_tokens = 1
    return True
