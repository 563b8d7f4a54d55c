"""The KV-directory process: gRPC server, auth, health, reflection, reaper, graceful stop.

Life cycle (`serve(config)`, entered through `asyncio.run`):
1. `create_server(config)` builds a grpc.aio server with the servicer, the `GuardInterceptor`
   (token, decoding, size), `grpc.health.v1` (SERVING) and server reflection,
   binds the address (TLS / mutual TLS when files are given; port 0 picks a free port) and
   returns `(DirectoryServer, port)`.
2. `DirectoryServer.start()` starts serving and the reaper task, which calls `state.reap()`
   every `reap_interval_s` and delivers what it produced (lease lapses, expiries).
3. `DirectoryServer.stop(grace_s)`: health goes NOT_SERVING, every stream is asked to flush
   and end (UNAVAILABLE, so clients reconnect), then `server.stop(grace)` lets unary calls finish.

Oversized messages: gRPC's receive limit is `max_message_bytes`, so a message over it is refused by the
transport (RESOURCE_EXHAUSTED) from its length prefix, before it is buffered, and changes nothing.
Per caller (`admission.py`): unary calls in flight and request bytes held (`GuardInterceptor`), open
streams (the servicer).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvpush.directory import validation as check
from kvpush.directory.admission import CallGate, MemoryReturn, caller_of
from kvpush.directory.auth import Authenticator
from kvpush.directory.errors import DirectoryError, ResourceExhausted
from kvpush.directory.metrics import DirectoryMetrics, RpcMetricsInterceptor, TransferObservers
from kvpush.directory.replica import Replica, ReplicaConfig
from kvpush.directory.servicer import DirectoryServicer
from kvpush.directory.state import Clock, DirectoryState, Limits
from kvpush.directory.telemetry import TransferSpans
from kvpush.observability import configure_logging, configure_tracing, get_logger, shutdown_tracing
from kvpush.v1 import directory_pb2, directory_pb2_grpc

log = get_logger("directory.server")
SERVICE_NAME = directory_pb2.DESCRIPTOR.services_by_name["KVDirectoryService"].full_name
# Health checks stay reachable without a token so orchestrator probes (which send no metadata) work.
_AUTH_EXEMPT_PREFIX = "/grpc.health.v1.Health/"


@dataclass(frozen=True)
class DirectoryConfig:
    """Everything the directory process needs; `kvpush directory` fills it from flags and env."""

    host: str = "127.0.0.1"
    port: int = 50051
    token: str = ""
    # Per-engine tokens: `<principal> <token>` lines (auth.py); turns identities on.
    tokens_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    # Client CA: when set, clients must present a certificate it signed (mutual TLS), and the
    # certificate's URI SAN names the caller (auth.py): identities are on.
    tls_client_ca_file: str = ""
    limits: Limits = field(default_factory=Limits)
    max_message_bytes: int = 16 * 1024 * 1024
    reap_interval_s: float = 0.1
    grace_s: float = 5.0
    keepalive_time_ms: int = 20_000
    max_connection_age_ms: int = 0
    # After max_connection_age_ms, streams get this long to finish before the connection closes.
    max_connection_age_grace_ms: int = 5_000
    # Prometheus /metrics over HTTP on this port of `host` (0: not served; the metrics still count).
    metrics_port: int = 0
    # One of several replicas on etcd (docs/directory-replicas.md); None: one process, all in memory.
    replica: ReplicaConfig | None = None

    @property
    def address(self) -> str:
        """host:port as gRPC binds it."""
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"


class GuardInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc ships no stubs
    """What every call passes before a handler runs: the token, the caller's share, body decoding, the size cap.

    - A call without an admitted bearer token (when one is required) is answered UNAUTHENTICATED by a
      handler that never reads the request: an unauthenticated caller's bytes are not buffered or parsed.
    - A request over `max_bytes` never reaches the directory: gRPC's receive limit is set to it, so the
      transport refuses it (RESOURCE_EXHAUSTED) from its length prefix, before buffering it.
    - A unary call (and a server stream's request) is read only within its caller's share (`admission.CallGate`:
      calls in flight, calls waiting unread, request bytes in flight); past it RESOURCE_EXHAUSTED.
    - A body that does not decode is INVALID_ARGUMENT (gRPC's own answer would be UNKNOWN/INTERNAL): the
      deserializer yields `validation.Undecodable`, which the request reader here and the servicer's stream
      readers refuse.
    Health checks pass untouched so orchestrator probes (which send no metadata) work.
    """

    def __init__(self, authenticator: Authenticator, max_bytes: int, gate: CallGate,
                 limit_refusals: Counter[str], memory: MemoryReturn) -> None:
        self._auth = authenticator
        self._max_bytes = max_bytes
        self._gate = gate
        self._limit_refusals = limit_refusals
        self._memory = memory

    def caller(self, context: grpc.aio.ServicerContext) -> str:
        """The caller key of a call (`admission.caller_of`): its principal, else its peer's host."""
        try:
            principal = str(self._auth.principal(context.invocation_metadata(), context.auth_context()))
        except DirectoryError:  # no identity proved: the handler refuses it; until then it is its address
            principal = ""
        return caller_of(principal, context.peer() or "")

    # Any (here and below): grpc's handlers, call details and contexts are untyped (grpc ships no stubs).
    async def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        """Refuse unauthenticated calls unread; read unary requests within the caller's share, checked."""
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(_AUTH_EXEMPT_PREFIX):
            return handler
        if not self._auth.admits(handler_call_details.invocation_metadata):
            return _REFUSE_UNREAD
        deserializer = check.decoding(handler.request_deserializer)
        kwargs = dict(request_deserializer=deserializer, response_serializer=handler.response_serializer)
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(handler.stream_stream, **kwargs)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(handler.stream_unary, **kwargs)
        streaming = handler.response_streaming
        inner = handler.unary_stream if streaming else handler.unary_unary

        # Served as a bidi handler whatever the method's shape: gRPC then reads the request only when asked.
        async def gated(request_iterator: Any, context: Any) -> AsyncIterator[Any]:
            caller = self.caller(context)
            try:
                async with self._gate.slot(caller) as charge:
                    request = await self._read_request(context, charge)
                    if not streaming:
                        yield await inner(request, context)
                        return
            except ResourceExhausted as error:
                self._limit_refusals[error.limit] += 1
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
            async for response in inner(request, context):  # a stream's life is not a call in flight
                yield response

        return grpc.stream_stream_rpc_method_handler(gated, **kwargs)

    async def _read_request(self, context: grpc.aio.ServicerContext, charge: Callable[[int], None]) -> Any:
        request = await context.read()
        if request is grpc.aio.EOF:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no request message")
        if isinstance(request, check.Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request body does not decode: {request}")
        size = request.ByteSize()
        self._memory.note(size)
        if size > self._max_bytes:  # gRPC's receive limit refuses these first; kept as a guard
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request is {size} bytes; the limit is {self._max_bytes}")
        charge(size)
        return request


async def _refuse_unread(request_iterator: Any, context: Any) -> AsyncIterator[None]:
    # A request-streaming handler runs before any message is read; the caller's body is never taken in.
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
    yield  # makes this an async generator, as a streaming handler must be


# Whatever the method's shape, the refusal is a bidi handler: gRPC then reads nothing before it runs.
_REFUSE_UNREAD = grpc.stream_stream_rpc_method_handler(_refuse_unread)


def _read(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def _tls_files(config: DirectoryConfig) -> tuple[str, ...]:
    return tuple(f for f in (config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file) if f)


def _certificate_configuration(config: DirectoryConfig) -> Any:  # Any: grpc's configuration object
    client_ca = _read(config.tls_client_ca_file) if config.tls_client_ca_file else None
    return grpc.ssl_server_certificate_configuration(
        [(_read(config.tls_key_file), _read(config.tls_cert_file))], root_certificates=client_ca)


def server_credentials(config: DirectoryConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from the config's files (None: plaintext).

    The files are re-read on the first handshake after one of them changed, so certificates, keys and
    the client CA rotate without a restart (connections already open keep their session).
    """
    if not config.tls_cert_file and not config.tls_key_file:
        if config.tls_client_ca_file:
            raise ValueError("tls_client_ca_file needs tls_cert_file and tls_key_file")
        return None
    if not (config.tls_cert_file and config.tls_key_file):
        raise ValueError("TLS needs both tls_cert_file and tls_key_file")
    files = _tls_files(config)
    seen = {path: os.stat(path).st_mtime_ns for path in files}

    def fetch() -> Any:
        try:
            current = {path: os.stat(path).st_mtime_ns for path in files}
            if current == seen:
                return None  # unchanged: gRPC keeps the configuration it has
            configuration = _certificate_configuration(config)
        except (OSError, ValueError, RuntimeError) as error:  # half-written files: keep the last good ones
            log.warning("TLS files changed but could not be loaded; keeping the previous ones", error=str(error))
            return None
        seen.update(current)
        log.info("TLS certificates reloaded", files=list(files))
        return configuration

    return grpc.dynamic_ssl_server_credentials(
        _certificate_configuration(config), fetch,
        require_client_authentication=bool(config.tls_client_ca_file))


class DirectoryServer:
    """A started-or-startable directory: the grpc.aio server, its state, servicer and reaper."""

    def __init__(self, config: DirectoryConfig, server: grpc.aio.Server, state: DirectoryState,
                 servicer: DirectoryServicer, health_servicer: health.aio.HealthServicer,
                 metrics: DirectoryMetrics | None = None, memory: MemoryReturn | None = None) -> None:
        self.config = config
        self.metrics = metrics or DirectoryMetrics()
        self._metrics_http: web.AppRunner | None = None
        self.server = server
        self.state = state
        self.servicer = servicer
        self.health = health_servicer
        self._reaper: asyncio.Task[None] | None = None
        # Gives large requests' memory back after they are gone (the reaper ticks it).
        self.memory = memory or MemoryReturn()

    async def start(self) -> None:
        """Start serving and reaping (a replica joins etcd first: it serves no shard before its session)."""
        if self.servicer.replica is not None:
            await self.servicer.replica.start()
        await self.server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        self._reaper = asyncio.create_task(self._reap_forever(), name="kvpush-directory-reaper")
        if self.config.metrics_port:
            self._metrics_http = await self.metrics.start_http(self.config.host, self.config.metrics_port)

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.reap_interval_s)
            try:
                await self.memory.tick()
                effects = self.state.reap()
                self.metrics.on_reap(effects)
                if effects.stall_s:
                    log.warning("directory stalled; leases extended by the stall", stall_s=round(effects.stall_s, 3))
                self.servicer.deliver(effects)
            except Exception:  # a reaper that dies would stop every lease from lapsing
                log.exception("reap failed")

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain streams, then stop the server within the grace period."""
        grace = self.config.grace_s if grace_s is None else grace_s
        await self.health.enter_graceful_shutdown()
        if self.servicer.replica is not None:  # hand the shards over once their transfers ended
            await self.servicer.replica.stop(grace)
        self.servicer.begin_shutdown()
        if self._reaper is not None:
            self._reaper.cancel()
        await self.server.stop(grace)
        if self._metrics_http is not None:
            await self._metrics_http.cleanup()

    async def wait_for_termination(self) -> None:
        """Block until the server stopped."""
        await self.server.wait_for_termination()


def create_server(config: DirectoryConfig, clock: Clock | None = None) -> tuple[DirectoryServer, int]:
    """Build (not start) the directory server and bind it; returns it and the bound port."""
    metrics = DirectoryMetrics()
    state = DirectoryState(config.limits, clock or Clock(), TransferObservers(TransferSpans(), metrics))
    authenticator = Authenticator(config.token, config.tokens_file, mutual_tls=bool(config.tls_client_ca_file))
    # A fresh random id per process: every response carries it, so clients see a restart whatever
    # the sequence numbers say.
    incarnation_id = uuid.uuid4().hex
    servicer = DirectoryServicer(state, max_message_bytes=config.max_message_bytes, authenticator=authenticator,
                                 incarnation_id=incarnation_id)
    metrics.bind(state, servicer)
    options = [
        # What the directory accepts, and no more: gRPC refuses a longer message from its length prefix, unread.
        ("grpc.max_receive_message_length", config.max_message_bytes),
        # Answers are bounded by MAX_PAGE_BYTES (listings) and the layout caps; 4x leaves room for both.
        ("grpc.max_send_message_length", 4 * config.max_message_bytes),
        ("grpc.keepalive_time_ms", config.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        # Two directories must never share a port silently (gRPC sets SO_REUSEPORT by default).
        ("grpc.so_reuseport", 0),
        # No BDP probing: it grows every stream's receive window (to megabytes), which gRPC core fills before
        # the GuardInterceptor can refuse an unauthenticated call: eight 32 MiB calls on a loaded machine cost
        # 80 MiB of RSS with it, under 1 MiB without (tests/integration/directory/test_bounds.py). Directory
        # messages are small; the default window (64 KiB) is plenty for them.
        ("grpc.http2.bdp_probe", 0),
    ]
    if config.max_connection_age_ms:
        options.append(("grpc.max_connection_age_ms", config.max_connection_age_ms))
        options.append(("grpc.max_connection_age_grace_ms", config.max_connection_age_grace_ms))
    # Metrics outermost: refused calls are observed with their codes too.
    memory = MemoryReturn()
    server = grpc.aio.server(options=options, interceptors=[
        RpcMetricsInterceptor(metrics),
        GuardInterceptor(authenticator, config.max_message_bytes, CallGate(config.limits), servicer.limit_refusals,
                         memory)])
    directory_pb2_grpc.add_KVDirectoryServiceServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server)
    credentials = server_credentials(config)
    try:
        if credentials is None:
            port = server.add_insecure_port(config.address)
        else:
            port = server.add_secure_port(config.address, credentials)
    except RuntimeError as error:  # gRPC's way of saying the bind failed
        raise OSError(f"could not bind {config.address} (in use, or not an address of this host)") from error
    if port == 0:
        raise OSError(f"could not bind {config.address}")
    if config.replica is not None:
        replica_config = config.replica
        if not replica_config.advertise_address:
            if config.host in ("0.0.0.0", "::", "[::]", ""):
                raise ValueError("a replica listening on every interface needs --advertise-address (the host:port "
                                 "clients reach it at: redirects name it)")
            replica_config = dataclasses.replace(replica_config, advertise_address=f"{config.host}:{port}")
        servicer.replica = Replica(replica_config, state, servicer.deliver)
    return DirectoryServer(config, server, state, servicer, health_servicer, metrics, memory), port


async def run(config: DirectoryConfig) -> None:
    """Serve until SIGINT/SIGTERM, then stop gracefully."""
    directory, port = create_server(config)
    await directory.start()
    auth = directory.servicer.auth
    if not auth.identities:
        log.warning("DIRECTORY TRUSTS EVERY CALLER: no per-engine identities are configured, so any client "
                    + ("holding the shared token " if config.token else "")
                    + "may act as every engine (register, renew, report, stream, cancel) and see every "
                    "transfer; configure --tokens-file or mutual TLS with engine certificates (docs/security.md)")
    log.info("directory serving", address=config.address, port=port, tls=bool(config.tls_cert_file),
             mutual_tls=bool(config.tls_client_ca_file), auth=auth.describe(),
             incarnation_id=directory.servicer.incarnation_id,
             lease_ttl_s=config.limits.lease_ttl_s, transfer_ttl_s=config.limits.transfer_ttl_s,
             metrics_port=config.metrics_port or None)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopping.set)
    try:
        await stopping.wait()
    finally:
        log.info("directory stopping", grace_s=config.grace_s)
        await directory.stop()
        log.info("directory stopped")


def serve(config: DirectoryConfig, use_uvloop: bool = True) -> None:
    """Entry point: configure logs and tracing, run the server on a fresh event loop."""
    configure_logging()
    configure_tracing("kvpush-directory")
    try:
        if use_uvloop:
            try:
                import uvloop
            except ImportError:
                use_uvloop = False
        if use_uvloop:
            uvloop.run(run(config))
        else:
            asyncio.run(run(config))
    finally:
        shutdown_tracing()
