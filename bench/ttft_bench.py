"""TTFT of a disaggregated request vs the same prefill on a colocated engine, for kvpush and vLLM's NIXL connectors.

What runs (one invocation, side by side):
  * network: prefill and decode engines in two network namespaces joined by a veth pair shaped with
    `tc tbf` (default 1 Gbit/s and 10 Gbit/s, reshaped in place); UCX forced onto that link over TCP
    (`UCX_TLS=tcp,self`, `UCX_NET_DEVICES`), the NIXL side channel on the namespace address.
    `--no-netns` runs everything on loopback instead (UCX then picks shared memory).
  * model: the random 8-layer Llama (hidden 512, 8 KV heads x 64, bf16: 16 KiB of KV per token,
    32 MiB for 2048 tokens), prompts of random token ids (512 and 2048 by default), prefix caching off.
  * phases, one after the other so that only one pair of engines loads the 2 cores at a time:
      colocated   one plain engine, no connector: the reference TTFT;
      nixl-pull   vLLM NixlConnector through the gateway in nixl-pull mode (P leg, then D leg);
      nixl-push   vLLM NixlPushConnector, both legs at once (matched by X-Request-Id);
      kvpush      KVPushConnector + the directory, both legs at once;
      kvpush-progthread  the same with NIXL's progress thread on (sleeping 100 us between loops),
                  which progresses UCX without the GIL while the forward pass holds it;
      kvpush-poll5ms  the same with the data plane polling at most every 5 ms (fewer GIL hand-offs);
      kvpush-first-token  kvpush with the gateway's first token from prefill (its default; the decode engine
                  loads the ForcePrefillFirstToken logits processor): TTFT is then the prefill leg's, and
                  disaggregated / p_direct is what the gateway and the connector add to a prefill.
    Every other kvpush phase runs the gateway with --no-first-token-from-prefill: the push itself is measured.
    In each P/D phase every iteration sends the disaggregated request and then the same prompt
    straight to the prefill engine without kv_transfer_params ("p_direct"): the same prefill on an
    engine carrying the same connector (and its threads), in the same CPU conditions.
  * TTFT = request sent -> first SSE event at the client, median of `--iterations` after a warm-up.
    Ratios: disaggregated / colocated and disaggregated / p_direct. Outputs (greedy, max_tokens
    tokens) of disaggregated and p_direct are compared as a correctness check.

Prints the JSON and writes it to bench/results/ttft-<UTC time>.json. Needs root for namespaces.
    python bench/ttft_bench.py [--phases colocated,nixl-pull,nixl-push,kvpush] [--iterations 5]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import statistics
import sys
import time
import uuid
import zlib
from pathlib import Path

from kvpush.localstack.client import stream_completion
from kvpush.localstack.model import BENCH_MODEL_SPEC, ensure_tiny_model
from kvpush.localstack.netns import PDNetwork
from kvpush.localstack.processes import (
    EngineHandle,
    EngineSpec,
    GatewayHandle,
    ManagedProcess,
    free_port,
    group_cpu_seconds,
    http_ok,
    launch_engine,
    start_directory,
)
from kvpush.localstack.stack import (
    DECODE_ENGINE_ARGS,
    DIRECTORY_ARGS,
    NIXL_DECODE_SIDE_CHANNEL_PORT,
    NIXL_PREFILL_SIDE_CHANNEL_PORT,
    kv_transfer_config,
    nixl_side_channel_env,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(RESULTS_DIR.parent))
from bench_io import write_result  # bench/, this script's folder

# kvpush phases: the connector's kv_connector_extra_config beyond the directory and endpoint.
KVPUSH_PHASES = {"kvpush": {}, "kvpush-progthread": {"nixl_enable_prog_thread": True},
                 "kvpush-poll5ms": {"nixl_poll_max_s": 0.005, "nixl_notif_poll_s": 0.005},
                 "kvpush-first-token": {}}
FIRST_TOKEN_PHASES = ("kvpush-first-token",)


def connector_of(phase: str) -> str:
    """The connector (and gateway mode) a phase runs: every kvpush-* phase is kvpush."""
    return "kvpush" if phase in KVPUSH_PHASES else phase


PREFILL_ENGINE_ID = "bench-prefill"
DECODE_ENGINE_ID = "bench-decode"


def say(message: str) -> None:
    """Progress on stderr (stdout carries the JSON)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def prompt_ids(length: int, seed: int, vocab: int) -> list[int]:
    """Random token ids (never the special ids 0-2), distinct per seed so no cache can help."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def completion_body(prompt: list[int], max_tokens: int) -> dict:
    """A greedy completion request on token ids."""
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


def median_ms(values: list[float]) -> float:
    """Median in milliseconds of values in seconds (0 when empty)."""
    return round(statistics.median(values) * 1000, 1) if values else 0.0


class Topology:
    """Where engines and the gateway live: loopback, or the P/D namespaces."""

    def __init__(self, network: PDNetwork | None) -> None:
        self.network = network

    def engine_placement(self, role: str) -> dict:
        """host, netns and env for an engine of `role`."""
        net = self.network
        side_port = NIXL_PREFILL_SIDE_CHANNEL_PORT if role == "prefill" else NIXL_DECODE_SIDE_CHANNEL_PORT
        if net is None:
            return {"host": "127.0.0.1", "netns": None, "env": nixl_side_channel_env("127.0.0.1", side_port)}
        data_ip = net.prefill_data_ip if role == "prefill" else net.decode_data_ip
        return {"host": net.prefill_ctl_ip if role == "prefill" else net.decode_ctl_ip,
                "netns": net.prefill_ns if role == "prefill" else net.decode_ns,
                "env": {**nixl_side_channel_env(data_ip, side_port), **net.ucx_env(role)}}

    def prefill_side_channel(self) -> str:
        """HOST:PORT of prefill's NIXL side channel as decode reaches it."""
        host = self.network.prefill_data_ip if self.network else "127.0.0.1"
        return f"{host}:{NIXL_PREFILL_SIDE_CHANNEL_PORT}"

    def directory_address_for(self, role: str, port: int) -> str:
        """The directory (root namespace) as an engine of `role` reaches it."""
        if self.network is None:
            return f"127.0.0.1:{port}"
        ip = self.network.root_ip_for_prefill if role == "prefill" else self.network.root_ip_for_decode
        return f"{ip}:{port}"


