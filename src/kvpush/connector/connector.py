"""`KVPushConnector`: vLLM's entry point to kvpush; a thin facade that picks a half by role and delegates.

vLLM builds one instance with role SCHEDULER in the EngineCore process and one with role WORKER in
each worker process (`kv_connector="KVPushConnector"`, `kv_connector_module_path="kvpush.connector"`).
kv_role "kv_producer" makes a prefill engine, "kv_consumer" a decode engine:

- scheduler half: `PrefillScheduler` (prefill: per-step chunks, holds blocks while pushing), `DecodeScheduler`
  (decode: waits for remote KV, reports allocations);
- worker half: `PrefillWorker` (prefill: per-layer readiness, writes as layers exist), `DecodeWorker` (decode:
  notifications + directory events -> finished receives).

Runs on vLLM 0.25 to 0.32; `kvpush.connector.compat` checks the release at import and lists where their
connector APIs differ. Per step (model runner): `bind_connector_metadata` -> forward (`save_kv_layer` per
layer; `start_load_kv` before or after it, by release) -> `wait_for_save` -> `get_finished` (0.30+ calls it
through `get_transfer_results`) -> `get_block_ids_with_load_errors` -> `build_connector_worker_meta` ->
`clear_connector_metadata`. The worker therefore begins its step in `bind_connector_metadata`.

`SupportsHMA`: vLLM keeps its hybrid KV-cache manager on. Each KV-cache group (layers sharing one block table)
has its own block list on both sides; allocations, readiness and instructions carry every group's
(`BlockGroup`), and each layer is written into its own group's blocks. A sliding-window group on decode holds only
the prompt's last window (vLLM pads the blocks behind it with its null block), so only those blocks are pushed.
Attention groups must share one block size. State groups (vLLM's MambaSpec: Mamba, Mamba2, linear attention, GDN, short
convolution, in hybrid SSM models) have blocks of their own size (one per request without prefix caching); a state
layer pushes its request's state block whole, once, after the prompt's last chunk, and such an engine's pushes stop
one token short of the prompt (decode recomputes that token on top of the state: `scheduler.prefill`). State groups
need vLLM's 'none' Mamba cache mode (prefix caching off); 'align' is refused at start-up. Failed receives of a
several-group engine are reported by request (`failed_recving`), not block ids.

Operations hooks here (not in the halves): each worker registers its served model and a compatibility hash
(`metadata.compatibility_hash`), renews its lease with the engine's load (the scheduler reads free blocks from the
block pool each step and passes them in the step's metadata), and feeds `connector.metrics` from WRITE
settlements, push timelines and finished receives (served on `metrics_port + tp_rank`). A decode worker also
registers whether its engine forces prefill's first token (`forces_first_token`): vLLM built the first-token logits
processor (src/kvpush/connector/first_token.py, loaded through kvpush's entry point) with the model runner, before this
connector existed, so the worker reports what got installed rather than installing anything.

Unlike vLLM's NIXL connectors this never pins CPU cores, and its NIXL agent runs with the progress
thread off and every NIXL call on the data plane's one I/O thread.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # a release without the hybrid manager's connector interface: nothing to declare
    class SupportsHMA:  # type: ignore[no-redef]
        """Stand-in for vLLM's marker class where it does not exist."""

import kvpush.connector.compat  # noqa: F401  (first: an unsupported vLLM fails here, by name)
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.metadata import WIRE_VERSION, KVPushMetadata
from kvpush.observability import configure_logging, get_logger

if TYPE_CHECKING:
    import torch
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvpush.connector.directory_link import DirectoryLink
    from kvpush.connector.halves import SchedulerHalf, WorkerParts
    from kvpush.connector.metrics import WorkerMetrics
    from kvpush.connector.scheduler.prefill import PrefillScheduler
    from kvpush.connector.worker.decode import DecodeWorker
    from kvpush.connector.worker.prefill import PrefillWorker
    from kvpush.dataplane.agent import TransferAgent
    from kvpush.v1 import types_pb2 as tpb

_log = get_logger("connector")


