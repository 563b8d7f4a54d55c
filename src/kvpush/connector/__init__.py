"""kvpush's vLLM KV connector: layer-streamed, push-based KV transfer coordinated by the kvpush directory.

vLLM loads it with `kv_connector="KVPushConnector"` and `kv_connector_module_path="kvpush.connector"`.
This package imports without vLLM: `KVPushConnector` is resolved lazily (vLLM's factory does
`getattr(module, "KVPushConnector")`), so tools and the data plane can be used on machines without it.

Modules: `connector` (the facade), `halves` (each half's contract, and the builder that wires a worker
half), `config` (extra-config parsing), `metadata` (scheduler <-> worker data), `outcome` (the wire form of
how a transfer ends, per side), `scheduler/` and `worker/` (one half per role each), `directory_link` (the only
gRPC), `tracing` (spans per transfer). kv_transfer_params are `kvpush.api.params` and the outcome vocabulary
`kvpush.api.outcome` (shared with the gateway and the data plane); NIXL is `kvpush.dataplane`. The request walk
through them: docs/architecture.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpush.connector.connector import KVPushConnector

__all__ = ["KVPushConnector"]


def __getattr__(name: str) -> type[KVPushConnector]:
    if name == "KVPushConnector":
        from kvpush.connector.connector import KVPushConnector

        return KVPushConnector
    raise AttributeError(f"module 'kvpush.connector' has no attribute {name!r}")