def start_pd_engines(args, model_dir: Path, connector: str, topology: Topology, log_dir: Path,
                     directory_port: int = 0, *, decode_args: tuple[str, ...] = (),
                     env: dict[str, str] | None = None,
                     connector_extra: dict[str, object] | None = None) -> tuple[EngineHandle, EngineHandle]:
    """Launch P and D for `connector` together and wait for both (`decode_args`: decode's extra flags,
    `env`: both engines' extra environment, `connector_extra`: kvpush settings beyond the phase's own)."""
    handles = []
    for role, engine_id, cpus in (("prefill", PREFILL_ENGINE_ID, args.prefill_cpus),
                                  ("decode", DECODE_ENGINE_ID, args.decode_cpus)):
        place = topology.engine_placement(role)
        port = free_port()
        extra = {}
        if connector in KVPUSH_PHASES:
            extra = {"directory_address": topology.directory_address_for(role, directory_port),
                     "engine_endpoint": f"http://{place['host']}:{port}",
                     "extra": {**KVPUSH_PHASES[connector], **(connector_extra or {})}}
        config = kv_transfer_config(connector_of(connector), role, engine_id=engine_id, **extra)
        spec = EngineSpec(name=f"{connector}-{role}", model_dir=model_dir, host=place["host"], port=port,
                          kv_transfer_config=config, env={**place["env"], **(env or {})}, netns=place["netns"],
                          cpus=cpus or None, max_model_len=args.max_model_len,
                          extra_args=decode_args if role == "decode" else ())
        handles.append(launch_engine(spec, log_dir))
    try:
        for handle in handles:
            took = handle.wait_ready(args.engine_timeout, progress=say)
            say(f"{handle.spec.name} ready at {handle.url} in {took:.0f} s")
    except BaseException:
        for handle in handles:
            handle.stop(5.0)
        raise
    return handles[0], handles[1]


def cpu_set(cpus: str) -> set[int]:
    """The CPUs of a taskset list ("1", "0,2", "0-3,6"), as the processes given the same list run on."""
    chosen: set[int] = set()
    for part in cpus.split(","):
        first, _, last = part.partition("-")
        chosen.update(range(int(first), int(last or first) + 1))
    return chosen


def idle_cpu(engines: list[EngineHandle], window_s: float = 3.0) -> dict[str, float]:
    """CPU cores each idle engine burns (its whole process group), over `window_s`: busy-spinning threads show."""
    before = {e.spec.name: group_cpu_seconds(e.process.pid) for e in engines}
    time.sleep(window_s)
    return {e.spec.name: round((group_cpu_seconds(e.process.pid) - before[e.spec.name]) / window_s, 2)
            for e in engines}


