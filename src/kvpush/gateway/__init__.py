"""kvpush reference gateway: OpenAI-compatible HTTP plus the SageMaker contract, in front of P/D engines.

For each completion request the gateway plans a transfer at the KV directory (PlanTransfer), sends the
prefill leg (max_tokens=1) and the decode leg at the same time with the transfer id and the trace
context in `kv_transfer_params`, and returns the decode answer (streams pass through). See
docs/gateway.md. Modules: `config` (flags), `validation` (client input, leg bodies), `routing`
(kvpush / vLLM NIXL strategies), `legs` (HTTP to engines, error mapping), `dispatch` (one request),
`app` (aiohttp routes), `hosted` (the gateway served from a prefill engine's vLLM API server, `--middleware`),
`in_process` (its legs into that engine's ASGI app), `__main__` (`python -m kvpush.gateway`).
"""

from kvpush.gateway.app import create_app
from kvpush.gateway.config import GatewayConfig, parse_args

__all__ = ["GatewayConfig", "create_app", "parse_args"]
