"""Decode engine, scheduler half: makes remote-prefill requests wait for pushed KV, reports their blocks.

Life cycle of a decode-leg request (kv_transfer_params: transfer_id + do_remote_prefill) here:
  0. `on_new_request`: with decode_allocation_wait_s set, the directory link starts following the transfer
     until its prefill started (the directory saw its first readiness) or it ended.
  1. `get_num_new_matched_tokens` (may run many times, no side effects): until that start is seen, and for at
     most decode_allocation_wait_s after the leg arrived, (None, False): vLLM leaves the request waiting without
     blocks and asks again next step (other waiting requests go on). Then the prompt tokens beyond decode's own
     prefix hit will arrive asynchronously -> (n, True); vLLM allocates blocks for the whole prompt and parks
     the request in WAITING_FOR_REMOTE_KVS. A full local hit never waits, nor does a leg that carries prefill's
     first token (sent after its prefill ended).
  2. `update_state_after_alloc` (first call with external tokens): submit ReportAllocation (block ids
     for the whole prompt, skip_token_count = decode's own hit, so the push skips those tokens)
     without waiting; queue a `ReceiveStart` for the workers. A refused report comes back on the
     client's thread and is queued as a failed receive for the next step's metadata (one naming a block that a
     live transfer still owns is retried until that transfer ends first: `DirectoryLink.report_allocation`).
  3. The workers report the request in finished_recving (completion, or failure with load-error blocks
     so vLLM's kv_load_failure_policy applies); `update_connector_output` forgets it. First token from
     prefill (`first_token_from_prefill` on the leg): the workers report prefill's token with (or before)
     the completion; it is written into the request's `kv_transfer_params.first_token_id` at once, before
     vLLM schedules the request's first step (the next `schedule()`), so the `ForcePrefillFirstToken`
     logits processor, which reads it when the request joins the batch, forces it.
  4. Abort while waiting: `request_finished` submits CancelTransfer and tells the workers, which report
     the request finished only once the directory confirms the transfer is terminal (no write in
     flight) or transfer_timeout_s passed; until then vLLM keeps the blocks (WAITING_FOR_REMOTE_KVS).
     Abort before allocation (waiting for prefill's start included): CancelTransfer only, so prefill stops early.
This half never waits on the network: every directory call is submitted to the link's own thread.

Hybrid SSM models (state groups): prefill pushes the state after all but the prompt's last token
(`scheduler.prefill` says why), so this half asks for the prompt minus one; vLLM then computes the last prompt token
here on top of the pushed state, as after any load. A state group's blocks are its own size (one per request when
vLLM keeps no prefix of the state), and the allocation reports the block holding the state after the pushed tokens.
vLLM does not zero the blocks of an async load (`get_loaded_kv_cache_group_ids` names every group), so the pushed
state is what the last token's step reads.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvpush.api import params as transfer_params
from kvpush.api.params import TransferParams
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.metadata import KVPushMetadata, KVPushWorkerMetadata, ReceiveStart
from kvpush.observability import get_logger

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

_log = get_logger("connector.scheduler.decode")

# vLLM's block pool hands out its null block first, so its id is 0. With the hybrid KV-cache manager, a
# sliding-window group's blocks behind the window are that null block: nothing is pushed into them.
NULL_BLOCK_ID = 0


class AllocationReporter(Protocol):
    """The directory calls the decode scheduler half makes; both return at once (work runs elsewhere)."""

    def report_allocation(self, transfer_id: str, block_ids: list[int], prompt_token_count: int,
                          skip_token_count: int, on_refused: Callable[[str], None],
                          block_groups: Sequence[tuple[Sequence[int], int]] = ()) -> None:
        """Submit ReportAllocation; call on_refused(reason) from another thread if it fails."""

    def cancel_transfer(self, transfer_id: str, reason: str) -> None:
        """Submit CancelTransfer (best effort, idempotent at the directory)."""

    def watch_prefill_start(self, transfer_id: str, on_started: Callable[[str], None]) -> None:
        """Follow the transfer; on_started(transfer_id) runs once (another thread) when its prefill started or it
        ended."""

    def forget_prefill_start(self, transfer_id: str) -> None:
        """Stop following the transfer."""


class AllocationDeferralObserver(Protocol):
    """Where the time a leg waited for its prefill's start goes (`metrics.DecodeSchedulerMetrics`)."""

    def on_allocation_deferred(self, seconds: float, ended_by: str) -> None:
        """A leg's blocks are being allocated `seconds` after it arrived; ended_by: prefill_started or wait_bound."""