def start_bench_gateway(mode: str, log_dir: Path, *, prefill: EngineHandle, decode: EngineHandle,
                        topology: Topology, directory_address: str = "",
                        extra_args: tuple[str, ...] = (), cpus: str | None = None) -> GatewayHandle:
    """The gateway in the root namespace on loopback, in `mode` (plus `extra_args` flags; on `cpus` when given)."""
    port = free_port()
    argv = [sys.executable, "-m", "kvpush.gateway", "--host", "127.0.0.1", "--port", str(port),
            "--mode", mode, "--prefill-timeout", "300", "--decode-timeout", "300"]
    if mode == "kvpush":
        argv += ["--directory", directory_address]
    else:
        argv += ["--prefill-url", prefill.url, "--decode-url", decode.url]
    if mode == "nixl-push":
        argv += ["--prefill-engine-id", PREFILL_ENGINE_ID, "--prefill-side-channel", topology.prefill_side_channel()]
    argv += list(extra_args)
    proc = ManagedProcess(f"gateway-{mode}", argv, log_dir / f"gateway-{mode}.log", env={"KVPUSH_LOG_FORMAT": "json"},
                          cpus=cpus)
    proc.start()
    url = f"http://127.0.0.1:{port}"
    proc.wait_ready(lambda: http_ok(url + "/health"), 60.0, progress=say)
    return GatewayHandle(proc, "127.0.0.1", port)


def start_colocated(args, model_dir: Path, log_dir: Path) -> EngineHandle:
    """The plain reference engine (no connector), in the root namespace."""
    engine = launch_engine(EngineSpec(name="colocated", model_dir=model_dir, cpus=args.colocated_cpus or None,
                                      max_model_len=args.max_model_len), log_dir)
    try:
        engine.wait_ready(args.engine_timeout, progress=say)
    except BaseException:
        engine.stop(5.0)
        raise
    say(f"colocated ready at {engine.url}")
    return engine


def measure_colocated(args, engine: EngineHandle) -> dict:
    """TTFT of the plain engine alone (no P/D engines running) for every prompt length."""
    out: dict = {"idle_cpu_cores": idle_cpu([engine])}
    for tokens in args.tokens:
        ttfts = []
        for i in range(args.warmup + args.iterations):
            body = completion_body(prompt_ids(tokens, 10_000 + i, args.vocab), args.max_tokens)
            result = stream_completion(engine.url + "/v1/completions", body, timeout_s=args.request_timeout)
            if result.status != 200:
                raise RuntimeError(f"colocated request failed: {result.status} {result.error}")
            if i >= args.warmup:
                ttfts.append(result.ttft_s)
        out[str(tokens)] = {"ttft_ms": [round(t * 1000, 1) for t in ttfts], "median_ms": median_ms(ttfts),
                            "min_ms": round(min(ttfts) * 1000, 1)}
        say(f"colocated {tokens} tokens: median TTFT {median_ms(ttfts)} ms")
    return out


def transfer_figures(directory_address: str, transfer_id: str) -> dict:
    """Per-transfer figures from the directory (kvpush only): its record and what prefill rank 0 measured."""
    from kvpush.client import ChannelConfig, SyncDirectoryClient
    from kvpush.v1 import types_pb2

    terminal = {types_pb2.TRANSFER_STATE_COMPLETE, types_pb2.TRANSFER_STATE_FAILED,
                types_pb2.TRANSFER_STATE_CANCELLED, types_pb2.TRANSFER_STATE_EXPIRED}
    client = SyncDirectoryClient(ChannelConfig(address=directory_address, timeout_s=5.0, max_attempts=2))
    try:
        deadline = time.monotonic() + 5.0  # decode can start before prefill's final result reaches the directory
        transfer = client.get_transfer(transfer_id)
        while transfer.state not in terminal and time.monotonic() < deadline:
            time.sleep(0.05)
            transfer = client.get_transfer(transfer_id)
    finally:
        client.close()

    def ms(later, earlier) -> float | None:
        if not later.seconds or not earlier.seconds:
            return None
        return round((later.ToNanoseconds() - earlier.ToNanoseconds()) / 1e6, 2)

    out = {"transfer_id": transfer_id, "state": types_pb2.TransferState.Name(transfer.state),
           "failure_reason": transfer.failure_reason,
           "layers_written": transfer.layers_written_count,
           "bytes_written": transfer.bytes_written,
           "allocate_after_plan_ms": ms(transfer.allocate_time, transfer.create_time),
           "first_ready_after_plan_ms": ms(transfer.first_ready_time, transfer.create_time),
           "dispatch_after_plan_ms": ms(transfer.dispatch_time, transfer.create_time),
           "end_after_plan_ms": ms(transfer.end_time, transfer.create_time)}
    for rank in transfer.rank_timings[:1]:
        timing = rank.timing
        out.update({
            "layers_written_before_prefill_end": timing.layers_written_before_prefill_end_count,
            "write_count": timing.write_count, "descriptor_count": timing.descriptor_count,
            "post_ms": round(timing.post_duration.ToNanoseconds() / 1e6, 2),
            "first_write_after_plan_ms": ms(timing.first_write_start_time, transfer.create_time),
            "prefill_end_after_plan_ms": ms(timing.prefill_end_time, transfer.create_time),
            "write_tail_after_prefill_ms": ms(timing.last_write_end_time, timing.prefill_end_time)})
    return out


