"""`kvpush`: run the KV-directory and inspect it over gRPC.

    kvpush directory [flags]            serve (flags override KVPUSH_DIRECTORY_* env)
    kvpush engines [--role R] [--json]  registered workers, their KV layouts (TP, block size, hash)
    kvpush transfers [ID] [--state S] [--engine E] [--limit N] [--json]
    kvpush health [--json]              exit 0 when SERVING
    kvpush trace TRANSFER_ID [--json]   one transfer's timeline, readable in a terminal
    kvpush up [--model PATH] [...]      a local P/D stack (CPU, tiny model by default), up until Ctrl-C
    kvpush engine-args --role R [...]   the `vllm serve` arguments of a prefill or decode engine

Client commands reach the directory through `--address`/`--token`/`--tls-*` or the
`KVPUSH_DIRECTORY_ADDRESS`/`KVPUSH_DIRECTORY_TOKEN`/`KVPUSH_DIRECTORY_TLS_*` variables; with neither, the
directory of a running `kvpush up` (its state file), else 127.0.0.1:50051. Exit codes:
0 success, 1 a refused call or unhealthy server, 2 bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime

from google.protobuf import json_format

from kvpush.client import ChannelConfig, DirectoryCallError, DirectoryClient
from kvpush.v1 import types_pb2 as tpb

# flag -> (environment variable, default, type) for `kvpush directory`.
_SERVE_FLAGS: dict[str, tuple[str, object, type]] = {
    "host": ("KVPUSH_DIRECTORY_HOST", "127.0.0.1", str),
    "port": ("KVPUSH_DIRECTORY_PORT", 50051, int),
    "token": ("KVPUSH_DIRECTORY_TOKEN", "", str),
    "tokens_file": ("KVPUSH_DIRECTORY_TOKENS_FILE", "", str),
    "tls_cert": ("KVPUSH_DIRECTORY_TLS_CERT", "", str),
    "tls_key": ("KVPUSH_DIRECTORY_TLS_KEY", "", str),
    "tls_client_ca": ("KVPUSH_DIRECTORY_TLS_CLIENT_CA", "", str),
    "lease_ttl_s": ("KVPUSH_DIRECTORY_LEASE_TTL_S", 10.0, float),
    "max_write_s": ("KVPUSH_DIRECTORY_MAX_WRITE_S", 10.0, float),
    "transfer_ttl_s": ("KVPUSH_DIRECTORY_TRANSFER_TTL_S", 60.0, float),
    "max_transfer_ttl_s": ("KVPUSH_DIRECTORY_MAX_TRANSFER_TTL_S", 3600.0, float),
    "max_active_transfers_per_engine": ("KVPUSH_DIRECTORY_MAX_ACTIVE_TRANSFERS_PER_ENGINE", 4096, int),
    "max_live_transfers": ("KVPUSH_DIRECTORY_MAX_LIVE_TRANSFERS", 100_000, int),
    "max_workers": ("KVPUSH_DIRECTORY_MAX_WORKERS", 4096, int),
    "max_block_ids": ("KVPUSH_DIRECTORY_MAX_BLOCK_IDS", 65_536, int),
    "max_events_per_batch": ("KVPUSH_DIRECTORY_MAX_EVENTS_PER_BATCH", 4096, int),
    "retained_transfers": ("KVPUSH_DIRECTORY_RETAINED_TRANSFERS", 10_000, int),
    "retained_watch_events": ("KVPUSH_DIRECTORY_RETAINED_WATCH_EVENTS", 10_000, int),
    "max_message_bytes": ("KVPUSH_DIRECTORY_MAX_MESSAGE_BYTES", 16 * 1024 * 1024, int),
    "reap_interval_s": ("KVPUSH_DIRECTORY_REAP_INTERVAL_S", 0.1, float),
    "reap_stall_threshold_s": ("KVPUSH_DIRECTORY_REAP_STALL_THRESHOLD_S", 2.0, float),
    "grace_s": ("KVPUSH_DIRECTORY_GRACE_S", 5.0, float),
    "max_connection_age_s": ("KVPUSH_DIRECTORY_MAX_CONNECTION_AGE_S", 0.0, float),
    "max_pending_rejections_per_session": ("KVPUSH_DIRECTORY_MAX_PENDING_REJECTIONS_PER_SESSION", 1024, int),
    "max_pending_rejections": ("KVPUSH_DIRECTORY_MAX_PENDING_REJECTIONS", 16_384, int),
    "renew_stream_idle_s": ("KVPUSH_DIRECTORY_RENEW_STREAM_IDLE_S", 30.0, float),
    "max_open_streams": ("KVPUSH_DIRECTORY_MAX_OPEN_STREAMS", 20_000, int),
    "max_streams_per_identity": ("KVPUSH_DIRECTORY_MAX_STREAMS_PER_IDENTITY", 256, int),
    "max_calls_in_flight_per_caller": ("KVPUSH_DIRECTORY_MAX_CALLS_IN_FLIGHT_PER_CALLER", 8, int),
    "max_bytes_in_flight_per_caller": ("KVPUSH_DIRECTORY_MAX_BYTES_IN_FLIGHT_PER_CALLER", 64 * 1024 * 1024, int),
    "max_client_share": ("KVPUSH_DIRECTORY_MAX_CLIENT_SHARE", 1.0, float),
    "late_renewal_fraction": ("KVPUSH_DIRECTORY_LATE_RENEWAL_FRACTION", 0.5, float),
    "metrics_port": ("KVPUSH_DIRECTORY_METRICS_PORT", 0, int),
    # Replicas on etcd (docs/directory-replicas.md): empty endpoints = one process, everything in memory.
    "etcd_endpoints": ("KVPUSH_DIRECTORY_ETCD_ENDPOINTS", "", str),
    "replica_id": ("KVPUSH_DIRECTORY_REPLICA_ID", "", str),
    "advertise_address": ("KVPUSH_DIRECTORY_ADVERTISE_ADDRESS", "", str),
    "shard_count": ("KVPUSH_DIRECTORY_SHARD_COUNT", 16, int),
    "session_ttl_s": ("KVPUSH_DIRECTORY_SESSION_TTL_S", 3, int),
    "etcd_prefix": ("KVPUSH_DIRECTORY_ETCD_PREFIX", "/kvpush", str),
    "etcd_tls_root_cert": ("KVPUSH_DIRECTORY_ETCD_TLS_ROOT_CERT", "", str),
    "etcd_tls_client_cert": ("KVPUSH_DIRECTORY_ETCD_TLS_CLIENT_CERT", "", str),
    "etcd_tls_client_key": ("KVPUSH_DIRECTORY_ETCD_TLS_CLIENT_KEY", "", str),
}


def _env_default(name: str) -> object:
    variable, default, kind = _SERVE_FLAGS[name]
    raw = os.environ.get(variable)
    if raw in (None, ""):
        return default
    try:
        return kind(raw)
    except ValueError:
        raise SystemExit(f"kvpush: {variable}={raw!r} is not a valid {kind.__name__}") from None


# switch -> environment variable for `kvpush directory` (off unless set to one of _TRUE).
_SERVE_SWITCHES: dict[str, str] = {
    "pair_block_sizes": "KVPUSH_DIRECTORY_PAIR_BLOCK_SIZES",
}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _env_switch(name: str, default: bool = False) -> bool:
    variable = _SERVE_SWITCHES[name]
    raw = os.environ.get(variable, "").strip().lower()
    if raw == "":
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise SystemExit(f"kvpush: {variable}={raw!r} is not a switch (one of {', '.join(_TRUE + _FALSE)})")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="kvpush", description="kvpush KV-directory and inspection tools")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("directory", help="run the KV-directory server")
    for name, (variable, _default, kind) in _SERVE_FLAGS.items():
        serve.add_argument(f"--{name.replace('_', '-')}", type=kind, default=_env_default(name),
                           help=f"(env {variable}; default %(default)s)")
    serve.add_argument("--uvloop", action=argparse.BooleanOptionalAction, default=True,
                       help="run on uvloop when installed (default on)")
    serve.add_argument("--pair-block-sizes", action=argparse.BooleanOptionalAction,
                       default=_env_switch("pair_block_sizes", default=True),
                       help="pair prefill and decode engines of different block sizes when both layouts are "
                            "token-addressable (env KVPUSH_DIRECTORY_PAIR_BLOCK_SIZES; default on; "
                            "--no-pair-block-sizes refuses such pairs at planning, docs/connector.md)")

    def client_flags(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--address", help="directory host:port (env KVPUSH_DIRECTORY_ADDRESS; default: the "
                                           "running `kvpush up`'s directory, else 127.0.0.1:50051)")
        sub.add_argument("--token", help="bearer token (env KVPUSH_DIRECTORY_TOKEN)")
        sub.add_argument("--tls-root-cert", help="CA to verify the server (env KVPUSH_DIRECTORY_TLS_ROOT_CERT)")
        sub.add_argument("--tls-client-cert", help="client certificate for mutual TLS")
        sub.add_argument("--tls-client-key", help="client key for mutual TLS")
        sub.add_argument("--timeout-s", type=float, help="deadline per call")
        sub.add_argument("--json", action="store_true", help="print JSON instead of a table")

    engines = commands.add_parser("engines", help="list registered engine workers")
    client_flags(engines)
    engines.add_argument("--role", choices=["prefill", "decode"], help="only engines of this role")

    transfers = commands.add_parser("transfers", help="list transfers, or show one")
    client_flags(transfers)
    transfers.add_argument("transfer_id", nargs="?", help="show this transfer only")
    transfers.add_argument("--state",
                           help="filter: planned, allocated, streaming, complete, failed, cancelled, expired")
    transfers.add_argument("--engine", default="", help="filter: transfers of this engine (either side)")
    transfers.add_argument("--limit", type=int, default=100, help="at most this many (newest first)")

    health = commands.add_parser("health", help="check the directory's health")
    client_flags(health)

    trace = commands.add_parser("trace", help="one transfer's timeline (planned, allocated, each layer ready and "
                                              "written, prefill end, completion, per-rank timing)")
    client_flags(trace)
    trace.add_argument("transfer_id", help="the transfer (X-KVPush-Transfer-Id of the gateway's answer)")

    up = commands.add_parser("up", help="bring a local P/D stack up (CPU and the tiny model by default) until "
                                        "Ctrl-C")
    from kvpush.cli import up as up_command

    up_command.add_arguments(up)

    engine_args = commands.add_parser("engine-args", help="print the `vllm serve` arguments of a prefill or decode "
                                                          "engine with KVPushConnector")
    from kvpush.cli import engine_args as engine_args_command

    engine_args_command.add_arguments(engine_args)
    return parser


def _channel_config(args: argparse.Namespace) -> ChannelConfig:
    overrides = {key: value for key, value in {
        "address": args.address, "token": args.token, "root_cert_file": args.tls_root_cert,
        "client_cert_file": args.tls_client_cert, "client_key_file": args.tls_client_key,
        "timeout_s": args.timeout_s}.items() if value not in (None, "")}
    if "address" not in overrides and not os.environ.get("KVPUSH_DIRECTORY_ADDRESS"):
        from kvpush.cli.up import read_state

        state = read_state()  # a running `kvpush up`: its directory, without flags
        if state is not None:
            overrides["address"] = state.directory_address
    return ChannelConfig.from_env(max_attempts=2, **overrides)


def _ts(timestamp) -> str:
    if not timestamp.seconds and not timestamp.nanos:
        return "-"
    return datetime.fromtimestamp(timestamp.ToNanoseconds() / 1e9, UTC).strftime("%H:%M:%S.%f")[:-3]


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def _to_json(messages) -> str:
    return json.dumps([json_format.MessageToDict(m, preserving_proto_field_name=True) for m in messages], indent=2)


def _short_enum(enum, value: int, prefix: str) -> str:
    return enum.Name(value).removeprefix(prefix).lower()


def _first_token(worker: tpb.EngineWorker) -> str:
    """A decode worker's first-token capability: "forced" (gateways may stream prefill's token) or "no"."""
    if worker.role != tpb.ENGINE_ROLE_DECODE:
        return "-"
    return "forced" if worker.forces_first_token else "no"


async def _engines(args: argparse.Namespace) -> int:
    role = {"prefill": tpb.ENGINE_ROLE_PREFILL, "decode": tpb.ENGINE_ROLE_DECODE}.get(args.role or "",
                                                                                    tpb.ENGINE_ROLE_UNSPECIFIED)
    async with DirectoryClient(_channel_config(args)) as client:
        workers = await client.list_engines(role=role)
    if args.json:
        for worker in workers:
            worker.ClearField("agent_metadata")  # binary NIXL metadata is no use on a terminal
        print(_to_json(workers))
        return 0
    print(engines_table(workers))
    return 0


def engines_table(workers: Sequence[tpb.EngineWorker]) -> str:
    """`kvpush engines` as a table: one row per worker, with the layout fields planning pairs engines by (TP size,
    KV heads held / the model's, layers, block size, dtype, the compatibility hash's first 8 characters), so a
    refused pair shows why. KV_HEADS "-": the worker registered no head counts, and pairs only with its TP size."""
    rows = [(w.engine_id, _short_enum(tpb.EngineRole, w.role, "ENGINE_ROLE_"), f"{w.tp_rank}/{w.tp_size}",
             w.tp_size, _kv_heads(w.layout), w.agent_name, w.model or "-", w.layout.layer_count,
             w.layout.block_size_tokens, w.layout.block_count, w.layout.dtype or "-",
             w.layout.compatibility_hash[:8] or "-",
             w.load.free_block_count if w.HasField("load") else "-",
             f"{w.load.running_request_count}/{w.load.waiting_request_count}" if w.HasField("load") else "-",
             w.active_transfer_count, _first_token(w), _ts(w.lease_expire_time), w.endpoint or "-") for w in workers]
    return _table(["ENGINE", "ROLE", "RANK", "TP", "KV_HEADS", "AGENT", "MODEL", "LAYERS", "BLOCK_TOKENS", "BLOCKS",
                   "DTYPE", "HASH", "FREE", "RUN/WAIT", "ACTIVE", "FIRST_TOKEN", "LEASE_UNTIL", "ENDPOINT"], rows)


def _kv_heads(layout: tpb.KVLayout) -> str:
    """"held/model" KV heads, or "-" when the worker did not register them."""
    if not (layout.kv_head_count and layout.model_kv_head_count):
        return "-"
    return f"{layout.kv_head_count}/{layout.model_kv_head_count}"


async def _transfers(args: argparse.Namespace) -> int:
    state: tpb.TransferState = tpb.TRANSFER_STATE_UNSPECIFIED
    if args.state:
        name = f"TRANSFER_STATE_{args.state.upper()}"
        if name not in tpb.TransferState.DESCRIPTOR.values_by_name:
            print(f"kvpush: unknown state {args.state!r}", file=sys.stderr)
            return 2
        state = tpb.TransferState.Value(name)
    async with DirectoryClient(_channel_config(args)) as client:
        if args.transfer_id:
            transfers = [await client.get_transfer(args.transfer_id)]
        else:
            transfers = await client.list_transfers(state=state, engine_id=args.engine, limit=args.limit)
    if args.json:
        print(_to_json(transfers))
        return 0
    rows = [(t.transfer_id, _short_enum(tpb.TransferState, t.state, "TRANSFER_STATE_"), t.prefill_engine_id,
             t.decode_engine_id, t.prompt_token_count, len(t.decode_block_ids), t.bytes_written,
             _ts(t.create_time), _ts(t.end_time), t.failure_reason or "-") for t in transfers]
    print(_table(["TRANSFER", "STATE", "PREFILL", "DECODE", "TOKENS", "BLOCKS", "BYTES", "CREATED", "ENDED",
                  "REASON"], rows))
    return 0


def _ns(timestamp) -> int | None:
    return timestamp.ToNanoseconds() if timestamp.seconds or timestamp.nanos else None


def render_timeline(transfer: tpb.Transfer) -> str:
    """A transfer's life as lines of text: a header, every event in time order relative to the plan, the ranks."""
    origin = _ns(transfer.create_time) or 0
    state = _short_enum(tpb.TransferState, transfer.state, "TRANSFER_STATE_").upper()
    lines = [f"transfer {transfer.transfer_id}  {state}" + (f"  ({transfer.failure_reason})"
                                                           if transfer.failure_reason else ""),
             f"  request {transfer.request_id or '-'}; prefill {transfer.prefill_engine_id} -> decode "
             f"{transfer.decode_engine_id}; {transfer.prompt_token_count} prompt tokens "
             f"({transfer.prefix_hit_token_count} already on decode), {len(transfer.decode_block_ids)} decode blocks; "
             f"{transfer.layers_written_count} layers, {transfer.bytes_written} bytes written"]
    if transfer.trace_context.count("-") == 3:
        lines.append(f"  trace id {transfer.trace_context.split('-')[1]} (search it in Jaeger)")
    events: list[tuple[int, str]] = []

    def add(timestamp, text: str) -> None:
        ns = _ns(timestamp)
        if ns is not None:
            events.append((ns, text))

    add(transfer.create_time, "planned")
    add(transfer.allocate_time, f"decode allocated {len(transfer.decode_block_ids)} blocks")
    add(transfer.first_ready_time, "first layer ready at the directory")
    add(transfer.dispatch_time, "push instruction sent to prefill")
    for layer in transfer.layer_timings:
        add(layer.ready_time, f"layer {layer.layer} ready")
        add(layer.written_time, f"layer {layer.layer} written")
    for rank in transfer.rank_timings:
        who = f" (rank {rank.tp_rank})" if len(transfer.rank_timings) > 1 else ""
        add(rank.timing.first_write_start_time, f"first WRITE posted{who}")
        add(rank.timing.prefill_end_time, f"prefill ended{who}")
        add(rank.timing.last_write_end_time, f"last WRITE completed{who}")
    add(transfer.end_time, state.lower() if transfer.state != tpb.TRANSFER_STATE_COMPLETE else "complete")
    if origin:
        lines.append(f"  planned at {datetime.fromtimestamp(origin / 1e9, UTC):%Y-%m-%d %H:%M:%S.%f} UTC")
    lines.append("")
    for ns, text in sorted(events, key=lambda e: e[0]):
        lines.append(f"  {(ns - origin) / 1e6:+10.3f} ms  {text}")
    if transfer.rank_timings:
        lines.append("")
        rows = []
        for rank in transfer.rank_timings:
            timing = rank.timing
            first, end, last = (_ns(t) for t in (timing.first_write_start_time, timing.prefill_end_time,
                                                 timing.last_write_end_time))
            rows.append((rank.tp_rank, timing.write_count, timing.descriptor_count,
                         f"{timing.post_duration.ToNanoseconds() / 1e6:.3f}",
                         f"{(last - first) / 1e6:.3f}" if first and last else "-",
                         f"{(last - end) / 1e6:.3f}" if end and last else "-",
                         f"{timing.layers_written_before_prefill_end_count}/{len(timing.layer_writes) or '-'}"))
        table = _table(["RANK", "WRITES", "DESCRIPTORS", "POST_MS", "PUSH_MS", "EXPOSED_TAIL_MS",
                        "LAYERS_BEFORE_PREFILL_END"], rows)
        lines += ["  " + line for line in table.splitlines()]
        lines.append("  (exposed tail: last WRITE end minus prefill end, what decode waited beyond prefill)")
    return "\n".join(lines)


