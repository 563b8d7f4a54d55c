"""`kvpush engine-args`: the `vllm serve` arguments of a prefill or decode engine with KVPushConnector.

The one source of engine flags: README.md, docs/gateway.md, deploy/ and the EC2 run-book either call this
(`vllm serve "$MODEL" $(kvpush engine-args --role prefill ...)`) or carry exactly what it prints
(tests/unit/cli/test_engine_args.py compares them). What it prints, in order:

    --port PORT [--block-size N] --kv-transfer-config JSON [--middleware kvpush.gateway.hosted.HostedGateway]

The JSON is compact (no spaces), so the words survive the shell's word splitting of `$(...)` unquoted.
`--format shell` quotes them for pasting; `--format json` prints the argument list as JSON.
The directory token is never printed: the connector reads `KVPUSH_DIRECTORY_TOKEN` (and the other
`KVPUSH_DIRECTORY_*` settings) from the engine's environment, which keeps it out of process listings.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# vLLM's own API port default; engines of one host need one each.
DEFAULT_PORTS = {"prefill": 8100, "decode": 8200}
FORMATS = ("words", "shell", "json")
# What a prefill engine loads to host a gateway in its API server (kvpush.gateway.hosted).
HOSTED_GATEWAY_MIDDLEWARE = "kvpush.gateway.hosted.HostedGateway"


def kv_transfer_config(connector: str, role: str, *, engine_id: str | None = None, directory_address: str = "",
                       engine_endpoint: str = "", extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`--kv-transfer-config` for `connector` in {"kvpush", "nixl-pull", "nixl-push"}, role "prefill"/"decode"."""
    if role not in ("prefill", "decode"):
        raise ValueError(f"role must be prefill or decode, got {role!r}")
    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    if connector == "kvpush":
        if not directory_address or not engine_endpoint:
            raise ValueError("kvpush engines need directory_address and engine_endpoint")
        config: dict[str, Any] = {
            "kv_connector": "KVPushConnector", "kv_connector_module_path": "kvpush.connector", "kv_role": kv_role,
            "kv_connector_extra_config": {"directory_address": directory_address, "engine_endpoint": engine_endpoint,
                                          **(extra or {})}}
    elif connector in ("nixl-pull", "nixl-push"):
        name = "NixlConnector" if connector == "nixl-pull" else "NixlPushConnector"
        config = {"kv_connector": name, "kv_role": kv_role, "kv_connector_extra_config": dict(extra or {})}
    else:
        raise ValueError(f"unknown connector {connector!r}: use kvpush, nixl-pull or nixl-push")
    if engine_id:
        config["engine_id"] = engine_id
    return config


@dataclass(frozen=True)
class EngineArgs:
    """What an engine needs to join a kvpush deployment; `argv()` is its `vllm serve` arguments."""

    role: str
    directory_address: str
    port: int
    advertise_host: str = "127.0.0.1"
    engine_endpoint: str = ""  # empty: http://advertise_host:port
    engine_id: str = ""  # empty: vLLM's random id
    block_size: int | None = None
    nixl_backends: tuple[str, ...] = ()  # empty: the connector's default (UCX)
    nixl_num_threads: int | None = None
    metrics_port: int | None = None
    hosted_gateway: bool = False
    extra_config: dict[str, Any] = field(default_factory=dict)

    def endpoint(self) -> str:
        """The URL the gateway sends this engine's legs to."""
        return self.engine_endpoint or f"http://{self.advertise_host}:{self.port}"

    def connector_extra(self) -> dict[str, Any]:
        """kv_connector_extra_config beyond directory_address and engine_endpoint."""
        extra: dict[str, Any] = {}
        if self.nixl_backends:
            extra["nixl_backends"] = list(self.nixl_backends)
        if self.nixl_num_threads is not None:
            extra["nixl_num_threads"] = self.nixl_num_threads
        if self.metrics_port is not None:
            extra["metrics_port"] = self.metrics_port
        return {**extra, **self.extra_config}

    def argv(self) -> list[str]:
        """The arguments, one word each; raises ValueError on settings an engine would refuse."""
        if self.role not in DEFAULT_PORTS:
            raise ValueError(f"--role must be prefill or decode, got {self.role!r}")
        if self.hosted_gateway and self.role != "prefill":
            raise ValueError("--hosted-gateway is for prefill engines (the gateway sends its prefill legs in process)")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port {self.port} is not a port")
        config = kv_transfer_config("kvpush", self.role, engine_id=self.engine_id or None,
                                    directory_address=self.directory_address, engine_endpoint=self.endpoint(),
                                    extra=self.connector_extra())
        _check_connector_config(config, self.role)
        argv = ["--port", str(self.port)]
        if self.block_size is not None:
            argv += ["--block-size", str(self.block_size)]
        argv += ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]
        if self.hosted_gateway:
            argv += ["--middleware", HOSTED_GATEWAY_MIDDLEWARE]
        for word in argv:
            if not word or any(c.isspace() for c in word):
                raise ValueError(f"{word!r}: a setting with spaces would not survive `$(kvpush engine-args ...)`")
        return argv