def measure_pd(args, model_dir: Path, connector: str, topology: Topology, log_dir: Path,
               colocated: EngineHandle | None) -> dict:
    """Disaggregated vs p_direct TTFT for one connector, over every rate and prompt length."""
    directory = None
    directory_port = 0
    if connector in KVPUSH_PHASES:
        # Root namespace; engines in the namespaces reach it over their control links.
        directory = start_directory(log_dir, host="0.0.0.0" if topology.network else "127.0.0.1", progress=say,
                                    extra_args=DIRECTORY_ARGS, cpus=args.services_cpus or None)
        directory_port = directory.port
    prefill = decode = gateway = None
    try:
        first_token = connector in FIRST_TOKEN_PHASES
        prefill, decode = start_pd_engines(args, model_dir, connector, topology, log_dir, directory_port,
                                           decode_args=DECODE_ENGINE_ARGS if first_token else ())
        # The push itself is measured here: the gateway's first token from prefill is off but in its own phase.
        gateway_args = ("--no-first-token-from-prefill",) if connector in KVPUSH_PHASES and not first_token else ()
        gateway = start_bench_gateway(connector_of(connector), log_dir, prefill=prefill, decode=decode,
                                      topology=topology, directory_address=f"127.0.0.1:{directory_port}",
                                      extra_args=gateway_args, cpus=args.services_cpus or None)
        out: dict = {"idle_cpu_cores": idle_cpu([prefill, decode])}
        say(f"{connector}: idle engines burn {out['idle_cpu_cores']} CPU cores")
        for rate in args.rates:
            if topology.network:
                topology.network.set_rate(None if rate == "unshaped" else rate)
            for tokens in args.tokens:
                cell = run_cell(args, connector, gateway, prefill, tokens, directory, rate, colocated)
                out.setdefault(rate, {})[str(tokens)] = cell
                if not cell["compared"] and any(f.startswith("request ") for f in cell["failures"]):
                    # Requests hung (not refused): the engines are stuck; later cells would only wait too.
                    say(f"{connector}: engines hung in {rate}/{tokens}; skipping the phase's remaining cells")
                    out["stopped_early"] = f"engines hung at {rate}/{tokens}"
                    return out
                say(f"{connector} {rate} {tokens} tokens: disagg {cell['median_disagg_ms']} ms, "
                    f"p_direct {cell['median_p_direct_ms']} ms, outputs equal {cell['outputs_equal']}/"
                    f"{cell['compared']}, failures {len(cell['failures'])}")
        return out
    finally:
        if gateway:
            gateway.process.stop(5.0)
        for engine in (prefill, decode):
            if engine:
                engine.stop(15.0)
        if directory:
            directory.process.stop(5.0)


