"""Client library of the KV-directory, used by the vLLM connector and by custom gateways.

- `ChannelConfig`: address, token, TLS files, deadlines and retry policy (env / dict / arguments).
- `DirectoryClient`: async unary calls with deadlines and backoff retry on UNAVAILABLE.
- `EngineRegistration`: register a worker and keep its lease alive (re-registers after restarts).
- `PrefillSession`: StreamPrefill with batching and automatic reconnect.
- `watch_transfers`: a decode engine's terminal events, resumed across reconnects.
- `ReplicatedPrefillSession`, `watch_replicas`: the streams against directory replicas (one per replica,
  routed by shard; `SyncDirectoryClient` and `watch_transfers` pick them when the directory is replicated).
- `SyncDirectoryClient`: all of the above from threads, on a private event-loop thread.
- `DirectoryCallError`: the exception every refused call raises (`.code`, `.details`).
- `client_id_of`, `PLAN_CLIENT_ID`: the client a plan serves (the directory bounds each client's share of an engine).
- `incarnation_of`: which directory process answered a response (its ResponseHeader; the deprecated field of an
  older directory).
"""

from kvpush.client.client import PLAN_CLIENT_ID, DirectoryClient, client_id_of, incarnation_of
from kvpush.client.config import ChannelConfig
from kvpush.client.errors import DirectoryCallError
from kvpush.client.lease import EngineRegistration
from kvpush.client.prefill import PrefillSession
from kvpush.client.replicas import ReplicatedPrefillSession, watch_replicas
from kvpush.client.sync import SyncDirectoryClient
from kvpush.client.watch import watch_transfers

__all__ = [
    "PLAN_CLIENT_ID",
    "ChannelConfig",
    "DirectoryCallError",
    "DirectoryClient",
    "EngineRegistration",
    "PrefillSession",
    "ReplicatedPrefillSession",
    "SyncDirectoryClient",
    "client_id_of",
    "incarnation_of",
    "watch_replicas",
    "watch_transfers",
]
