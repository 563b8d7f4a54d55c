"""Typed parsing of the connector's `kv_connector_extra_config`.

Life cycle: vLLM builds one `KVTransferConfig` per engine; both connector halves (scheduler process and
each worker process) call `ConnectorConfig.from_kv_transfer_config` once at construction. Parsing is
strict: an unknown key, a wrong type or an out-of-range value raises `ConnectorConfigError` naming the
key, so a typo fails engine start-up instead of silently running with a default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

# kv_role values vLLM accepts, and what each means for kvpush.
ROLE_PREFILL = "prefill"
ROLE_DECODE = "decode"
_KV_ROLE_TO_ROLE = {"kv_producer": ROLE_PREFILL, "kv_consumer": ROLE_DECODE}

_KNOWN_BACKENDS = frozenset({"UCX", "LIBFABRIC", "GDS", "GDS_MT", "POSIX", "OBJ", "MOONCAKE", "UCCL"})


class ConnectorConfigError(ValueError):
    """A kv_transfer_config value the connector cannot run with; the message names the key."""


@dataclasses.dataclass(frozen=True)
class ConnectorConfig:
    """Everything the connector reads from vLLM's kv_transfer_config, validated.

    directory_address: host:port of the KV-directory (required).
    directory_settings: every `directory_*` key (token, TLS files, timeouts), passed to the client library's
        `ChannelConfig.from_dict`, which validates them (directory_token, directory_tls_root_cert,
        directory_tls_client_cert, directory_tls_client_key, directory_tls_server_name, directory_timeout_s,
        directory_max_attempts).
    nixl_backends: NIXL backends to create (default ["UCX"]).
    nixl_enable_prog_thread: run NIXL's progress thread (default False: on few cores it busy-spins).
    nixl_num_threads: UCX/LIBFABRIC worker threads (default 0 = backend default).
    nixl_poll_max_s / nixl_notif_poll_s: the data plane's longest sleep between completion polls while writes
        are in flight, and its notification poll interval (default 1 ms each; 200 µs / 100 µs on GPU servers
        with cores to spare, see docs/dataplane.md).
    nixl_check_in_post_order: check each transfer's in-flight writes oldest first and stop at the first still in
        progress (default True; `NixlConfig.check_in_post_order` says why).
    nixl_io_trace_path: a file the data plane's I/O thread appends per-iteration timings to (`{pid}` and `{agent}`
        filled in; default none). A profiling aid: `python -m bench gpu profile` reads it.
    gil_switch_interval_s: this engine's processes call `sys.setswitchinterval` with it (default null: Python's
        5 ms). A thread that hands the GIL back around a NIXL or CUDA call waits up to this long to take it again
        while the forward thread runs Python; the data plane's thread makes one such call per post and per check.
    cuda_sync_mode: how this engine's CUDA context waits for the GPU: "spin", "yield", "blocking" or "auto"
        (default null: CUDA's own, which spins). Set by each worker when it registers its KV caches
        (`dataplane.cuda_sched`); ignored where no CUDA context is current (CPU engines).
    engine_endpoint: this engine's HTTP URL, registered with the directory (optional).
    transfer_timeout_s: decode-side bound on waiting for one transfer (default 60).
    push_timeout_s: prefill-side bound on holding a finished request's blocks for pushes (default 60).
    decode_allocation_wait_s: how long a decode engine leaves a decode leg waiting, without blocks, for its
        prefill to start (the directory saw the transfer's first readiness) before it allocates anyway (default 10;
        null or 0: allocate at once, as soon as the leg arrives). The leg's blocks are then held only while bytes
        can land in them, not while the prefill engine queues the request.
    max_write_s: the longest one posted WRITE may stay in flight (default 10): past it the data plane aborts it
        (releases its handles, drops the peer's connection), so nothing of it lands later. The directory's
        `--max-write-s` must be at least every prefill engine's value, and decode's own unconfirmed release
        waits for it (docs/connector.md, Block lifetime): set the same value on every engine and the directory.
    message_queue_poll_s: while vLLM's shared-memory message-queue readers busy-wait in this engine's
        processes, sleep this long per check instead of `sched_yield` (default 0.0001 on vLLM's CPU platform,
        where the spin starves the connector's threads of the GIL while the engine steps:
        `connector.engine_spin`; default null, vLLM's own spin, on GPUs, where a step takes milliseconds and a
        sleeping reader would add up to 1 ms to each).
    idle_step_wait_s: on the second and later of back-to-back steps that schedule no tokens while transfers are
        in flight (or, on decode, legs wait for their prefill's start), the worker waits this long at most for a
        transfer signal before returning to vLLM (default 0.004; 0 = never wait). Ends early on any signal; spares
        the CPU that back-to-back empty steps would burn. The empty step right after a forward never waits: on a
        one-process executor vLLM emits that forward's tokens only after it.
    batch_layer_posts: on a GPU prefill engine, hold a step's layers after its first while the GPU keeps up with
        the host, with no CUDA call and no post in their save_kv_layer, and hand them to the push owner in one post
        at wait_for_save behind one CUDA event recorded there (default True). Such a forward is bound by its kernel
        launches: every post wakes the NIXL I/O thread and every CUDA call lets the connector's other threads take
        the GIL from them. The GPU's progress is probed at strides growing 4x while it keeps up; while it is behind
        (a long forward) a layer goes at once behind its own event, with any held before it. The step's first
        layer always goes at once (its readiness brings the instruction back while the forward runs). No effect
        on CPU engines, whose layers are computed when save_kv_layer runs.
    post_after_output: where the prefill engine's scheduler and its one worker share a process (vLLM's
        UniProcExecutor: one GPU), a batch_layer_posts step whose GPU kept up with the host throughout posts
        nothing while it runs, its first layer included, and hands its layers to the push owner only once the
        scheduler processed the step's output, plus output_grace_s (default True). NIXL 1.5.1's transfer() holds
        the GIL for the whole post (~1.6-2.7 ms for a 512-token step's held layers on the H200), and in such a
        step every post, readiness and instruction in the engine's process delays the sampled token by the GIL
        time it takes. The push then starts right after the token leaves: off time to first token with first
        token from prefill, on decode's second token. Steps whose GPU fell behind stream as before (their first
        readiness one layer later). Elsewhere (a worker process of its own) no effect.
    output_grace_s: how long after the scheduler processed a deferred step's output its push waits, so that
        vLLM's output thread sends the token before the I/O thread takes the GIL (default 0.0005).
    max_output_wait_s: the longest a deferred step's push waits for its output to be processed at all; then it
        is posted anyway (default 0.05).
    preload_peers: a prefill worker loads each decode worker the directory announces (PeerAnnouncement) at once,
        so a first contact's wire-up is not on a request's path; false: only when an instruction names it.
    metrics_port: serve this engine's kvpush_connector_* Prometheus metrics over HTTP (default 0: off): the
        worker of TP rank r on metrics_port + r, at /metrics (`connector.metrics`).
    fault_stall_after_writes: TESTING ONLY. Once a prefill worker posted this many writes of a transfer it
        plans no more, as a stuck or dying writer would (default None: off). Fault-injection tests use it to
        kill a prefill engine while a transfer is really half-written.
    fault_hold_posted_write_s: TESTING ONLY. Every posted write of a transfer after its first
        `fault_hold_after_writes` is held this long inside the data plane before its bytes move, as a WRITE
        stuck in the network would be: it counts as in flight, cannot be cancelled, and lands late (or is
        aborted at max_write_s). Default 0: off. The block-lifetime tests stall a write past a failure with it.
        `fault_hold_from_token` (default 0) holds only writes that reach past that token of the prompt.
    """

    role: str
    engine_id: str
    directory_address: str
    directory_settings: tuple[tuple[str, object], ...] = ()
    nixl_backends: tuple[str, ...] = ("UCX",)
    nixl_enable_prog_thread: bool = False
    nixl_num_threads: int = 0
    nixl_poll_max_s: float = 0.001
    nixl_notif_poll_s: float = 0.001
    nixl_check_in_post_order: bool = True
    nixl_io_trace_path: str = ""
    gil_switch_interval_s: float | None = None
    cuda_sync_mode: str | None = None
    engine_endpoint: str = ""
    transfer_timeout_s: float = 60.0
    push_timeout_s: float = 60.0
    decode_allocation_wait_s: float | None = 10.0
    message_queue_poll_s: float | None = 0.0001
    idle_step_wait_s: float = 0.004
    batch_layer_posts: bool = True
    post_after_output: bool = True
    preload_peers: bool = True
    output_grace_s: float = 0.0005
    max_output_wait_s: float = 0.05
    metrics_port: int = 0
    fault_stall_after_writes: int | None = None
    max_write_s: float = 10.0
    fault_hold_posted_write_s: float = 0.0
    fault_hold_after_writes: int = 0
    fault_hold_from_token: int = 0

    @property
    def is_prefill(self) -> bool:
        """True on a prefill (kv_producer) engine."""
        return self.role == ROLE_PREFILL

    @property
    def is_decode(self) -> bool:
        """True on a decode (kv_consumer) engine."""
        return self.role == ROLE_DECODE

    def channel_config_dict(self) -> dict[str, object]:
        """The directory-channel settings as the client library's ChannelConfig.from_dict expects them."""
        return {**dict(self.directory_settings), "directory_address": self.directory_address}

    @classmethod
    def from_kv_transfer_config(cls, kv_transfer_config: object) -> ConnectorConfig:
        """Parse vLLM's KVTransferConfig (duck-typed: kv_role, engine_id, kv_connector_extra_config)."""
        kv_role = getattr(kv_transfer_config, "kv_role", None)
        if kv_role not in _KV_ROLE_TO_ROLE:
            raise ConnectorConfigError(
                f"kv_role must be 'kv_producer' (prefill) or 'kv_consumer' (decode) for KVPushConnector, "
                f"got {kv_role!r}")
        engine_id = getattr(kv_transfer_config, "engine_id", None)
        if not engine_id or not isinstance(engine_id, str):
            raise ConnectorConfigError("kv_transfer_config.engine_id must be a non-empty string")
        extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
        if not isinstance(extra, Mapping):
            raise ConnectorConfigError(f"kv_connector_extra_config must be a mapping, got {type(extra).__name__}")
        from kvpush.connector.compat import running_on_cpu_platform

        return cls.from_extra_config(extra, role=_KV_ROLE_TO_ROLE[kv_role], engine_id=engine_id,
                                     cpu_platform=running_on_cpu_platform())

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, object], *, role: str, engine_id: str,
                          cpu_platform: bool = True) -> ConnectorConfig:
        """Parse kv_connector_extra_config for an engine of this role; raise ConnectorConfigError on bad input.

        `cpu_platform` picks the defaults that differ between vLLM's CPU platform and GPUs.
        """
        if role not in (ROLE_PREFILL, ROLE_DECODE):
            raise ConnectorConfigError(f"role must be {ROLE_PREFILL!r} or {ROLE_DECODE!r}, got {role!r}")
        if not isinstance(extra, Mapping):
            raise ConnectorConfigError(f"kv_connector_extra_config must be a mapping, got {type(extra).__name__}")
        known = {f.name for f in dataclasses.fields(cls)} - {"role", "engine_id", "directory_settings"}
        unknown = sorted(k for k in set(extra) - known if not str(k).startswith("directory_"))
        if unknown:
            raise ConnectorConfigError(
                f"kv_connector_extra_config has unknown key(s) {unknown}; known: {sorted(known)}")
        if "directory_address" not in extra:
            raise ConnectorConfigError("kv_connector_extra_config.directory_address (host:port) is required")
        return cls(
            role=role,
            engine_id=engine_id,
            directory_address=_host_port(extra["directory_address"]),
            directory_settings=_directory_settings(extra),
            nixl_backends=_backends(extra.get("nixl_backends", ["UCX"])),
            nixl_enable_prog_thread=_bool(extra, "nixl_enable_prog_thread", False),
            nixl_num_threads=_int(extra, "nixl_num_threads", 0, minimum=0, maximum=256),
            nixl_poll_max_s=_seconds(extra, "nixl_poll_max_s", 0.001, low=50e-6, low_included=True, high=0.1),
            nixl_notif_poll_s=_seconds(extra, "nixl_notif_poll_s", 0.001, low=50e-6, low_included=True, high=0.1),
            nixl_check_in_post_order=_bool(extra, "nixl_check_in_post_order", True),
            nixl_io_trace_path=_optional_str(extra, "nixl_io_trace_path") or "",
            gil_switch_interval_s=_optional_seconds(extra, "gil_switch_interval_s", None, low=1e-6, low_included=True,
                                                    high=0.1, nullable=True),
            cuda_sync_mode=_choice(extra, "cuda_sync_mode", ("auto", "spin", "yield", "blocking")),
            engine_endpoint=_optional_str(extra, "engine_endpoint") or "",
            transfer_timeout_s=_seconds(extra, "transfer_timeout_s", 60.0),
            push_timeout_s=_seconds(extra, "push_timeout_s", 60.0),
            decode_allocation_wait_s=_optional_seconds(extra, "decode_allocation_wait_s", 10.0, low_included=True,
                                                       high=3600.0, nullable=True) or None,
            message_queue_poll_s=_optional_seconds(extra, "message_queue_poll_s", 0.0001 if cpu_platform else None,
                                                   high=0.01, nullable=True),
            idle_step_wait_s=_seconds(extra, "idle_step_wait_s", 0.004, low_included=True, high=0.1),
            batch_layer_posts=_bool(extra, "batch_layer_posts", True),
            post_after_output=_bool(extra, "post_after_output", True),
            preload_peers=_bool(extra, "preload_peers", True),
            output_grace_s=_seconds(extra, "output_grace_s", 0.0005, low_included=True, high=0.1),
            max_output_wait_s=_seconds(extra, "max_output_wait_s", 0.05, high=10.0),
            metrics_port=_int(extra, "metrics_port", 0, minimum=0, maximum=65535),
            fault_stall_after_writes=(_int(extra, "fault_stall_after_writes", 0, minimum=0, maximum=1 << 30)
                                      if extra.get("fault_stall_after_writes") is not None else None),
            max_write_s=_seconds(extra, "max_write_s", 10.0, high=3600.0),
            fault_hold_posted_write_s=_seconds(extra, "fault_hold_posted_write_s", 0.0, low_included=True,
                                               high=3600.0),
            fault_hold_after_writes=_int(extra, "fault_hold_after_writes", 0, minimum=0, maximum=1 << 30),
            fault_hold_from_token=_int(extra, "fault_hold_from_token", 0, minimum=0, maximum=1 << 30),
        )


