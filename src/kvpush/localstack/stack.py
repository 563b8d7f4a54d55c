"""Engine configurations for the three P/D connectors, and a whole loopback stack for the demo and tests.

`kv_transfer_config(...)` (from kvpush.cli.engine_args, which `kvpush engine-args` prints) builds
`--kv-transfer-config` for kvpush's KVPushConnector and for vLLM's NixlConnector (pull) / NixlPushConnector
(push), so the demo, the tests and the benchmark launch engines the same way.

`LocalStack` life cycle (all on 127.0.0.1, ports picked free):
  1. `start()`: tiny model -> directory -> prefill, decode and colocated engines launched together
     (each prints progress while it loads) -> gateway. Any failure stops what started and re-raises.
  2. use `gateway_url`, `colocated_url`, `directory_address`, `prefill`, `decode`.
  3. `stop()`: gateway, engines, directory, each bounded (SIGTERM, then SIGKILL of the group).
With `decode_engine_count` > 1 there are several decode engines (`decodes`; `decode` is the first), as
failover tests and the soak need. Faults for them: `kill(handle)` (SIGKILL of the engine's whole group),
`relaunch(handle)` (the same engine id, port and settings again), `restart_directory()` (SIGKILL, then a new
directory process on the same port; engines and gateway find it again on their own).
With `hosted_gateway=True` the prefill engine also hosts a gateway in its API server (`hosted_gateway_url`; vLLM's
`--middleware`, docs/gateway.md), with the standalone gateway's flags and its legs sent to that engine.
With `mutual_tls=True` every directory channel is mutual TLS with per-engine identities (docs/security.md):
a PKI is made in `log_dir/pki` (`pki.make_stack_pki`), each engine gets its own certificate through
`directory_tls_*` connector settings, the gateway the operator's; `directory_channel()` reaches the
directory as the operator.
"""

from __future__ import annotations

import shlex
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# The runtime's (what `kvpush engine-args` prints); tests and benchmarks import them from here too.
from kvpush.cli.engine_args import HOSTED_GATEWAY_MIDDLEWARE, kv_transfer_config
from kvpush.client import ChannelConfig
from kvpush.gateway.hosted import ARGS_ENV
from kvpush.localstack.model import TinyModelSpec, ensure_tiny_model
from kvpush.localstack.pki import StackPKI, make_stack_pki
from kvpush.localstack.processes import (
    DirectoryHandle,
    EngineHandle,
    EngineSpec,
    GatewayHandle,
    ProgressFn,
    free_port,
    http_ok,
    launch_engine,
    start_directory,
    start_gateway,
)

# Directory flags for local stacks: leases outlive a few seconds of CPU starvation.
DIRECTORY_ARGS = ("--lease-ttl-s", "30")
PREFILL_ENGINE_ID = "prefill-0"
DECODE_ENGINE_ID = "decode-0"
# The first-token logits processor (docs/gateway.md). Decode engines get it from kvpush's `vllm.logits_processors`
# entry point, so they need no flag; deployments that still pass it keep working (FIRST_TOKEN_FLAG_ARGS).
FIRST_TOKEN_PROCESSOR = "kvpush.connector.first_token:ForcePrefillFirstToken"
FIRST_TOKEN_FLAG_ARGS = ("--logits-processors", FIRST_TOKEN_PROCESSOR)
DECODE_ENGINE_ARGS: tuple[str, ...] = ()


def hosted_gateway_env(port: int, directory_address: str, prefill_engine_id: str,
                       flags: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment of a prefill engine that hosts a gateway on 127.0.0.1:`port` (its KVPUSH_GATEWAY_ARGS), its
    legs to `prefill_engine_id`; `flags`: more gateway flags."""
    return {ARGS_ENV: shlex.join(["--host", "127.0.0.1", "--port", str(port), "--directory", directory_address,
                                  "--local-prefill-engine", prefill_engine_id, *flags])}


NIXL_PREFILL_SIDE_CHANNEL_PORT = 5611
NIXL_DECODE_SIDE_CHANNEL_PORT = 5622


def nixl_side_channel_env(host: str, port: int) -> dict[str, str]:
    """Where vLLM's NIXL connectors listen for handshakes (ZMQ side channel)."""
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}


