"""kvpush: push-based, layer-streamed KV-cache transfer for disaggregated vLLM.

Subpackages:
  kvpush.v1            generated gRPC API (from protos/kvpush/v1)
  kvpush.observability structured logging and OpenTelemetry set-up shared by every process
  kvpush.services      KV-directory server, client library, gateway, CLI (folder services/)
  kvpush.connector     vLLM KV connector and the NIXL data plane (folder connector/)
"""

__version__ = "0.1.0"