def _check_connector_config(config: Mapping[str, Any], role: str) -> None:
    """Refuse here what the connector would refuse at the engine's start (unknown keys, bad address, ...)."""
    from kvpush.connector.config import ConnectorConfig, ConnectorConfigError

    try:
        ConnectorConfig.from_extra_config(config["kv_connector_extra_config"], role=role,
                                          engine_id=config.get("engine_id", "check"))
    except ConnectorConfigError as error:
        raise ValueError(str(error)) from None


def render(argv: Sequence[str], fmt: str) -> str:
    """The arguments as `fmt` prints them."""
    if fmt == "words":
        return " ".join(argv)
    if fmt == "shell":
        return shlex.join(argv)
    if fmt == "json":
        return json.dumps(list(argv))
    raise ValueError(f"--format must be one of {FORMATS}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `kvpush engine-args`."""
    parser.add_argument("--role", required=True, choices=sorted(DEFAULT_PORTS),
                        help="prefill (kv_producer: pushes its KV) or decode (kv_consumer: receives it)")
    parser.add_argument("--directory", default=os.environ.get("KVPUSH_DIRECTORY_ADDRESS") or "127.0.0.1:50051",
                        metavar="ADDR", help="the KV directory's host:port as the engine reaches it; replicas "
                                             "comma-separated (env KVPUSH_DIRECTORY_ADDRESS; default %(default)s)")
    parser.add_argument("--port", type=int,
                        help="the engine's API port (printed as vLLM's --port; default 8100 prefill, 8200 decode)")
    parser.add_argument("--advertise-host", default="127.0.0.1",
                        help="host or IP the gateway reaches this engine at; the engine registers "
                             "http://HOST:PORT (default %(default)s)")
    parser.add_argument("--engine-endpoint", default="", metavar="URL",
                        help="the engine's URL for the gateway, when it is not http://ADVERTISE_HOST:PORT "
                             "(e.g. behind a proxy)")
    parser.add_argument("--engine-id", default="",
                        help="the engine's id at the directory (kvpush engines shows it); default: vLLM's random id")
    parser.add_argument("--block-size", type=int,
                        help="tokens per KV block, printed as vLLM's --block-size; prefill and decode must use "
                             "the same (default: vLLM's)")
    parser.add_argument("--nixl-backends", default="", metavar="LIST",
                        help="NIXL backends, comma-separated, e.g. LIBFABRIC on EFA (default: the connector's, UCX)")
    parser.add_argument("--nixl-num-threads", type=int,
                        help="NIXL worker threads per transfer (default: the connector's)")
    parser.add_argument("--metrics-port", type=int,
                        help="serve the connector's Prometheus /metrics on this port (TP rank r on PORT + r)")
    parser.add_argument("--hosted-gateway", action="store_true",
                        help="prefill only: also load the gateway hosted in vLLM's API server (vLLM's "
                             "--middleware; its flags come from KVPUSH_GATEWAY_ARGS, docs/gateway.md)")
    parser.add_argument("--extra-config", default="{}", metavar="JSON",
                        help="more kv_connector_extra_config settings as a JSON object (docs/connector.md)")
    parser.add_argument("--format", choices=FORMATS, default="words",
                        help="words: for `$(kvpush engine-args ...)` (default); shell: quoted, to paste; "
                             "json: the argument list as JSON")


def from_args(args: argparse.Namespace) -> EngineArgs:
    """The settings `kvpush engine-args` was given; raises ValueError on malformed ones."""
    try:
        extra = json.loads(args.extra_config)
    except json.JSONDecodeError as error:
        raise ValueError(f"--extra-config is not JSON: {error}") from None
    if not isinstance(extra, dict):
        raise ValueError("--extra-config must be a JSON object")
    return EngineArgs(role=args.role, directory_address=args.directory,
                      port=args.port if args.port is not None else DEFAULT_PORTS[args.role],
                      advertise_host=args.advertise_host, engine_endpoint=args.engine_endpoint,
                      engine_id=args.engine_id, block_size=args.block_size,
                      nixl_backends=tuple(b.strip() for b in args.nixl_backends.split(",") if b.strip()),
                      nixl_num_threads=args.nixl_num_threads, metrics_port=args.metrics_port,
                      hosted_gateway=args.hosted_gateway, extra_config=extra)


def run(args: argparse.Namespace) -> int:
    """Print the arguments; 2 with the reason on stderr for settings an engine would refuse."""
    try:
        print(render(from_args(args).argv(), args.format))
    except ValueError as error:
        print(f"kvpush engine-args: {error}", file=sys.stderr)
        return 2
    return 0