def _host_port(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ConnectorConfigError(f"directory_address must be a 'host:port' string, got {value!r}")
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConnectorConfigError(f"directory_address must be 'host:port' with a port in 1..65535, got {value!r}")
    return value


def _directory_settings(extra: Mapping[str, object]) -> tuple[tuple[str, object], ...]:
    names = sorted(k for k in extra if k.startswith("directory_") and k != "directory_address")
    settings = tuple((name, extra[name]) for name in names)
    try:
        from kvpush.client.config import ChannelConfig

        ChannelConfig.from_dict({"directory_address": extra["directory_address"], **dict(settings)})
    except ImportError:  # the client library is part of kvpush; only a broken install lacks it
        raise
    except (ValueError, TypeError) as exc:
        raise ConnectorConfigError(f"directory settings refused: {exc}") from None
    return settings


def _optional_str(extra: Mapping[str, object], key: str) -> str | None:
    value = extra.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConnectorConfigError(f"{key} must be a string, got {type(value).__name__}")
    return value or None


def _choice(extra: Mapping[str, object], key: str, choices: tuple[str, ...]) -> str | None:
    value = _optional_str(extra, key)
    if value is not None and value not in choices:
        raise ConnectorConfigError(f"{key} must be one of {', '.join(choices)} or null, got {value!r}")
    return value


def _bool(extra: Mapping[str, object], key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if not isinstance(value, bool):
        raise ConnectorConfigError(f"{key} must be true or false, got {value!r}")
    return value


def _int(extra: Mapping[str, object], key: str, default: int, *, minimum: int, maximum: int) -> int:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ConnectorConfigError(f"{key} must be an integer in [{minimum}, {maximum}], got {value!r}")
    return value


def _seconds(extra: Mapping[str, object], key: str, default: float, *, low: float = 0.0,
             low_included: bool = False, high: float = 86400.0) -> float:
    """A number of seconds in (low, high] (or [low, high] with `low_included`)."""
    seconds = _optional_seconds(extra, key, default, low=low, low_included=low_included, high=high)
    assert seconds is not None  # not nullable
    return seconds


def _optional_seconds(extra: Mapping[str, object], key: str, default: float | None, *, low: float = 0.0,
                      low_included: bool = False, high: float = 86400.0, nullable: bool = False) -> float | None:
    """A number of seconds in (low, high] (or [low, high] with `low_included`); null allowed when `nullable`."""
    value = extra.get(key, default)
    if value is None and nullable:
        return None
    in_range = isinstance(value, (int, float)) and not isinstance(value, bool) and (
        (low <= value if low_included else low < value) and value <= high)
    if not in_range or not isinstance(value, (int, float)):
        interval = f"{'[' if low_included else '('}{low:g}, {high:g}]"
        raise ConnectorConfigError(f"{key} must be {'null or ' if nullable else ''}a number of seconds in {interval}, "
                                   f"got {value!r}")
    return float(value)


def _backends(value: object) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
        raise ConnectorConfigError(f"nixl_backends must be a non-empty list of backend names, got {value!r}")
    for name in value:
        if name not in _KNOWN_BACKENDS:
            raise ConnectorConfigError(f"nixl_backends has unknown backend {name!r}; known: {sorted(_KNOWN_BACKENDS)}")
    if len(set(value)) != len(value):
        raise ConnectorConfigError(f"nixl_backends lists a backend twice: {value!r}")
    return tuple(value)