class KVPushConnector(KVConnectorBase_V1, SupportsHMA):
    """Push-based, layer-streamed KV transfer coordinated by the kvpush directory (module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        """Parse the configuration and build the half this process runs (workers finish in register_kv_caches)."""
        super().__init__(vllm_config, role, kv_cache_config)
        configure_logging()
        self.config = ConnectorConfig.from_kv_transfer_config(vllm_config.kv_transfer_config)
        self._block_size = vllm_config.cache_config.block_size
        # Several KV-cache groups (hybrid manager): each group's layer names and sliding window; else []. State
        # groups (hybrid SSM models) by index: their layer names and tokens per block.
        self._kv_cache_groups, self._state_groups = _kv_cache_groups(kv_cache_config, self._block_size)
        self._state_cache_config = kv_cache_config  # where state layers live (_with_state_views)
        # Scheduler process: its half (a prefill engine's also by its own type, for the output signal).
        self._scheduler: SchedulerHalf | None = None
        self._prefill_scheduler: PrefillScheduler | None = None
        self._link: DirectoryLink | None = None  # the decode scheduler's
        # Worker process: what halves.build_worker_half wired, and its half by role.
        self._parts: WorkerParts | None = None
        self._prefill_worker: PrefillWorker | None = None
        self._decode_worker: DecodeWorker | None = None
        self._load_errors: set[int] = set()
        self._metrics: WorkerMetrics | None = None
        # Load as the scheduler last saw it (worker side, from the step's metadata); requests it holds (scheduler).
        self._engine_load: tuple[int, int, int] | None = None
        self._block_pool: BlockPool | None = None
        self._known_requests: set[str] = set()
        from kvpush.connector.engine_spin import pace_message_queue_spin

        pace_message_queue_spin(self.config.message_queue_poll_s)
        if self.config.gil_switch_interval_s is not None:
            sys.setswitchinterval(self.config.gil_switch_interval_s)
        if role == KVConnectorRole.SCHEDULER:
            self._build_scheduler()
        from kvpush.connector.tracing import configure_engine_tracing

        configure_engine_tracing(self.config.role)

    # ================================================================ construction

    def _build_scheduler(self) -> None:
        if self.config.is_prefill:
            from kvpush.connector.scheduler.prefill import PrefillScheduler

            scheduler = PrefillScheduler(self.config, self._block_size, self._state_block_sizes())
            self._scheduler = self._prefill_scheduler = scheduler
            from kvpush.connector.output_signal import claim_prefill_worker

            worker = claim_prefill_worker(self.config.engine_id)
            if worker is not None and self.config.post_after_output and worker.defers_to_output():
                scheduler.on_output_leaving = worker.output_left
                _log.info("prefill worker in the scheduler's process: launch-bound steps push after their output",
                          engine_id=self.config.engine_id)
        else:
            from kvpush.connector.directory_link import DirectoryLink
            from kvpush.connector.metrics import DecodeSchedulerMetrics
            from kvpush.connector.scheduler.decode import DecodeScheduler

            self._link = DirectoryLink(self.config, "kvpush-scheduler-directory")
            self._scheduler = DecodeScheduler(self.config, self._block_size, self._link,
                                              tuple(window for _, window in self._kv_cache_groups),
                                              self._state_block_sizes(),
                                              deferrals=DecodeSchedulerMetrics(self.config.engine_id))

    def _state_block_sizes(self) -> dict[int, int]:
        """Each state group's tokens per block, by group index ({} without state groups)."""
        return {index: size for index, (_, size) in self._state_groups.items()}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Worker start-up: register KV memory with NIXL and this worker with the directory (blocking, bounded)."""
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        from kvpush.connector.halves import build_worker_half
        from kvpush.connector.worker.prefill import PrefillWorker

        tp_rank = get_tensor_model_parallel_rank()
        tp_size = get_tensor_model_parallel_world_size()
        if self.config.cuda_sync_mode is not None and any(getattr(t, "is_cuda", False) for t in kv_caches.values()):
            from kvpush.dataplane.cuda_sched import set_sync_mode

            set_sync_mode(self.config.cuda_sync_mode)
        model_config = self._vllm_config.model_config
        num_kv_heads = model_config.get_num_kv_heads(self._vllm_config.parallel_config)
        # The model's KV heads before the TP split: engines of different TP sizes pair by head slices of them.
        model_kv_heads = model_config.get_total_num_kv_heads()
        agent_name = f"{self.config.engine_id}-tp{tp_rank}-{uuid.uuid4().hex[:8]}"
        head_size = model_config.get_head_size()
        from kvpush.connector import metrics

        self._metrics = metrics.WorkerMetrics(self.config.engine_id, self.config.role, tp_rank)
        if self.config.metrics_port:
            metrics.serve(self.config.metrics_port + tp_rank)
        if self._state_groups:
            kv_caches = _with_state_views(kv_caches, self._state_cache_config, self._state_groups)
        self._parts = build_worker_half(
            self.config, kv_caches, self._block_size, num_kv_heads, head_size, tp_rank, tp_size, agent_name,
            model=str(getattr(model_config, "served_model_name", None) or model_config.model),
            compatibility_hash=lambda agent: self._compatibility_hash(agent, model_kv_heads, head_size, len(kv_caches)),
            model_kv_head_count=model_kv_heads,
            load_callback=self._load, metrics=self._metrics, forces_first_token=self._forces_first_token(),
            kv_cache_groups=self._kv_cache_groups or None, state_groups=self._state_groups or None)
        half = self._parts.half
        if isinstance(half, PrefillWorker):
            self._prefill_worker = half
        else:
            self._decode_worker = half
        agent = self._parts.agent
        _log.info("kvpush connector worker ready", engine_id=self.config.engine_id, role=self.config.role,
                  tp_rank=tp_rank, tp_size=tp_size, agent=agent.agent_name, layers=len(kv_caches),
                  layout=agent.layout.layout_name, blocks=agent.layout.block_count)

    def _forces_first_token(self) -> bool:
        """Decode: whether this process's sampler got a forcing first-token processor (vLLM built it with the model
        runner, before this connector existed; src/kvpush/connector/first_token.py says when it cannot)."""
        from kvpush.connector.first_token import forcing_installed

        # A hybrid SSM model's prefill stops one token short of the prompt (scheduler.prefill): the token it samples is
        # not the first one, so such a decode engine registers that it does not force it (the gateway then leaves it).
        forces = self.config.is_decode and forcing_installed() and not self._state_groups
        if self.config.is_decode:
            _log.info("first token from prefill", engine_id=self.config.engine_id, forces_first_token=forces)
        return forces

    def _compatibility_hash(self, agent: TransferAgent, model_kv_heads: int, head_size: int, layer_count: int) -> str:
        """Over the model's KV heads, not this rank's: ranks of engines of different TP sizes hash alike (the
        registered kv_head_count carries the per-rank split, which planning compares)."""
        import vllm

        from kvpush.connector.metadata import compatibility_hash

        model_config, cache_config = self._vllm_config.model_config, self._vllm_config.cache_config
        return compatibility_hash(
            model=str(model_config.model), dtype=str(model_config.dtype), cache_dtype=str(cache_config.cache_dtype),
            kv_layout=agent.layout.layout_name, num_kv_heads=model_kv_heads, head_size=head_size,
            layer_count=layer_count, vllm_version=str(vllm.__version__))

    def _load(self) -> tpb.EngineLoad | None:
        """This engine's load for a lease renewal (client thread): the scheduler's latest, None before a step."""
        from kvpush.v1 import types_pb2 as tpb

        load = self._engine_load
        if load is None:
            return None
        return tpb.EngineLoad(free_block_count=load[0], running_request_count=load[1], waiting_request_count=load[2])

    # ================================================================ worker side

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Before the forward: bind the step's metadata and let the worker half begin the step."""
        super().bind_connector_metadata(connector_metadata)
        if not isinstance(connector_metadata, KVPushMetadata) or connector_metadata.wire_version != WIRE_VERSION:
            raise TypeError(f"KVPushConnector worker got metadata {type(connector_metadata).__name__} "
                            f"version {getattr(connector_metadata, 'wire_version', None)}; expected "
                            f"KVPushMetadata version {WIRE_VERSION}")
        if connector_metadata.engine_load is not None:
            self._engine_load = connector_metadata.engine_load
        if self._prefill_worker is not None:
            self._prefill_worker.begin_step(connector_metadata)
        elif self._decode_worker is not None:
            self._decode_worker.begin_step(connector_metadata)
            if connector_metadata.receives and self._metrics is not None:
                self._metrics.on_receives_begun([start.request_id for start in connector_metadata.receives])

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: object) -> None:
        """Nothing to start: pushed KV is written into our blocks by prefill, one-sided."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Never waits: a request only runs once its whole push completed."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: object) -> None:
        """Mark this layer's KV ready to push.

        Caller: worker forward thread, inside attention, once per layer per step.
        Never blocks on NIXL or the directory: records a CUDA event (GPU), enqueues writes.
        Failure: an unpostable write ends the transfer via the directory, within the lease.
        """
        if self._prefill_worker is not None:
            self._prefill_worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        """Queue the step's readiness batch to the directory; never waits (blocks stay held until pushed)."""
        if self._prefill_worker is not None:
            self._prefill_worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(pushes done, receives done): prefill reports finished_sending, decode finished_recving.

        Caller: worker thread, once per step after the forward (0.30+ through get_transfer_results).
        Failed receives are reported finished too; their blocks go to get_block_ids_with_load_errors.
        """
        if self._prefill_worker is not None:
            return self._prefill_worker.get_finished_sending(finished_req_ids), None
        worker = self._decode_worker
        if worker is None:
            return None, None
        finished, load_errors = worker.collect()
        if self._metrics is not None:
            self._metrics.on_receives_finished(finished, worker.completed_count, worker.failed_count)
        self._load_errors |= load_errors
        return None, finished

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of failed receives, in the same step their requests are reported finished (one KV-cache group;
        with several, vLLM cannot map block ids to requests: `get_transfer_results` reports them failed instead)."""
        errors, self._load_errors = self._load_errors, set()
        return set() if self._kv_cache_groups else errors

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """`get_finished`'s sets, plus (several KV-cache groups) the failed receives as `failed_recving` (vLLM
        0.30+, whose result type this is; older releases never call it)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorTransferResults,
        )

        sending, recving = self.get_finished(finished_req_ids)
        failed: set[str] = set()
        if self._decode_worker is not None:
            failed = self._decode_worker.take_failed_requests()
        results = KVConnectorTransferResults(finished_sending=set(sending or ()), finished_recving=set(recving or ()))
        if self._kv_cache_groups:
            results.failed_recving = failed
        return results

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """Push timelines of transfers that ended (prefill), for the response's kv_transfer_params; prefill's
        first tokens of the receives this step completed (decode), for the requests' first step.

        Caller: worker thread, once per step, after get_finished (so the tokens come with their finished_recving).
        """
        if self._decode_worker is not None:
            from kvpush.connector.metadata import KVPushWorkerMetadata

            tokens = self._decode_worker.take_first_tokens()
            return KVPushWorkerMetadata(first_tokens=tokens) if tokens else None
        if self._prefill_worker is not None:
            meta = self._prefill_worker.build_worker_meta()
            if meta is not None and self._metrics is not None:
                # This rank's own timelines (a worker process sees only its rank).
                self._metrics.on_timelines({request_id: report for request_id, by_rank in meta.timelines.items()
                                            for report in by_rank.values()})
            return meta
        return None

    def shutdown(self) -> None:
        """Stop streams and the data plane (bounded)."""
        if self._parts is not None:  # worker process: streams, notifications, data plane
            self._parts.shutdown()
            self._parts = None
        if self._link is not None:  # decode scheduler process
            self._link.close()
            self._link = None

    # ================================================================ scheduler side

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        """Keep the block pool: each step's metadata carries its free-block count to the workers (EngineLoad)."""
        self._block_pool = gpu_block_pool

    def on_new_request(self, request: Request) -> None:
        """Track a request that carries kvpush kv_transfer_params (and count it for the engine's load)."""
        self._known_requests.add(request.request_id)
        self._scheduler_half().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Decode: prompt tokens beyond the local hit arrive asynchronously by push. Prefill: none. No side effects."""
        return self._scheduler_half().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Decode: report the allocation to the directory (submitted, never awaited)."""
        if not self.config.is_prefill:
            self._scheduler_half().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's chunks / receives / holds for the workers, and the engine's load (does not modify
        scheduler_output)."""
        meta = self._scheduler_half().build_connector_meta(scheduler_output)
        if self._block_pool is not None:
            running = len(scheduler_output.num_scheduled_tokens)
            meta.engine_load = (self._block_pool.get_num_free_blocks(), running,
                                max(0, len(self._known_requests) - running))
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Release holds and forget receives the workers reported; merge push timelines."""
        self._scheduler_half().update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, object] | None]:
        """Exactly once per request, before its blocks are freed: hold them while pushes may still touch them."""
        self._known_requests.discard(request.request_id)
        return self._scheduler_half().request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, object] | None]:
        """`request_finished` with every KV-cache group's blocks (SupportsHMA): a hold keeps them all, as vLLM
        delays freeing every group's blocks together."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """Every KV-cache group: a push writes the request's own blocks of each (a sliding-window group's
        window included), unlike a prefix store."""
        return tuple(range(max(1, len(self._kv_cache_groups))))

    def take_events(self) -> Iterable[KVCacheEvent]:
        """No KV-cache events. The last connector call of update_from_output: prefill tells an in-process worker
        half that the processed step's output is leaving (output_signal)."""
        if self._prefill_scheduler is not None:
            self._prefill_scheduler.step_output_processed()
        return ()

    def has_pending_push_work(self) -> bool:
        """True while finished prefill requests hold blocks for pushes (keeps the engine stepping)."""
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    def _scheduler_half(self) -> SchedulerHalf:
        """This process's scheduler half (vLLM calls the scheduler hooks only where it built one)."""
        if self._scheduler is None:
            raise RuntimeError("KVPushConnector: a scheduler hook was called in a worker process")
        return self._scheduler

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, object]) -> bool:
        """False: vLLM keeps FULL_AND_PIECEWISE graphs, which decode engines need for their step time.

        Caller: vLLM's config, once at start-up (it does not say the engine's role). Decode never uses the layer
        hooks. On prefill, chunks of more than one token run piecewise graphs, so save_kv_layer streams each
        layer; a step of one-token chunks may replay a full graph without the hooks, and the worker then saves
        every layer at wait_for_save (`PrefillWorker.wait_for_save`). Forcing PIECEWISE here (as the connector
        did until the H200 run) took decode's TPOT from ~7 to ~14 ms on Llama-3.1-8B.
        """
        return False

    # ================================================================ hooks of newer releases (compat.py)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig | None) -> bool:
        """False: vLLM 0.33+ then refuses `--enable-sleep-mode` for this connector at start-up.

        Sleep unmaps the KV cache and wake maps fresh pages, so the NIXL registration would have to be dropped and
        redone. Re-registering changes the agent metadata that peers loaded (at first contact, or from the
        directory's announcements) and that push plans were built against; every peer would have to reload it
        before writing again, and the directory has no way to tell them. Until it has, a sleeping engine is refused
        rather than left open to WRITEs into memory it gave back.
        """
        return False

    def unregister_kv_caches(self) -> None:
        """Refuse to give up the registered KV cache (vLLM 0.33+ calls this before releasing its memory).

        Sleep mode never gets here (`supports_sleep_mode`), but vLLM 0.34 also calls it before lending an emptied
        extensible KV cache to a weight update. Raising stops that before any memory is released; doing nothing
        would let vLLM free pages that NIXL still has registered and prefill engines may still write into.
        """
        if self._parts is None:  # nothing registered in this process
            return
        raise RuntimeError("KVPushConnector cannot release its KV cache: it is registered with NIXL and its peers "
                           "write into it (supports_sleep_mode is False for the same reason); update weights "
                           "without releasing the KV cache, or restart the engine")

    def restore_kv_caches(self) -> None:
        """Nothing to restore: `unregister_kv_caches` never lets the registration go."""

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: KVTransferConfig | None) -> object:
        """`KVCacheAccess.REGISTERS` (vLLM 0.34+): each worker registers its KV cache with NIXL for RDMA, which
        needs every segment backed by one physical allocation. (`object`: the type exists only in 0.34+.)"""
        # Imported here: vLLM 0.34 added it, and only 0.34+ calls this hook; the installed release may lack it.
        from vllm.config.kv_transfer import KVCacheAccess  # type: ignore[attr-defined]

        return KVCacheAccess.REGISTERS

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: KVTransferConfig | None) -> bool:
        """True (vLLM 0.34+): block hashes that also cover the tokens after each block change nothing here. The
        connector never reads, sends or compares vLLM's block hashes; decode's own prefix hit reaches it as a token
        count (`num_computed_tokens`) and goes to the directory as one."""
        return True

    def may_load_async(self, request: Request) -> bool:
        """Whether `get_num_new_matched_tokens` may answer `load_kv_async=True` for this request (vLLM 0.34+).

        Decode: a request carrying a kvpush decode leg that is not allocated yet (pushed KV arrives asynchronously;
        waiting for its prefill's start included);
        asked before vLLM knows the local prefix hit, so a full local hit is a harmless false positive. Prefill:
        never. Cheap and without side effects, as vLLM asks each time the request enters a waiting queue.
        """
        if self._scheduler is None or self.config.is_prefill:
            return False
        tokens, load_async = self._scheduler.get_num_new_matched_tokens(request, 0)
        return load_async or tokens is None  # None: a leg waiting for its prefill's start loads asynchronously