def run_cell(args, connector: str, gateway: GatewayHandle, prefill: EngineHandle, tokens: int, directory,
             rate: str, colocated: EngineHandle | None = None) -> dict:
    """Warm-up plus `iterations` of (disaggregated request, same prompt straight to prefill)."""
    disagg, direct, alongside, failures, transfers = [], [], [], [], []
    equal = compared = colocated_equal = 0
    for i in range(args.warmup + args.iterations):
        seed = zlib.crc32(f"{connector}/{rate}/{tokens}/{i}".encode())
        body = completion_body(prompt_ids(tokens, seed, args.vocab), args.max_tokens)
        headers = {"X-Request-Id": f"bench-{uuid.uuid4().hex[:16]}"}
        try:
            via_gateway = stream_completion(gateway.url + "/v1/completions", body, headers=headers,
                                            timeout_s=args.request_timeout)
            on_prefill = stream_completion(prefill.url + "/v1/completions", body, timeout_s=args.request_timeout)
        except OSError as error:  # a hung engine: record it, and stop this cell after two in a row
            failures.append(f"request {i}: {type(error).__name__}: {error}")
            if len(failures) >= 2 and all("request" in f for f in failures[-2:]):
                break
            continue
        if via_gateway.status != 200 or via_gateway.error:
            failures.append(f"disagg: {via_gateway.status} {via_gateway.error[:300]}")
            failed_transfer = via_gateway.headers.get("x-kvpush-transfer-id")
            if failed_transfer and directory is not None:
                with contextlib.suppress(Exception):  # why it failed, when the directory knows
                    transfers.append(transfer_figures(f"127.0.0.1:{directory.port}", failed_transfer))
            continue
        if i < args.warmup:
            continue
        disagg.append(via_gateway.ttft_s)
        direct.append(on_prefill.ttft_s)
        if colocated is not None:
            # Same prompt on the plain engine, interleaved: same ambient load as the disaggregated sample.
            reference = stream_completion(colocated.url + "/v1/completions", body, timeout_s=args.request_timeout)
            if reference.status == 200:
                alongside.append(reference.ttft_s)
                colocated_equal += reference.text == via_gateway.text
        compared += 1
        equal += via_gateway.text == on_prefill.text
        transfer_id = via_gateway.headers.get("x-kvpush-transfer-id")
        if transfer_id and directory is not None:
            try:
                figures = transfer_figures(f"127.0.0.1:{directory.port}", transfer_id)
            except Exception as error:  # figures are a bonus; never lose the TTFT for them
                figures = {"transfer_id": transfer_id, "error": str(error)}
            transfers.append(figures)
    cell = {"disagg_ms": [round(t * 1000, 1) for t in disagg], "p_direct_ms": [round(t * 1000, 1) for t in direct],
            "median_disagg_ms": median_ms(disagg), "median_p_direct_ms": median_ms(direct),
            # The minimum is the least disturbed sample on a shared machine; the median is the figure of record.
            "min_disagg_ms": round(min(disagg) * 1000, 1) if disagg else 0.0,
            "min_p_direct_ms": round(min(direct) * 1000, 1) if direct else 0.0,
            "colocated_alongside_ms": [round(t * 1000, 1) for t in alongside],
            "median_colocated_alongside_ms": median_ms(alongside),
            "outputs_equal": equal, "outputs_equal_colocated": colocated_equal, "compared": compared,
            "failures": failures}
    if transfers:
        cell["transfers"] = transfers
    return cell


def add_ratios(result: dict) -> None:
    """disagg/colocated and disagg/p_direct for every cell, plus the exposed time in ms."""
    colocated = result.get("colocated", {})
    for rates in result["phases"].values():
        if not isinstance(rates, dict) or "error" in rates:
            continue
        for rate, cells in rates.items():
            if rate in ("idle_cpu_cores", "stopped_early"):
                continue
            for tokens, cell in cells.items():
                if not cell["median_disagg_ms"]:
                    continue
                if cell["median_p_direct_ms"]:
                    cell["ratio_vs_p_direct"] = round(cell["median_disagg_ms"] / cell["median_p_direct_ms"], 3)
                    cell["exposed_vs_p_direct_ms"] = round(cell["median_disagg_ms"] - cell["median_p_direct_ms"], 1)
                if cell.get("median_colocated_alongside_ms"):
                    cell["ratio_vs_colocated_alongside"] = round(
                        cell["median_disagg_ms"] / cell["median_colocated_alongside_ms"], 3)
                reference = colocated.get(tokens, {}).get("median_ms")
                if reference:
                    cell["ratio_vs_colocated"] = round(cell["median_disagg_ms"] / reference, 3)
                    cell["exposed_vs_colocated_ms"] = round(cell["median_disagg_ms"] - reference, 1)


