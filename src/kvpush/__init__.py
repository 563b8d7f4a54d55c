"""kvpush: push-based, layer-streamed KV-cache transfer for disaggregated vLLM.

Packages (src/kvpush/<name> is kvpush.<name>):
  kvpush.v1            generated gRPC API (from protos/kvpush/v1): what custom gateways and engines speak
  kvpush.api           contracts shared across processes that are not protobuf (kv_transfer_params, shard hashing)
  kvpush.directory     the KV directory server
  kvpush.client        the directory's client library (engines, gateways)
  kvpush.gateway       the reference OpenAI-compatible gateway
  kvpush.cli           the `kvpush` command
  kvpush.connector     the vLLM KV connector (scheduler and worker halves)
  kvpush.dataplane     NIXL writes between engines; knows nothing of the directory
  kvpush.observability structured logging and OpenTelemetry set-up shared by every process
  kvpush.localstack    the local stack, demo and test harness (`make run`, `kvpush up`); the runtime never imports it
"""

__version__ = "0.1.0"
