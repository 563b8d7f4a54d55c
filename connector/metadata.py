"""Typed metadata between the connector's scheduler half and its worker halves.

Life cycle, once per engine step:
  1. The scheduler half builds a `KVPushMetadata` in `build_connector_meta` (scheduler process).
  2. vLLM ships it to every worker process (pickled by the executor) and binds it before the forward.
  3. The worker half reads it in `start_load_kv` / `save_kv_layer` / `get_transfer_results`.
  4. After the step the worker may return a `KVPushWorkerMetadata` (push timings); vLLM aggregates
     the ranks' objects and hands the result to the scheduler half's `update_connector_output`.

Everything here is plain data (dataclasses of str/int/float/lists), so any executor can move it.
`WIRE_VERSION` changes whenever a field changes meaning; a worker refuses metadata of another version
(scheduler and workers of one engine always run the same code, so a mismatch is a deployment bug).
"""

from __future__ import annotations

import hashlib
import json

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

# Wire version history:
#   1: prefill chunks, decode receives, decode cancellations, prefill holds, preemptions; worker timings.
WIRE_VERSION = 1


@dataclass(frozen=True)
class PrefillChunk:
    """One prefill step of one request on a prefill engine: tokens [token_start, token_end) computed now.

    cached_token_count is set on the request's first chunk only: tokens [0, cached_token_count) came
    from this engine's prefix cache (possibly from blocks another request computes in this same step).
    block_ids are the engine's blocks holding tokens [0, token_end), in token order.
    """

    request_id: str
    transfer_id: str
    token_start: int
    token_end: int
    prompt_token_count: int
    block_ids: tuple[int, ...]
    cached_token_count: int = 0
    trace_context: str = ""

    @property
    def is_last(self) -> bool:
        """True when this chunk completes the prompt."""
        return self.token_end >= self.prompt_token_count


@dataclass(frozen=True)
class ReceiveStart:
    """A decode request now waits for pushed KV into block_ids (tokens [prefix_hit_token_count, prompt))."""

    request_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    prompt_token_count: int
    prefix_hit_token_count: int
    trace_context: str = ""

    def pushed_block_ids(self, block_size_tokens: int) -> tuple[int, ...]:
        """The blocks the push writes (those after decode's own prefix hit): the ones a failure invalidates."""
        first = self.prefix_hit_token_count // block_size_tokens
        last = -(-self.prompt_token_count // block_size_tokens)
        return self.block_ids[first:last]


def compatibility_hash(*, model: str, dtype: str, cache_dtype: str, kv_layout: str, num_kv_heads: int,
                       head_size: int, block_size: int, layer_count: int, vllm_version: str) -> str:
    """A short hash over everything that makes one engine's KV unreadable by another (KVLayout.compatibility_hash).

    Every engine sets it at registration; the directory pairs a prefill and a decode engine only when equal.
    """
    factors = dict(model=model, dtype=dtype, cache_dtype=cache_dtype, kv_layout=kv_layout, num_kv_heads=num_kv_heads,
                   head_size=head_size, block_size=block_size, layer_count=layer_count, vllm_version=vllm_version)
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class KVPushMetadata(KVConnectorMetadata):
    """Scheduler → worker data for one step.

    prefill_chunks: chunks computed this step (prefill engines).
    held_prefills: request ids whose blocks the scheduler now holds for pushes (request_finished returned True);
        the worker reports each in finished_sending exactly once.
    preempted: request ids preempted this step; their transfers fail (their blocks were freed).
    receives: decode requests that started waiting for pushed KV this step.
    cancelled_receives: decode requests aborted while waiting; reported finished once the transfer is terminal.
    failed_receives: decode requests whose allocation report the directory refused, with the reason; the
        worker reports them as load failures at once.
    """

    wire_version: int = WIRE_VERSION
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)
    held_prefills: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    receives: list[ReceiveStart] = field(default_factory=list)
    cancelled_receives: list[str] = field(default_factory=list)
    failed_receives: list[tuple[str, str]] = field(default_factory=list)
    # True when the step schedules no tokens (vLLM still runs the connector hooks).
    empty_step: bool = False
    # (free blocks, running requests, waiting requests) as the scheduler saw them this step; the worker
    # reports the latest with each lease renewal (EngineLoad). None: unknown (no block pool bound).
    engine_load: tuple[int, int, int] | None = None

    def is_idle(self) -> bool:
        """True when this step carries no connector work at all."""
        return not (self.prefill_chunks or self.held_prefills or self.preempted or self.receives
                    or self.cancelled_receives or self.failed_receives)


@dataclass
class KVPushWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker → scheduler data for one step: push timelines of prefill requests, by request id.

    Each timeline is a dict of plain values (unix seconds and counts), merged across ranks by taking the
    earliest start and the latest end, so the scheduler can return it in the response's kv_transfer_params.
    """

    timelines: dict[str, dict[str, Any]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Merge another rank's timelines into this one (earliest starts, latest ends, summed counts)."""
        if not isinstance(other, KVPushWorkerMetadata):
            return self
        for request_id, timeline in other.timelines.items():
            mine = self.timelines.setdefault(request_id, {})
            merge_timeline(mine, timeline)
        return self


def merge_timeline(into: dict[str, Any], other: dict[str, Any]) -> None:
    """Merge one push timeline into another in place (see KVPushWorkerMetadata)."""
    for key, value in other.items():
        if value is None:
            continue
        if key not in into or into[key] is None:
            into[key] = value
        elif key.endswith("_start_time"):
            into[key] = min(into[key], value)
        elif key.endswith("_end_time"):
            into[key] = max(into[key], value)
        elif key.endswith("_count"):
            into[key] = max(into[key], value)
        else:
            into[key] = value
