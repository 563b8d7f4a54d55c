"""Gateway configuration: command-line flags with environment fallbacks, validated once at start-up."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass

MODES = ("kvpush", "nixl-pull", "nixl-push")


@dataclass(frozen=True)
class GatewayConfig:
    """Everything the gateway needs; every wait it makes is bounded by one of these."""

    host: str = "127.0.0.1"
    port: int = 8080
    mode: str = "kvpush"
    directory_address: str = ""
    directory_token: str = ""
    # TLS files of the gateway's directory channel; empty: KVPUSH_DIRECTORY_TLS_* (or plaintext).
    directory_tls_root_cert: str = ""
    directory_tls_client_cert: str = ""
    directory_tls_client_key: str = ""
    # The prefill engine this gateway runs beside (a gateway hosted in that engine's API server, `hosted`): its
    # prefill legs go there whenever the directory lists it as able to take them, so they stay in one process.
    local_prefill_engine_id: str = ""
    # Served from that engine's API server, on its event loop (set by `hosted`, not a flag): the plan waits for the
    # engine to take a prefill leg sent there first (dispatch.HOSTED_PLAN_WAIT_S).
    hosted: bool = False
    # Bind the port with SO_REUSEPORT: every API server process of `vllm serve --api-server-count N` hosts a gateway
    # on the same port and the kernel spreads connections over them.
    reuse_port: bool = False
    # Static engines for the nixl-* baseline modes.
    prefill_url: str = ""
    decode_url: str = ""
    prefill_engine_id: str = ""
    prefill_side_channel: str = ""  # HOST:PORT of prefill's NIXL side channel (nixl-push)
    plan_timeout_s: float = 5.0
    connect_timeout_s: float = 5.0
    prefill_timeout_s: float = 120.0
    decode_timeout_s: float = 600.0
    # First-byte bounds: from sending a streamed leg to its engine's response headers (vLLM sends them once its API
    # server has taken the request, before any token). An engine over the bound is frozen or hung: it is reported
    # unreachable and the request planned again, while no byte has reached the client. 0: no bound. docs/gateway.md.
    prefill_first_byte_timeout_s: float = 10.0
    decode_first_byte_timeout_s: float = 10.0
    # Idle pooled connections to engines are closed after this long: below the engines' own keep-alive
    # (vLLM's uvicorn closes idle connections after 5 s), so a request never goes out on a connection the
    # engine is closing (that fails as "Server disconnected" with nothing sent back).
    upstream_keepalive_s: float = 4.0
    transfer_ttl_s: float = 0.0  # 0: the directory's default
    max_body_bytes: int = 8 * 1024 * 1024
    # When set, /v1/* requests need "Authorization: Bearer <api_key>" (OpenAI style); 401 otherwise.
    api_key: str = ""
    # Count text and chat prompts' tokens with a prefill engine's /tokenize before planning (free-block check).
    count_prompt_tokens: bool = True
    # Stream prefill's token to the client when the prefill leg returns (kvpush mode, streamed requests and
    # max_tokens=1; only with decode engines that register forces_first_token). Both legs still leave at
    # once: prefill's token reaches decode with the transfer's completion. See docs/gateway.md.
    first_token_from_prefill: bool = True
    # kvpush mode: send the prefill leg at the same time as PlanTransfer instead of after it. The gateway picks
    # the prefill engine (from its engine list) and names the transfer; the directory holds readiness that comes
    # before the plan. Takes the plan's round trip off time to first token. See docs/gateway.md.
    prefill_before_plan: bool = True
    # Failover: how many times one request is planned again after an engine could not be reached (refused,
    # reset, closed before any response byte), each time reporting that engine to the directory, which
    # leaves it out of plans until it renews its lease. Only before any byte reached the client. 0: never.
    max_failovers: int = 2
    # Serve on uvloop's event loop instead of asyncio's (when installed): 0.1-0.25 ms less per request's time to first
    # token with stand-in engines (docs/performance-log.md, 2026-12-04).
    uvloop: bool = True

    def validate(self) -> None:
        """Raise ValueError naming the first bad setting."""
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for name in ("plan_timeout_s", "connect_timeout_s", "prefill_timeout_s", "decode_timeout_s",
                     "upstream_keepalive_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        for name in ("prefill_first_byte_timeout_s", "decode_first_byte_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative (0: no bound)")
        if not 0 <= self.max_failovers <= 16:
            raise ValueError(f"max_failovers must be in [0, 16], got {self.max_failovers}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port {self.port} out of range")
        if self.mode == "kvpush" and not self.directory_address:
            raise ValueError("kvpush mode needs --directory HOST:PORT (or KVPUSH_DIRECTORY_ADDRESS)")
        if bool(self.directory_tls_client_cert) != bool(self.directory_tls_client_key):
            raise ValueError("--directory-tls-client-cert and --directory-tls-client-key go together")
        if self.local_prefill_engine_id and self.mode != "kvpush":
            raise ValueError("--local-prefill-engine is for kvpush mode (the nixl-* modes have one static prefill "
                             "engine)")
        if self.mode != "kvpush" and not (self.prefill_url and self.decode_url):
            raise ValueError(f"{self.mode} mode needs --prefill-url and --decode-url")
        if self.mode == "nixl-push":
            host, sep, port = self.prefill_side_channel.rpartition(":")
            if not (self.prefill_engine_id and sep and host and port.isdigit()):
                raise ValueError("nixl-push mode needs --prefill-engine-id and --prefill-side-channel HOST:PORT")


def parse_args(argv: Sequence[str] | None = None) -> GatewayConfig:
    """Build a config from flags; KVPUSH_DIRECTORY_ADDRESS / KVPUSH_DIRECTORY_TOKEN fill unset ones."""
    parser = argparse.ArgumentParser(prog="python -m kvpush.gateway",
                                     description="kvpush reference gateway: OpenAI-compatible HTTP and SageMaker "
                                                 "/ping + /invocations, routing each request to a prefill and a "
                                                 "decode engine.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--mode", choices=MODES, default="kvpush")
    parser.add_argument("--directory", default=os.environ.get("KVPUSH_DIRECTORY_ADDRESS", ""),
                        help="KV directory HOST:PORT (kvpush mode)")
    parser.add_argument("--directory-token", default=os.environ.get("KVPUSH_DIRECTORY_TOKEN", ""))
    parser.add_argument("--directory-tls-root-cert", default="",
                        help="CA bundle of the directory channel (default: KVPUSH_DIRECTORY_TLS_ROOT_CERT)")
    parser.add_argument("--directory-tls-client-cert", default="",
                        help="client certificate for mutual TLS (default: KVPUSH_DIRECTORY_TLS_CLIENT_CERT)")
    parser.add_argument("--directory-tls-client-key", default="",
                        help="client key for mutual TLS (default: KVPUSH_DIRECTORY_TLS_CLIENT_KEY)")
    parser.add_argument("--local-prefill-engine", default="",
                        help="kvpush mode: the engine id of the prefill engine beside this gateway; its prefill legs "
                             "go there whenever it is listed as able to take them (a gateway hosted in that engine's "
                             "API server: docs/gateway.md)")
    parser.add_argument("--reuse-port", action=argparse.BooleanOptionalAction, default=False,
                        help="bind the port with SO_REUSEPORT (hosted in vLLM with --api-server-count > 1: each API "
                             "server process hosts a gateway on the one port; default off)")
    parser.add_argument("--prefill-url", default="", help="static prefill engine URL (nixl-* modes)")
    parser.add_argument("--decode-url", default="", help="static decode engine URL (nixl-* modes)")
    parser.add_argument("--prefill-engine-id", default="", help="prefill's kv_transfer_config.engine_id (nixl-push)")
    parser.add_argument("--prefill-side-channel", default="", help="prefill's NIXL side channel HOST:PORT (nixl-push)")
    parser.add_argument("--plan-timeout", type=float, default=5.0, help="seconds for each directory call")
    parser.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to connect to an engine")
    parser.add_argument("--prefill-timeout", type=float, default=120.0, help="seconds for the whole prefill leg")
    parser.add_argument("--decode-timeout", type=float, default=600.0, help="seconds for the whole decode leg")
    parser.add_argument("--prefill-first-byte-timeout", type=float, default=10.0,
                        help="seconds from sending a streamed prefill leg to its response headers (a non-streamed "
                             "one: to its answer, then to the engine's /health answer); an engine over it is reported "
                             "unreachable and the request planned again (0: no bound)")
    parser.add_argument("--decode-first-byte-timeout", type=float, default=10.0,
                        help="seconds from sending a streamed decode leg to its response headers (a non-streamed "
                             "one: to its answer, then to the engine's /health answer); an engine over it is reported "
                             "unreachable and the request planned again (0: no bound)")
    parser.add_argument("--upstream-keepalive", type=float, default=4.0,
                        help="seconds an idle connection to an engine is kept for reuse (below the engines' own "
                             "keep-alive timeout: vLLM's is 5 s)")
    parser.add_argument("--transfer-ttl", type=float, default=0.0, help="seconds a transfer may live (0: default)")
    parser.add_argument("--api-key", default=os.environ.get("KVPUSH_GATEWAY_API_KEY", ""),
                        help="require 'Authorization: Bearer KEY' on /v1/* (env KVPUSH_GATEWAY_API_KEY)")
    parser.add_argument("--count-prompt-tokens", action=argparse.BooleanOptionalAction, default=True,
                        help="count text/chat prompt tokens with a prefill engine's /tokenize before planning, so the "
                             "directory checks decode's free blocks (default on)")
    parser.add_argument("--first-token-from-prefill", action=argparse.BooleanOptionalAction, default=True,
                        help="stream the prefill leg's token at once and force decode's first token to it "
                             "(kvpush mode; only for decode engines that register forces_first_token, see "
                             "`kvpush engines`; the others produce every token). On by default; "
                             "--no-first-token-from-prefill streams decode's tokens only")
    parser.add_argument("--prefill-before-plan", action=argparse.BooleanOptionalAction, default=True,
                        help="kvpush mode: send the prefill leg with PlanTransfer instead of after it (the gateway "
                             "picks the prefill engine and names the transfer; on by default)")
    parser.add_argument("--max-failovers", type=int, default=2,
                        help="times one request is planned again on other engines after an engine could not be "
                             "reached (refused, reset, closed before answering), before any byte reached the "
                             "client; each such engine is reported to the directory (0: never; at most 16)")
    parser.add_argument("--uvloop", action=argparse.BooleanOptionalAction, default=True,
                        help="run on uvloop's event loop when it is installed (default on)")
    args = parser.parse_args(argv)
    config = GatewayConfig(host=args.host, port=args.port, mode=args.mode, directory_address=args.directory,
                           directory_token=args.directory_token,
                           directory_tls_root_cert=args.directory_tls_root_cert,
                           directory_tls_client_cert=args.directory_tls_client_cert,
                           directory_tls_client_key=args.directory_tls_client_key,
                           local_prefill_engine_id=args.local_prefill_engine, reuse_port=args.reuse_port,
                           prefill_url=args.prefill_url.rstrip("/"),
                           decode_url=args.decode_url.rstrip("/"), prefill_engine_id=args.prefill_engine_id,
                           prefill_side_channel=args.prefill_side_channel, plan_timeout_s=args.plan_timeout,
                           connect_timeout_s=args.connect_timeout, prefill_timeout_s=args.prefill_timeout,
                           decode_timeout_s=args.decode_timeout, transfer_ttl_s=args.transfer_ttl,
                           prefill_first_byte_timeout_s=args.prefill_first_byte_timeout,
                           decode_first_byte_timeout_s=args.decode_first_byte_timeout,
                           upstream_keepalive_s=args.upstream_keepalive,
                           api_key=args.api_key, count_prompt_tokens=args.count_prompt_tokens,
                           first_token_from_prefill=args.first_token_from_prefill,
                           prefill_before_plan=args.prefill_before_plan,
                           max_failovers=args.max_failovers, uvloop=args.uvloop)
    try:
        config.validate()
    except ValueError as error:
        parser.error(str(error))
    return config
