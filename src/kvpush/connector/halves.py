"""The connector's two halves as contracts, and the one builder that wires a worker half.

`KVPushConnector` (connector.py) is a facade: in the scheduler process it holds a `SchedulerHalf`
(`PrefillScheduler` or `DecodeScheduler`), in each worker process a worker half (`PrefillWorkerHalf`:
`PrefillWorker`, or `DecodeWorkerHalf`: `DecodeWorker`). Every method below says who calls it
(Caller), whether and how long it may wait (Blocks) and what happens when something goes wrong
(Failure), as vLLM's `KVConnectorBase_V1` documents its hooks. The halves implement these protocols
structurally (nothing inherits from them); the unit tests of each half check `isinstance` against its protocol.

`build_worker_half` is the only place a worker half is wired: the NIXL agent and its I/O thread, the
directory link, the half itself, its data-plane adapter (PushTransport or NotificationListener), the
registration and the directory streams. `KVPushConnector.register_kv_caches` and the GPU harness
(bench/connector_gpu_run.py) both call it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ParamSpec, Protocol, runtime_checkable

from kvpush.connector.config import ConnectorConfig
from kvpush.observability import get_logger

if TYPE_CHECKING:
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvpush.connector.directory_link import DirectoryLink
    from kvpush.connector.metadata import KVPushMetadata, KVPushWorkerMetadata
    from kvpush.connector.metrics import WorkerMetrics
    from kvpush.connector.worker.decode import DecodeWorker
    from kvpush.connector.worker.prefill import PrefillWorker
    from kvpush.connector.worker.push_machine import WriteDone
    from kvpush.dataplane.agent import TransferAgent
    from kvpush.dataplane.listener import NotificationListener
    from kvpush.v1 import directory_pb2 as dpb
    from kvpush.v1 import types_pb2 as tpb

_log = get_logger("connector.halves")
_P = ParamSpec("_P")

# Builds a worker's TransferAgent: (config, kv_caches, block_size_tokens, num_kv_heads, head_size, agent_name).
AgentFactory = Callable[["ConnectorConfig", "dict[str, torch.Tensor]", int, int, int, str], "TransferAgent"]


@runtime_checkable
class SchedulerHalf(Protocol):
    """What the facade asks of a scheduler half (scheduler process, engine-core thread)."""

    def on_new_request(self, request: Request) -> None:
        """Track a request that carries kvpush kv_transfer_params.

        Caller: engine-core thread, once per request as it is added. Blocks: never.
        Failure: malformed params are logged and the request runs without kvpush.
        """

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond the local prefix hit that arrive from outside, and whether asynchronously.

        Caller: vLLM's scheduler, possibly many times per request. Blocks: never; no side effects.
        Failure: none (an untracked request gets (0, False)).
        """

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """The request's blocks were allocated (decode: report them to the directory).

        Caller: vLLM's scheduler after allocation; may run twice for one request. Blocks: never (the report
        is submitted to the directory link's thread). Failure: a refused report fails the receive in the
        next step's metadata.
        """

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVPushMetadata:
        """This step's work for the workers. Caller: vLLM's scheduler, once per step.

        Blocks: never; must not modify scheduler_output. Failure: none.
        """

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' results of a step: finished sends/receives, worker metadata.

        Caller: vLLM's scheduler, once per step, after the model ran. Blocks: never. Failure: none.
        """

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, object] | None]:
        """The request finished; True keeps its blocks until the workers report it finished sending.

        Caller: vLLM's scheduler, exactly once per request, before its blocks are freed. Blocks: never.
        Failure: none (decode: an aborted receive is cancelled at the directory, off this thread).
        """

    def has_pending_push_work(self) -> bool:
        """True while held blocks or receives keep the engine stepping. Caller: engine core. Blocks: never."""


@runtime_checkable
class PrefillWorkerHalf(Protocol):
    """What the facade asks of a prefill worker half (worker process, engine/forward thread)."""

    def begin_step(self, meta: KVPushMetadata) -> None:
        """Start a step: its chunks, holds and preemptions.

        Caller: bind_connector_metadata, before the forward. Blocks: never (posts to the push owner).
        Failure: a chunk that cannot be pushed fails its transfer (reported to the directory).
        """

    def save_kv_layer(self, layer_name: str) -> None:
        """Mark this layer's KV ready to push.

        Caller: worker forward thread, inside attention, once per layer per step. Blocks: never: records a
        CUDA event (GPU), posts. Failure: an unpostable write ends the transfer via the directory, within the
        lease.
        """

    def wait_for_save(self) -> None:
        """The step's forward is enqueued; queue its readiness to the directory.

        Caller: after the forward. Blocks: never (blocks stay held until pushed). Failure: none.
        """

    def get_finished_sending(self, finished_req_ids: set[str]) -> set[str]:
        """Held requests whose blocks may be freed now, each reported once.

        Caller: get_finished, once per step. Blocks: only on a step that schedules no tokens, up to
        idle_step_wait_s. Failure: a push that does not end within push_timeout_s is failed and released.
        """

    def build_worker_meta(self) -> KVPushWorkerMetadata | None:
        """Push timelines that changed this step. Caller: after get_finished. Blocks: never. Failure: none."""


@runtime_checkable
class DecodeWorkerHalf(Protocol):
    """What the facade asks of a decode worker half (worker process, engine thread)."""

    def begin_step(self, meta: KVPushMetadata) -> None:
        """Start the step's receives, fail refused allocations, note aborts.

        Caller: bind_connector_metadata, before the forward. Blocks: never. Failure: none.
        """

    def collect(self) -> tuple[set[str], set[int]]:
        """Requests finished receiving, and the blocks of those that failed (load errors).

        Caller: get_finished, once per step. Blocks: only on a step that schedules no tokens, up to
        idle_step_wait_s. Failure: a receive past transfer_timeout_s is cancelled, then released failed.
        """

    def take_first_tokens(self) -> dict[str, int]:
        """Prefill's first tokens of the receives completed since the last call (request id -> token).

        Caller: build_connector_worker_meta, once per step after get_finished. Blocks: never. Failure: none.
        """


@dataclass
class WorkerParts:
    """A wired worker half and what it runs on; `shutdown` stops them in order."""

    half: PrefillWorker | DecodeWorker
    agent: TransferAgent                          # its I/O thread owns the prefill push state
    link: DirectoryLink
    listener: NotificationListener | None = None  # decode

    def shutdown(self) -> None:
        """Stop the directory streams, then the notifications and the data plane (each bounded)."""
        self.link.close()
        if self.listener is not None:
            self.listener.stop()
        self.agent.stop()


def build_worker_half(config: ConnectorConfig, kv_caches: dict[str, torch.Tensor], block_size_tokens: int,
                      num_kv_heads: int, head_size: int, tp_rank: int, tp_size: int, agent_name: str, *,
                      create_agent: AgentFactory | None = None, model: str = "",
                      compatibility_hash: Callable[[TransferAgent], str] | None = None,
                      load_callback: Callable[[], tpb.EngineLoad | None] | None = None,
                      metrics: WorkerMetrics | None = None,
                      tap_write_done: Callable[[WriteDone], None] | None = None,
                      tap_instruction: Callable[[dpb.PushInstruction], None] | None = None,
                      tap_notification: Callable[[str, bytes], None] | None = None,
                      forces_first_token: bool = False, model_kv_head_count: int = 0,
                      kv_cache_groups: list[tuple[list[str], int]] | None = None,
                      state_groups: dict[int, tuple[list[str], int]] | None = None) -> WorkerParts:
    """Wire this process's worker half and register it with the directory (blocking, bounded; start-up only).

    create_agent: builds the TransferAgent (default: `transport.create_agent`, real NIXL).
    model: the served model name registered with the directory (plans that name a model pick by it).
    forces_first_token: a decode worker registers that its engine forces prefill's first token.
    compatibility_hash(agent): the layout's compatibility hash, once the agent described the KV memory.
    model_kv_head_count: the model's KV heads before the TP split (registered with the layout; 0: not said, and the
        engine then pairs only with engines of its own TP size).
    load_callback: the engine's load for each lease renewal (client thread, must not block).
    metrics: a `metrics.WorkerMetrics` fed with write settlements, quiet transfers, lost leases, the backlog.
    tap_*: called before the half's own callback with the same argument (the GPU harness stamps times).
    kv_cache_groups: with several KV-cache groups (hybrid KV-cache manager), each group's layer names and
        sliding window in tokens (0: full attention), by group index; registered with the layout.
    state_groups: which of those groups hold state layers (hybrid SSM models), by group index: their layer names
        and tokens per block. Their layers' caches are lists of state tensors; each pushes one state block.
    """
    from kvpush.connector.directory_link import DirectoryLink
    from kvpush.connector.worker import transport
    from kvpush.connector.worker.layout_wire import layout_to_proto, state_group_to_proto
    from kvpush.dataplane.layout import MEMORY_VRAM
    from kvpush.v1 import types_pb2 as tpb

    make_agent = create_agent or transport.create_agent
    if state_groups:
        agent = make_agent(config, kv_caches, block_size_tokens, num_kv_heads, head_size, agent_name,
                           state_groups=state_groups)  # type: ignore[call-arg]
    else:
        agent = make_agent(config, kv_caches, block_size_tokens, num_kv_heads, head_size, agent_name)
    link = DirectoryLink(config, f"kvpush-worker{tp_rank}-directory")
    on_gpu = agent.layout.memory_kind == MEMORY_VRAM
    layout = layout_to_proto(agent.layout)
    if compatibility_hash is not None:
        layout.compatibility_hash = compatibility_hash(agent)
    layout.model_kv_head_count = model_kv_head_count
    layer_groups = _layer_groups(list(kv_caches), kv_cache_groups)
    if layer_groups:
        for index, (_names, window) in enumerate(kv_cache_groups or ()):
            group_msg = layout.kv_cache_groups.add(group_index=index, sliding_window_tokens=window,
                                                   layers=[i for i, group in enumerate(layer_groups) if group == index])
            state_group = next((g for g in agent.layout.state_groups if g.group_index == index), None)
            if state_group is not None:
                state_group_to_proto(state_group, group_msg)
    lease_lost = metrics.on_lease_lost if metrics is not None else None
    if metrics is not None:
        tap_write_done = _tapped(metrics.on_write_done, tap_write_done)
    if config.is_prefill:
        from kvpush.connector.worker.prefill import PrefillWorker

        holder: list[PrefillWorker] = []
        on_write_done = _tapped(lambda done: holder[0].on_write_done(done), tap_write_done)
        on_writer_quiet = _tapped(lambda quiet: holder[0].on_writer_quiet(quiet),
                                  metrics.on_writer_quiet if metrics is not None else None)
        push = transport.PushTransport(agent, on_write_done, on_writer_quiet)
        worker = PrefillWorker(config, link, list(kv_caches), block_size_tokens, agent, push, on_gpu=on_gpu,
                               tp_rank=tp_rank, layer_groups=layer_groups,
                               state_group_block_sizes=tuple((index, size) for index, (_, size)
                                                             in sorted((state_groups or {}).items())))
        holder.append(worker)
        # Both mean the directory dropped this worker's session: a lost lease, and a stream that reconnected.
        def on_lease_lost(lease: str, reason: str) -> None:
            if lease_lost is not None:
                lease_lost()
            worker.on_session_reset()

        link.register(tpb.ENGINE_ROLE_PREFILL, tp_rank, tp_size, agent.agent_name, agent.agent_metadata(), layout,
                      on_lease_lost=on_lease_lost, model=model, load_callback=load_callback)
        session = link.open_prefill_session(_tapped(worker.on_instruction, tap_instruction), worker.on_cancellation,
                                            worker.on_rejection, on_session_reset=worker.on_session_reset,
                                            on_peer=worker.on_peer)
        if metrics is not None:
            metrics.watch_backlog(lambda: session.queued_message_count)
        if tp_size == 1:
            # UniProcExecutor: this engine's scheduler half, built next in this process, claims it (output_signal).
            from kvpush.connector.output_signal import offer_prefill_worker

            offer_prefill_worker(config.engine_id, worker)
        return WorkerParts(worker, agent, link)
    from kvpush.connector.worker.decode import DecodeWorker
    from kvpush.dataplane.listener import NotificationListener

    receiver = DecodeWorker(config, link, block_size_tokens)
    listener = NotificationListener(agent, _tapped(receiver.on_notification, tap_notification))
    link.register(tpb.ENGINE_ROLE_DECODE, tp_rank, tp_size, agent.agent_name, agent.agent_metadata(), layout,
                  on_lease_lost=(lambda lease, reason: lease_lost()) if lease_lost is not None else None,
                  model=model, load_callback=load_callback, forces_first_token=forces_first_token)
    link.watch(receiver.on_event, receiver.on_gap)
    return WorkerParts(receiver, agent, link, listener)


def _tapped(callback: Callable[_P, None], tap: Callable[_P, None] | None) -> Callable[_P, None]:
    if tap is None:
        return callback

    def both(*args: _P.args, **kwargs: _P.kwargs) -> None:
        tap(*args, **kwargs)
        callback(*args, **kwargs)

    return both


def _layer_groups(layer_names: list[str], kv_cache_groups: list[tuple[list[str], int]] | None) -> tuple[int, ...]:
    """Each layer's KV-cache group, in layer order; () with one group (or none said)."""
    if not kv_cache_groups or len(kv_cache_groups) < 2:
        return ()
    group_of = {name: index for index, (names, _) in enumerate(kv_cache_groups) for name in names}
    missing = [name for name in layer_names if name not in group_of]
    if missing:
        raise ValueError(f"KV-cache layers {missing} are in no KV-cache group")
    return tuple(group_of[name] for name in layer_names)