def cpu_context() -> dict:
    """What else was running: load average and core count at the start."""
    return {"cpu_count": os.cpu_count(), "loadavg_at_start": os.getloadavg()}


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--phases", default="colocated,nixl-pull,nixl-push,kvpush")
    parser.add_argument("--rates", default="1gbit,10gbit", help="comma list of tc rates, or 'unshaped'")
    parser.add_argument("--tokens", default="2048,512")
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--no-netns", action="store_true", help="loopback only (UCX may use shared memory)")
    parser.add_argument("--prefill-cpus", default="", help="taskset CPU list for prefill (e.g. 0)")
    parser.add_argument("--decode-cpus", default="", help="taskset CPU list for decode (e.g. 1)")
    parser.add_argument("--colocated-cpus", default="", help="taskset CPU list for the colocated engine")
    parser.add_argument("--services-cpus", default="",
                        help="taskset CPU list for the gateway and the directory (e.g. decode's: in production they "
                             "run on hosts of their own, not on a prefill engine's cores)")
    parser.add_argument("--engine-timeout", type=float, default=420.0)
    parser.add_argument("--colocated-alongside", action=argparse.BooleanOptionalAction, default=True,
                        help="keep the colocated engine running and sample it in every P/D iteration too")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="seconds per streamed request")
    parser.add_argument("--log-dir", default="", help="engine logs (default: a temp folder)")
    parser.add_argument("--out", default="", help="JSON path (default bench/results/ttft-<time>.json)")
    args = parser.parse_args(argv)
    args.phases = [p for p in args.phases.split(",") if p]
    args.rates = [r for r in args.rates.split(",") if r]
    args.tokens = [int(t) for t in args.tokens.split(",") if t]
    args.vocab = BENCH_MODEL_SPEC.vocab_size
    unknown = set(args.phases) - {"colocated", "nixl-pull", "nixl-push", *KVPUSH_PHASES}
    if unknown:
        parser.error(f"unknown phases {sorted(unknown)}")
    return args


def stop_on_signals() -> None:
    """SIGTERM and SIGINT raise KeyboardInterrupt, so every `finally` stops engines and removes namespaces.

    (A background job of a non-interactive shell starts with SIGINT ignored; this re-arms it.)
    """
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)


def main(argv=None) -> int:
    """Run the phases, print and save the JSON."""
    args = parse_args(argv)
    stop_on_signals()
    if args.services_cpus:  # the client goes with the services: it too is elsewhere in production
        os.sched_setaffinity(0, cpu_set(args.services_cpus))
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    log_dir = Path(args.log_dir or f"/tmp/kvpush-ttft-{stamp}")
    model_dir = ensure_tiny_model(BENCH_MODEL_SPEC)
    command = " ".join(["python", "bench/ttft_bench.py", *(argv or sys.argv[1:])])
    result: dict = {"benchmark": "ttft", "command": command,
                    "started_utc": stamp, "model": {"dir": str(model_dir), "layers": BENCH_MODEL_SPEC.num_layers,
                    "hidden": BENCH_MODEL_SPEC.hidden_size, "kv_heads": BENCH_MODEL_SPEC.num_kv_heads,
                    "head_dim": BENCH_MODEL_SPEC.head_dim, "kv_bytes_per_token": BENCH_MODEL_SPEC.kv_bytes_per_token()},
                    "settings": {"iterations": args.iterations, "warmup": args.warmup, "max_tokens": args.max_tokens,
                                 "netns": not args.no_netns, "rates": args.rates, "tokens": args.tokens,
                                 "prefill_cpus": args.prefill_cpus, "decode_cpus": args.decode_cpus,
                                 "colocated_cpus": args.colocated_cpus, "services_cpus": args.services_cpus,
                                 "prefix_caching": False,
                                 "colocated_alongside": args.colocated_alongside},
                    "cpu": cpu_context(), "log_dir": str(log_dir), "phases": {}}
    colocated = None
    if "colocated" in args.phases:
        say("phase colocated")
        colocated = start_colocated(args, model_dir, log_dir)
        result["colocated"] = measure_colocated(args, colocated)
        if not args.colocated_alongside:
            colocated.stop(15.0)
            colocated = None
    network = None if args.no_netns else PDNetwork(prefix="kvb", rate=args.rates[0] if args.rates[0] != "unshaped"
                                                     else None)
    try:
        if network:
            network.create()
        topology = Topology(network)
        for connector in args.phases:
            if connector == "colocated":
                continue
            say(f"phase {connector}")
            try:
                result["phases"][connector] = measure_pd(args, model_dir, connector, topology, log_dir, colocated)
            except Exception as error:  # one broken connector must not hide the others' figures
                say(f"phase {connector} failed: {error}")
                result["phases"][connector] = {"error": str(error)[:2000]}
    finally:
        if network:
            network.destroy()
        if colocated is not None:
            colocated.stop(15.0)
    result["cpu"]["loadavg_at_end"] = os.getloadavg()
    add_ratios(result)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else RESULTS_DIR / f"ttft-{stamp}.json"
    write_result(out, result)
    say(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