@dataclass
class LocalStack:
    """Directory + prefill/decode engines with KVPushConnector + a colocated reference engine + gateway."""

    spec: TinyModelSpec = field(default_factory=TinyModelSpec)
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvpush-stack-")))
    progress: ProgressFn | None = print
    engine_timeout_s: float = 420.0
    with_colocated: bool = True
    # Every engine of this stack is on one host: keep UCX off other interfaces (a peer load lists them all,
    # holding the GIL, and stalled for a minute when namespaced veth links were up).
    engine_env: dict[str, str] = field(default_factory=lambda: {"UCX_NET_DEVICES": "lo"})
    model_dir: Path | None = None  # set: serve this model folder instead of building the tiny model from `spec`
    # More vLLM flags for every engine (e.g. `kvpush up --tensor-parallel-size 2`); the last of a repeated flag wins.
    engine_args: tuple[str, ...] = ()
    served_model_name: str = "tiny"  # the model's name at the engines and the gateway
    directory: DirectoryHandle | None = None
    prefill: EngineHandle | None = None
    decode: EngineHandle | None = None
    colocated: EngineHandle | None = None
    gateway: GatewayHandle | None = None
    # Mutual TLS with per-engine identities on every directory channel (certificates made in log_dir/pki).
    mutual_tls: bool = False
    pki: StackPKI | None = None
    # Environment of the directory and the gateway (e.g. OTEL_* to export their spans).
    service_env: dict[str, str] = field(default_factory=dict)
    # Prometheus /metrics of the directory and each engine's connector, on free ports (the gateway's is on its own).
    serve_metrics: bool = True
    metrics_ports: dict[str, int] = field(default_factory=dict)
    gateway_port: int | None = None  # None: a free one
    # The gateway streams prefill's first token (`--first-token-from-prefill`, the gateway's default).
    first_token_from_prefill: bool = True
    # Decode engines: the first is DECODE_ENGINE_ID, the others decode-1, decode-2, ...
    decode_engine_count: int = 1
    decodes: list[EngineHandle] = field(default_factory=list)
    # More gateway flags (e.g. --decode-timeout), and more connector settings for every kvpush engine.
    gateway_args: tuple[str, ...] = ()
    connector_extra: dict = field(default_factory=dict)
    # A second gateway, hosted in the prefill engine's API server (`hosted_gateway_url`), with the same flags.
    hosted_gateway: bool = False
    hosted_gateway_port: int | None = None  # None: a free one
    _directory_args: list[str] = field(default_factory=list)

    def _say(self, message: str) -> None:
        if self.progress:
            self.progress(message)

    def start(self) -> LocalStack:
        """Start everything (see the module docstring); on failure stop what started and re-raise."""
        try:
            started = time.monotonic()
            self._say(f"[stack] logs in {self.log_dir}")
            if self.model_dir is None:
                self.model_dir = ensure_tiny_model(self.spec)
                self._say(f"[stack] tiny model ready: {self.model_dir}")
            if self.mutual_tls:
                self.pki = make_stack_pki(self.log_dir / "pki", [PREFILL_ENGINE_ID, *self.decode_engine_ids()])
            tls_args = self.pki.directory_args() if self.pki else []
            # 30 s leases: on a 2-core machine shared with engines a renewal can be late by seconds.
            directory_args = [*DIRECTORY_ARGS, *tls_args]
            if self.serve_metrics:
                self.metrics_ports = {name: free_port() for name in ("directory", "prefill", *self._decode_names())}
                directory_args += ["--metrics-port", str(self.metrics_ports["directory"])]
            self._directory_args = directory_args
            self.directory = start_directory(self.log_dir, progress=self.progress, extra_args=directory_args,
                                             env=self._env("kvpush-directory"))
            self._say(f"[stack] directory ready at {self.directory.address}")
            self._launch_engines()
            self._wait_engines(started)
            self._check_metrics()
            self.gateway = start_gateway(self.log_dir, directory_address=self.directory.address,
                                         progress=self.progress, port=self.gateway_port,
                                         extra_args=self._gateway_flags(),
                                         env={**self._env("kvpush-gateway"),
                                              **(self.pki.client_env("operator") if self.pki else {})})
            self._say(f"[stack] gateway ready at {self.gateway.url} ({time.monotonic() - started:.0f} s in all)")
            if self.hosted_gateway:
                url = self.hosted_gateway_url
                assert self.prefill is not None
                self.prefill.process.wait_ready(lambda: http_ok(url + "/health"), 60.0, progress=self.progress)
                self._say(f"[stack] gateway hosted in the prefill engine's API server ready at {url}")
        except BaseException:
            self.stop()
            raise
        return self

    def _gateway_flags(self) -> tuple[str, ...]:
        """The flags both gateways share (the standalone's host, port and directory come from start_gateway)."""
        return (() if self.first_token_from_prefill else ("--no-first-token-from-prefill",)) + tuple(self.gateway_args)

    def _hosted_gateway_env(self) -> dict[str, str]:
        """KVPUSH_GATEWAY_ARGS of the hosted gateway: the operator's TLS files as flags, so the engine's own
        identity (its connector settings) and the gateway's stay apart in the one process."""
        assert self.directory is not None and self.hosted_gateway_port is not None
        flags = self._gateway_flags()
        if self.pki is not None:
            tls = self.pki.client_env("operator")
            flags += ("--directory-tls-root-cert", tls["KVPUSH_DIRECTORY_TLS_ROOT_CERT"],
                      "--directory-tls-client-cert", tls["KVPUSH_DIRECTORY_TLS_CLIENT_CERT"],
                      "--directory-tls-client-key", tls["KVPUSH_DIRECTORY_TLS_CLIENT_KEY"])
        return hosted_gateway_env(self.hosted_gateway_port, self.directory.address, PREFILL_ENGINE_ID, flags)

    def _env(self, service_name: str) -> dict[str, str]:
        env = dict(self.service_env)
        if "OTEL_EXPORTER_OTLP_ENDPOINT" in env:
            env["OTEL_SERVICE_NAME"] = service_name
        return env

    def decode_engine_ids(self) -> list[str]:
        """The decode engines' ids, first to last."""
        return [DECODE_ENGINE_ID] + [f"decode-{i}" for i in range(1, self.decode_engine_count)]

    def _decode_names(self) -> list[str]:
        """The decode engines' process names (log files, metrics ports): decode, decode-1, ..."""
        return ["decode"] + [f"decode-{i}" for i in range(1, self.decode_engine_count)]

    def _launch_engines(self) -> None:
        assert self.directory is not None and self.model_dir is not None
        prefill_port = free_port()

        def extra(role: str, engine_id: str) -> dict:
            settings = {**self.connector_extra, **(self.pki.connector_settings(engine_id) if self.pki else {})}
            if self.serve_metrics:
                settings["metrics_port"] = self.metrics_ports[role]
            return settings

        def env(role: str) -> dict[str, str]:  # each engine names itself in traces
            named = {"OTEL_SERVICE_NAME": f"kvpush-{role}"} if "OTEL_EXPORTER_OTLP_ENDPOINT" in self.engine_env else {}
            return {**self.engine_env, **named}

        prefill_args: tuple[str, ...] = ()
        prefill_env = env("prefill")
        if self.hosted_gateway:
            self.hosted_gateway_port = self.hosted_gateway_port or free_port()
            prefill_args = ("--middleware", HOSTED_GATEWAY_MIDDLEWARE)
            prefill_env = {**prefill_env, **self._hosted_gateway_env()}
        self.prefill = launch_engine(EngineSpec(
            name="prefill", port=prefill_port, kv_transfer_config=kv_transfer_config(
                "kvpush", "prefill", engine_id=PREFILL_ENGINE_ID, directory_address=self.directory.address,
                engine_endpoint=f"http://127.0.0.1:{prefill_port}", extra=extra("prefill", PREFILL_ENGINE_ID)),
            model_dir=self.model_dir, served_model_name=self.served_model_name, env=prefill_env,
            extra_args=(*prefill_args, *self.engine_args), log_stats=True), self.log_dir)
        for name, engine_id in zip(self._decode_names(), self.decode_engine_ids()):
            decode_port = free_port()
            self.decodes.append(launch_engine(EngineSpec(
                name=name, port=decode_port, kv_transfer_config=kv_transfer_config(
                    "kvpush", "decode", engine_id=engine_id, directory_address=self.directory.address,
                    engine_endpoint=f"http://127.0.0.1:{decode_port}", extra=extra(name, engine_id)),
                model_dir=self.model_dir, served_model_name=self.served_model_name, env=env(name),
                extra_args=(*DECODE_ENGINE_ARGS, *self.engine_args),
                log_stats=True), self.log_dir))
        self.decode = self.decodes[0]
        if self.with_colocated:
            self.colocated = launch_engine(EngineSpec(name="colocated", model_dir=self.model_dir,
                                                      served_model_name=self.served_model_name, env=env("colocated"),
                                                      extra_args=self.engine_args), self.log_dir)
        names = ", ".join(["prefill", *self._decode_names()]) + (" and colocated" if self.with_colocated else "")
        self._say(f"[stack] launched {names} vLLM engines (CPU, eager); loading takes about a minute on 2 cores")

    def _wait_engines(self, started: float) -> None:
        for handle in self.engines():
            remaining = max(1.0, self.engine_timeout_s - (time.monotonic() - started))
            took = handle.wait_ready(remaining, progress=self.progress)
            remaining = max(1.0, self.engine_timeout_s - (time.monotonic() - started))
            warmed = handle.warm_up(remaining)  # compiles vLLM's logprob kernel before any test or user asks
            self._say(f"[stack] {handle.spec.name} engine ready at {handle.url} ({took:.0f} s, warm-up {warmed:.0f} s)")

    def _check_metrics(self) -> None:
        """Every /metrics answers by now (connectors serve theirs before their engine is ready): one that does not
        is named here, not in a test's scrape later (its log says why, e.g. 'metrics port unavailable')."""
        for name, url in self.metrics_urls().items():
            if not http_ok(url, timeout_s=30.0):
                raise RuntimeError(f"{name}'s metrics at {url} do not answer within 30 s: "
                                   f"see {self.log_dir}/{name}.log")

    def processes(self) -> list:
        """Every ManagedProcess started so far (directory, engines, gateway)."""
        handles = [self.directory, *self.engines(), self.gateway]
        return [h.process for h in handles if h is not None]

    def metrics_urls(self) -> dict[str, str]:
        """Where each process serves Prometheus metrics (empty until started, or with serve_metrics off)."""
        urls = {name: f"http://127.0.0.1:{port}/metrics" for name, port in self.metrics_ports.items()}
        if self.gateway is not None:
            urls["gateway"] = self.gateway.url + "/metrics"
        return urls

    def engines(self) -> list[EngineHandle]:
        """The engines started so far."""
        return [e for e in (self.prefill, *self.decodes, self.colocated) if e is not None]

    # ---------------------------------------------------------------- faults (tests, the soak)

    def kill(self, engine: EngineHandle) -> None:
        """SIGKILL an engine's whole process group (API server, EngineCore, workers) and reap it."""
        engine.process._signal_group(signal.SIGKILL)
        engine.process.stop(grace_s=1.0)

    def relaunch(self, engine: EngineHandle) -> EngineHandle:
        """Launch a stopped engine again with the same spec (engine id, port, settings), in its place; returns the
        new handle without waiting (`wait_ready`). Its connector registers as a new worker: the old registration
        must have lapsed or been removed first (ALREADY_EXISTS otherwise)."""
        fresh = launch_engine(engine.spec, self.log_dir)
        if engine is self.prefill:
            self.prefill = fresh
        for index, decode in enumerate(self.decodes):
            if decode is engine:
                self.decodes[index] = fresh
        self.decode = self.decodes[0] if self.decodes else None
        return fresh

    def restart_directory(self) -> None:
        """SIGKILL the directory and start a new one (a new incarnation) on the same port."""
        assert self.directory is not None
        self.directory.process._signal_group(signal.SIGKILL)
        self.directory.process.stop(grace_s=1.0)
        self.directory = start_directory(self.log_dir, port=self.directory.port, progress=self.progress,
                                         extra_args=self._directory_args, env=self._env("kvpush-directory"))

    @property
    def gateway_url(self) -> str:
        """The gateway's base URL."""
        assert self.gateway is not None
        return self.gateway.url

    @property
    def hosted_gateway_url(self) -> str:
        """The base URL of the gateway hosted in the prefill engine's API server (with `hosted_gateway`)."""
        assert self.hosted_gateway and self.hosted_gateway_port is not None
        return f"http://127.0.0.1:{self.hosted_gateway_port}"

    def directory_channel(self, **overrides) -> ChannelConfig:
        """How a test or tool reaches this stack's directory as the operator (mTLS files when on)."""
        tls = {}
        if self.pki is not None:
            tls = dict(root_cert_file=str(self.pki.ca), client_cert_file=str(self.pki.root / "operator.pem"),
                       client_key_file=str(self.pki.root / "operator.key"))
        assert self.directory is not None
        return ChannelConfig(address=self.directory.address, **{**tls, **overrides})

    def stop(self) -> None:
        """Stop everything that runs; safe to call twice."""
        if self.gateway:
            self.gateway.process.stop(grace_s=5.0)
        for engine in self.engines():  # SIGTERM all first: engines shut down in parallel
            engine.process.terminate()
        for engine in self.engines():
            engine.stop(grace_s=15.0)
        if self.directory:
            self.directory.process.stop(grace_s=5.0)

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