async def _trace(args: argparse.Namespace) -> int:
    async with DirectoryClient(_channel_config(args)) as client:
        transfer = await client.get_transfer(args.transfer_id)
    print(_to_json([transfer]) if args.json else render_timeline(transfer))
    return 0


async def _health(args: argparse.Namespace) -> int:
    async with DirectoryClient(_channel_config(args)) as client:
        status = await client.health()
    print(json.dumps({"status": status}) if args.json else status)
    return 0 if status == "SERVING" else 1


def _serve(args: argparse.Namespace) -> int:
    from kvpush.directory.server import DirectoryConfig, serve
    from kvpush.directory.state import Limits

    try:
        limits = Limits(
            lease_ttl_s=args.lease_ttl_s, max_write_s=args.max_write_s, transfer_ttl_s=args.transfer_ttl_s,
            max_transfer_ttl_s=args.max_transfer_ttl_s,
            max_active_transfers_per_engine=args.max_active_transfers_per_engine,
            max_live_transfers=args.max_live_transfers, max_workers=args.max_workers,
            max_block_ids=args.max_block_ids, max_events_per_batch=args.max_events_per_batch,
            retained_terminal_transfers=args.retained_transfers,
            retained_watch_events_per_engine=args.retained_watch_events,
            reap_stall_threshold_s=args.reap_stall_threshold_s,
            max_pending_rejections_per_session=args.max_pending_rejections_per_session,
            max_pending_rejections=args.max_pending_rejections, renew_stream_idle_s=args.renew_stream_idle_s,
            max_open_streams=args.max_open_streams, max_streams_per_identity=args.max_streams_per_identity,
            max_calls_in_flight_per_caller=args.max_calls_in_flight_per_caller,
            max_bytes_in_flight_per_caller=args.max_bytes_in_flight_per_caller,
            max_client_share=args.max_client_share, late_renewal_fraction=args.late_renewal_fraction,
            pair_block_sizes=args.pair_block_sizes)
        config = DirectoryConfig(
            host=args.host, port=args.port, token=args.token, tokens_file=args.tokens_file, tls_cert_file=args.tls_cert,
            tls_key_file=args.tls_key, tls_client_ca_file=args.tls_client_ca, limits=limits,
            max_message_bytes=args.max_message_bytes, reap_interval_s=args.reap_interval_s, grace_s=args.grace_s,
            max_connection_age_ms=int(args.max_connection_age_s * 1000), metrics_port=args.metrics_port)
        if not 0 <= args.metrics_port <= 65535:
            raise ValueError(f"--metrics-port {args.metrics_port} is not a port (0: off)")
        if args.etcd_endpoints:
            from kvpush.directory.replica import ReplicaConfig

            if args.shard_count < 1 or args.session_ttl_s < 1:
                raise ValueError("--shard-count and --session-ttl-s must be at least 1")
            config = dataclasses.replace(config, replica=ReplicaConfig(
                etcd_endpoints=tuple(e.strip() for e in args.etcd_endpoints.split(",") if e.strip()),
                advertise_address=args.advertise_address, replica_id=args.replica_id,
                shard_count=args.shard_count, session_ttl_s=args.session_ttl_s, key_prefix=args.etcd_prefix,
                etcd_root_cert_file=args.etcd_tls_root_cert, etcd_client_cert_file=args.etcd_tls_client_cert,
                etcd_client_key_file=args.etcd_tls_client_key))
    except ValueError as error:
        print(f"kvpush: {error}", file=sys.stderr)
        return 2
    try:
        serve(config, use_uvloop=args.uvloop)
    except (OSError, ValueError) as error:  # unbindable address, unreadable or malformed credential files
        print(f"kvpush: {error}", file=sys.stderr)
        return 1
    return 0


def _up(args: argparse.Namespace) -> int:
    """`kvpush up`: the local stack, imported here alone (the runtime never needs it; it needs the dev extra)."""
    from kvpush.cli.up import LocalStackUnavailable, require_local_stack

    try:
        require_local_stack()
    except LocalStackUnavailable as error:
        print(f"kvpush up: {error}", file=sys.stderr)
        return 1
    from kvpush.localstack.up import run

    return run(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.command == "directory":
        return _serve(args)
    if args.command == "up":
        return _up(args)
    if args.command == "engine-args":
        from kvpush.cli.engine_args import run as print_engine_args

        return print_engine_args(args)
    handler = {"engines": _engines, "transfers": _transfers, "health": _health, "trace": _trace}[args.command]
    try:
        return asyncio.run(handler(args))
    except DirectoryCallError as error:
        print(f"kvpush: {error.code.name}: {error.details}", file=sys.stderr)
        return 1
    except ValueError as error:
        print(f"kvpush: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