def _kv_cache_groups(kv_cache_config: KVCacheConfig | None, block_size: int
                     ) -> tuple[list[tuple[list[str], int]], dict[int, tuple[list[str], int]]]:
    """Each KV-cache group's layer names and sliding window (0: full attention, and state groups), when there are
    several, [] for one; and the state groups (vLLM's MambaSpec) by index, with their tokens per block. Raise
    ValueError, naming the group, for what a push cannot move (other group kinds, attention groups of another block
    size, state kept per prefix: Mamba cache mode 'align')."""
    groups = list(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else []
    if len(groups) < 2:
        return [], {}
    described: list[tuple[list[str], int]] = []
    state_groups: dict[int, tuple[list[str], int]] = {}
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        names = list(group.layer_names)
        if kind == "MambaSpec":
            mode = getattr(spec, "mamba_cache_mode", "none")
            if mode != "none":
                raise ValueError(f"KV-cache group {index} (MambaSpec, layers {names[:4]}...) keeps its state in "
                                 f"Mamba cache mode {mode!r}: KVPushConnector pushes one state block per request "
                                 "(mode 'none'); start the engine with --no-enable-prefix-caching")
            state_groups[index] = (names, int(spec.block_size))
            described.append((names, 0))
            continue
        if kind not in ("FullAttentionSpec", "SlidingWindowSpec"):
            raise ValueError(f"KVPushConnector pushes attention KV and Mamba state only; KV-cache group {index} is "
                             f"{kind} (layers {names[:4]}...)")
        if spec.block_size != block_size:
            raise ValueError(f"KV-cache group {index} has {spec.block_size}-token blocks; the engine's are "
                             f"{block_size}")
        window = getattr(spec, "sliding_window", None) or 0
        described.append((names, int(window)))
    return described, state_groups


def _with_state_views(kv_caches: dict[str, torch.Tensor], kv_cache_config: KVCacheConfig | None,
                      state_groups: dict[int, tuple[list[str], int]]) -> dict[str, torch.Tensor]:
    """`kv_caches` with each state layer's cache as its list of state views.

    vLLM 0.25 passes a state layer as that list already. 0.30+ passes one raw int8 page view per state layer,
    `(num_blocks, 1, 1, page bytes)` from the layer's block 0 (what `MambaBase.bind_kv_cache` slices): the spec's
    states are packed from each page's start.
    """
    from kvpush.dataplane.describe import state_views

    if kv_cache_config is None:
        return kv_caches
    spec_of = {name: group.kv_cache_spec for group in kv_cache_config.kv_cache_groups for name in group.layer_names}
    views: dict[str, object] = dict(kv_caches)
    for names, _ in state_groups.values():
        for name in names:
            raw = kv_caches[name]
            if not hasattr(raw, "data_ptr"):
                continue  # already a list of views
            if raw.dim() < 2:
                raise ValueError(f"state layer {name!r}: a {tuple(raw.shape)} cache is not a per-block page view")
            spec = spec_of[name]  # a MambaSpec: its states' shapes and dtypes
            states = [(tuple(int(d) for d in shape), str(dtype).removeprefix("torch."), int(dtype.itemsize))
                      for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True)]  # type: ignore[attr-defined]
            views[name] = state_views(raw.data_ptr(), int(raw.stride(0)) * raw.element_size(), int(raw.shape[0]),
                                      states, raw.device)
    return views  # type: ignore[return-value]
