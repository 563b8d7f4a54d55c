"""kvpush's NIXL data plane: registers KV memory, plans descriptors, posts and tracks WRITEs.

Usable on its own and driven by the vLLM connector. Import-light: numpy only; NIXL is imported
when an agent is created, torch never (tensors are duck-typed). It speaks no protobuf and imports nothing of
the directory, its client or the connector: outcomes are `kvpush.api.outcome`'s.

Life cycle of a push (prefill P writes into decode D):
1. Each worker: `agent = TransferAgent(name, NixlConfig(...))`, `agent.register(kv_caches,
   block_size, kv_heads, head_size)` -> `KVLayoutSpec`; publish `agent.agent_metadata()` and
   `agent.layout` (the connector sends its wire form, which the directory forwards); `agent.start()`.
2. D: `NotificationListener(agent, on_notification)`; nothing else is needed to receive.
3. P: `agent.add_peer(d_name, d_metadata, d_layout)` (a `KVLayoutSpec`) once per D worker,
   `writer = PushWriter(agent, on_request_done, on_transfer_done)`, then per layer (group) as it
   becomes ready: `writer.submit(WriteRequest(transfer_id, d_name, layers, src_blocks, dst_blocks,
   token_start, token_end, notify=b"..." on the last, ready_event=cuda_event))`.
4. `agent.remove_peer(d_name)` when D leaves; `agent.stop()` at shutdown.

Modules: `layout` (KVLayoutSpec), `describe` (vLLM tensors -> layout), `plan`
(descriptor maths, pure), `config` (NixlConfig, agent construction), `nixl_api` (the NIXL calls made, as a
Protocol, and their opaque handles), `peers` (prepared tables), `agent` (TransferAgent, the I/O thread), `writer`
(PushWriter), `listener` (NotificationListener), `inmemory` (an in-memory NIXL agent for tests).
"""

from kvpush.dataplane.config import BACKEND_LIBFABRIC, BACKEND_UCX, NixlConfig
from kvpush.dataplane.describe import LAYOUT_HINTS, describe_kv_caches
from kvpush.dataplane.layout import KVLayoutSpec, KVPlaneSpec, LayoutError, check_compatible
from kvpush.dataplane.plan import WritePlan, WriteRequestError, plan_write, validate_write

__all__ = [
    "BACKEND_LIBFABRIC",
    "BACKEND_UCX",
    "LAYOUT_HINTS",
    "KVLayoutSpec",
    "KVPlaneSpec",
    "LayoutError",
    "NixlConfig",
    "NotificationListener",
    "PushWriter",
    "TransferAgent",
    "WriteOutcome",
    "WritePlan",
    "WriteRequest",
    "WriteRequestError",
    "check_compatible",
    "describe_kv_caches",
    "plan_write",
    "validate_write",
]


def __getattr__(name: str) -> object:
    if name == "TransferAgent":
        from kvpush.dataplane.agent import TransferAgent

        return TransferAgent
    if name in ("PushWriter", "WriteRequest", "WriteOutcome"):
        from kvpush.dataplane import writer

        return getattr(writer, name)
    if name == "NotificationListener":
        from kvpush.dataplane.listener import NotificationListener

        return NotificationListener
    raise AttributeError(name)