@dataclass
class _Leg:
    """A remote-prefill request not yet allocated."""

    params: TransferParams
    arrived: float  # time.monotonic() when the leg arrived
    # It waits for its prefill's start (decode_allocation_wait_s), its transfer followed by the link meanwhile.
    waits: bool = False


@dataclass
class _ScheduledReceive:
    """A decode request between allocation and finished_recving."""

    transfer_id: str
    request: Request
    # The directory refused this request's allocation: it owns nothing of the transfer (another request of the
    # same transfer id may), so it never cancels it, and no write targets its blocks.
    refused: bool = False


class DecodeScheduler:
    """Scheduler half for kv_role=kv_consumer. See the module docstring for the life cycle."""

    def __init__(self, config: ConnectorConfig, block_size_tokens: int, directory: AllocationReporter,
                 group_windows: tuple[int, ...] = (), state_group_block_sizes: dict[int, int] | None = None,
                 deferrals: AllocationDeferralObserver | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._block_size_tokens = block_size_tokens
        # State groups and the tokens one of their blocks covers; with any, the push stops one token short.
        self._state_group_block_sizes = dict(state_group_block_sizes or {})
        self._recomputed_tail = 1 if self._state_group_block_sizes else 0
        # Per KV-cache group, its sliding window in tokens (0: full attention); () or one entry: one group.
        self._group_windows = group_windows
        self._directory = directory
        self._legs: dict[str, _Leg] = {}      # remote-prefill requests not yet allocated
        self._wait_s = config.decode_allocation_wait_s  # None: allocate at once
        self._deferrals = deferrals
        self._clock = clock
        # Transfer ids legs wait on, and those whose prefill started (or that ended): the link's thread adds to
        # _started, only while the id is still watched (an answer already on its way for a forgotten one is dropped).
        self._watched: set[str] = set()
        self._started: set[str] = set()
        self._started_lock = threading.Lock()
        self._receiving: dict[str, _ScheduledReceive] = {}  # allocated, not yet reported finished by the workers
        self._pending_receives: list[ReceiveStart] = []
        self._pending_cancels: list[str] = []
        # Filled from the directory client's thread; drained by build_connector_meta on the engine thread.
        self._refusals: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()

    def on_new_request(self, request: Request) -> None:
        """Remember a decode-leg request's transfer; malformed params leave it a local request."""
        try:
            params = transfer_params.parse(request.kv_transfer_params)
        except transfer_params.TransferParamsError as exc:
            _log.error("kv_transfer_params refused; decode computes the prompt itself",
                       request_id=request.request_id, error=str(exc))
            return
        if params is not None and not params.is_prefill_leg:
            # A leg that already carries prefill's first token comes after its prefill ended: nothing to wait for.
            waits = self._wait_s is not None and params.first_token_id is None
            self._legs[request.request_id] = _Leg(params, self._clock(), waits)
            if waits:
                with self._started_lock:
                    self._watched.add(params.transfer_id)
                self._directory.watch_prefill_start(params.transfer_id, self._on_prefill_started)

    def _on_prefill_started(self, transfer_id: str) -> None:
        """The link's thread: the transfer's prefill started, or it ended (a report is then refused, as before)."""
        with self._started_lock:
            if transfer_id in self._watched:
                self._started.add(transfer_id)

    def _prefill_started(self, transfer_id: str) -> bool:
        with self._started_lock:
            return transfer_id in self._started

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Prompt tokens past decode's own (block-aligned) prefix hit arrive by push, asynchronously; None
        (ask again next step, allocate nothing yet) while the leg waits for its prefill's start."""
        leg = self._legs.get(request.request_id)
        if leg is None:
            return 0, False
        remote_tokens = self._pushed_tokens(request) - num_computed_tokens
        if remote_tokens <= 0:
            return 0, False
        if self._waits_for_prefill(leg):
            return None, False
        return remote_tokens, True

    def _waits_for_prefill(self, leg: _Leg) -> bool:
        return (leg.waits and self._wait_s is not None and self._clock() - leg.arrived < self._wait_s
                and not self._prefill_started(leg.params.transfer_id))

    def _leg_done(self, request_id: str) -> _Leg | None:
        """Forget a leg (allocated or finished); stop following its transfer unless another leg waits on it."""
        leg = self._legs.pop(request_id, None)
        if leg is None or not leg.waits:
            return leg
        transfer_id = leg.params.transfer_id
        if not any(other.waits and other.params.transfer_id == transfer_id for other in self._legs.values()):
            with self._started_lock:
                self._watched.discard(transfer_id)
                self._started.discard(transfer_id)
            self._directory.forget_prefill_start(transfer_id)
        return leg

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Report the allocation to the directory (submitted, not awaited) and queue the receive for the workers."""
        pending = self._legs.get(request.request_id)
        if pending is None:
            return  # not a decode leg, or already handled (second call after the load)
        if pending.waits and num_external_tokens > 0 and self._deferrals is not None:
            started = self._prefill_started(pending.params.transfer_id)
            self._deferrals.on_allocation_deferred(self._clock() - pending.arrived,
                                                   "prefill_started" if started else "wait_bound")
        self._leg_done(request.request_id)
        leg = pending.params
        if num_external_tokens <= 0:
            # Decode computes everything itself (a full local hit, or prefix reading disabled): stop the push.
            self._directory.cancel_transfer(leg.transfer_id, "decode needs no pushed tokens")
            return
        prompt_tokens = self._pushed_tokens(request)
        skip_token_count = prompt_tokens - num_external_tokens  # decode's own (block-aligned) prefix hit
        all_groups = blocks.get_block_ids()
        needed = [self._blocks_for(group, prompt_tokens) for group in range(len(all_groups))]
        for group_block_ids, group_needed in zip(all_groups, needed, strict=True):
            if len(group_block_ids) < group_needed:
                raise RuntimeError(  # vLLM allocates the whole prompt for an async load; anything else is a bug
                    f"request {request.request_id} has {len(group_block_ids)} blocks for {prompt_tokens} prompt "
                    "tokens")
        block_ids = list(all_groups[0][:needed[0]])
        block_groups = self._block_groups(all_groups, needed) if len(all_groups) > 1 else []
        request_id = request.request_id
        self._receiving[request_id] = _ScheduledReceive(leg.transfer_id, request)
        self._pending_receives.append(ReceiveStart(
            request_id=request_id, transfer_id=leg.transfer_id, block_ids=tuple(block_ids),
            prompt_token_count=prompt_tokens, skip_token_count=skip_token_count, trace_context=leg.traceparent,
            # A hybrid model's prefill samples after all but the last prompt token: not decode's first token.
            awaits_first_token=leg.first_token_from_prefill and leg.first_token_id is None
            and not self._recomputed_tail))

        def on_refused(reason: str, request_id: str = request_id) -> None:
            self._refusals.put((request_id, reason))

        if self._received_by_another(leg.transfer_id, request_id):
            # A second leg naming a transfer this engine already receives: the directory keeps one allocation per
            # transfer, so this one fails here, before its receive could be mistaken for the other's.
            on_refused(f"transfer {leg.transfer_id} is already received by another request of this engine")
            return
        self._directory.report_allocation(leg.transfer_id, block_ids, prompt_tokens, skip_token_count, on_refused,
                                          block_groups=block_groups)

    def _pushed_tokens(self, request: Request) -> int:
        """The prompt tokens a push covers: all, or all but the last with state groups (module docstring)."""
        return max(0, request.num_prompt_tokens - self._recomputed_tail)

    def _blocks_for(self, group: int, tokens: int) -> int:
        """A group's blocks holding tokens [0, tokens): a state group's up to the one with the latest state."""
        state_block_size = self._state_group_block_sizes.get(group)
        if state_block_size is not None:
            return (tokens - 1) // state_block_size + 1
        return -(-tokens // self._block_size_tokens)

    def _block_groups(self, all_groups: tuple[list[int], ...], needed: list[int]) -> list[tuple[list[int], int]]:
        """Each group's blocks for the prompt and its first token: a sliding-window group's leading null blocks
        (behind the window of the prompt's last token) are never written."""
        groups: list[tuple[list[int], int]] = []
        for index, group_block_ids in enumerate(all_groups):
            ids = list(group_block_ids[:needed[index]])
            first_block = 0
            if index < len(self._group_windows) and self._group_windows[index] > 0:
                while first_block < len(ids) and ids[first_block] == NULL_BLOCK_ID:
                    first_block += 1
            groups.append((ids, first_block * self._block_size_tokens))
        return groups

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVPushMetadata:
        """Hand new receives, cancellations, refused allocations and how many legs wait for prefill to the workers."""
        meta = KVPushMetadata(empty_step=scheduler_output.total_num_scheduled_tokens == 0)
        if self._wait_s is not None:
            meta.legs_awaiting_prefill = sum(self._waits_for_prefill(leg) for leg in self._legs.values())
        meta.receives, self._pending_receives = self._pending_receives, []
        meta.cancelled_receives, self._pending_cancels = self._pending_cancels, []
        while True:
            try:
                request_id, reason = self._refusals.get_nowait()
            except queue.Empty:
                break
            if request_id in self._receiving:
                self._receiving[request_id].refused = True
                meta.failed_receives.append((request_id, reason))
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, object] | None]:
        """On an abort while waiting, cancel the transfer and keep the blocks until the workers confirm."""
        request_id = request.request_id
        pending = self._leg_done(request_id)
        if pending is not None:
            # Never allocated: nothing can be written here, but prefill should stop pushing (unless another request
            # of this engine received that transfer id: a duplicate leg must not end the original's transfer).
            if not self._received_by_another(pending.params.transfer_id, request_id):
                self._directory.cancel_transfer(pending.params.transfer_id, "decode request finished before allocation")
            return False, None
        receive = self._receiving.get(request_id)
        if receive is None:
            return False, None
        if receive.refused:
            del self._receiving[request_id]
            return False, None
        self._directory.cancel_transfer(receive.transfer_id, "decode request aborted while waiting for KV")
        self._pending_cancels.append(request_id)
        return True, None

    def _received_by_another(self, transfer_id: str, request_id: str) -> bool:
        return any(receive.transfer_id == transfer_id and not receive.refused and other != request_id
                   for other, receive in self._receiving.items())

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Attach prefill's first tokens; forget receives the workers reported finished (completed, failed or
        cancelled)."""
        worker_meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(worker_meta, KVPushWorkerMetadata):
            for request_id, token in worker_meta.first_tokens.items():
                receive = self._receiving.get(request_id)
                if receive is not None:
                    attach_first_token(receive.request, token)
        for request_id in connector_output.finished_recving or ():
            self._receiving.pop(request_id, None)

    def has_pending_push_work(self) -> bool:
        """Decode has no push work of its own; waiting requests keep vLLM stepping."""
        return False

    def waiting_leg_count(self) -> int:
        """How many decode legs are not allocated yet (waiting for prefill's start, or for blocks)."""
        return len(self._legs)

    def receiving_count(self) -> int:
        """How many requests wait for pushed KV (for tests and metrics)."""
        return len(self._receiving)


def attach_first_token(request: Request, token: int) -> None:
    """Make `token` the request's first sampled token: `kv_transfer_params.first_token_id`, read by the
    `ForcePrefillFirstToken` logits processor when the request joins the batch.

    `request.kv_transfer_params` is the very dict in `sampling_params.extra_args`, which vLLM sends to the
    workers only when it first schedules the request (after its KV arrived), so the processor sees the token.
    """
    params = request.kv_transfer_params
    if not isinstance(params, dict):  # never for a decode leg: on_new_request parsed this dict
        return
    transfer_params.write_first_token_id(params, token)
