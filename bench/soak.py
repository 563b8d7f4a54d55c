"""Soak: many transfers through the gateway while faults are injected at random moments; nothing may hang or leak.

The stack (`LocalStack`, all real, on 127.0.0.1): the directory (30 s leases), one prefill and two decode vLLM CPU
engines with KVPushConnector, a colocated reference engine, the gateway (kvpush mode, failover on), mutual TLS with
per-engine identities on every directory channel when the openssl CLI is there (the gateway reports unreachable
engines as the operator). Requests are greedy completions of prompts from a fixed pool (token ids, 5 to 300
tokens), half streamed, sent at `--rate` per second by at most `--concurrency` clients at once; a share of the
streamed ones is abandoned by the client after its first event (a client disconnect mid-stream).
Faults, one at a time, each kind in turn (seeded order), at seeded random moments (`--fault-interval-s` apart on
average, counted from the previous fault's recovery):
  decode-kill     SIGKILL a decode engine's whole process group; relaunch it once its lease lapsed
  prefill-kill    the same for the prefill engine
  directory-kill  SIGKILL the directory; a new one starts on the same port (engines and gateway find it)
  lease-expiry    SIGSTOP a decode engine past its lease TTL, then SIGCONT (its lease lapses while it lives)
  decode-freeze   SIGSTOP the decode engine the directory would plan first for `--freeze-s` (under its lease TTL,
                  over the gateway's decode first-byte bound), then SIGCONT: requests planned on it meanwhile must
                  be failed over, not wait; a streamed request of its own, sent as it freezes, must be planned
                  there (one answered within FREEZE_PROBE_SETTLE_S was not: the engine is thawed, the freeze retried);
                  records the time from the freeze to the gateway's first decode failover, that request's outcome
                  and what the directory planned where during it
  oversized       an "engine" (a gRPC client with a real decode engine's identity: its mutual-TLS certificate)
                  sends 20-60 MiB messages to the directory, `OVERSIZED_CONCURRENCY` at once, for `--flood-s`;
                  records the directory's RSS (before, peak, after), its health checks' latency and their statuses
  invalid-flood   a client on another loopback address (127.0.0.2, so the gateway gives it its own client id)
                  sends invalid requests (`"temperature": "hot"`, which vLLM refuses with a multi-line message,
                  streamed and not, and malformed JSON) at `INVALID_FLOOD_RATE` per second for `--flood-s`, beside
                  the normal clients; afterwards no transfer planned before its end may be left PLANNED and no engine
                  near its transfer cap
  abort           (per request, `--abort-share`) the client closes a stream after its first event
Write failures through the data plane's fault knob are listed as not injected while the connector has no such
knob (`write_failure` in the JSON says so).

Every request ends one way: completed (200, tokens checked against the colocated engine's for the same prompt:
`corrupt` counts mismatches), failed (an HTTP error or an SSE error event; grouped by status and message), aborted
(by the client, on purpose) or hung (no end within `--request-bound-s`: must be 0). Memory: RSS of the directory,
the gateway and each engine (its whole process group), sampled every `--sample-s`, with the slope of each process
life's least-squares line once it settled (from its first sample at 90 % of its peak: start-up is no growth),
MiB/min. Leaks at the end, once quiet: vLLM's `kv_cache_usage_perc` of every kvpush engine in blocks, and the
directory's live transfers and per-engine active transfers. Per fault the JSON has the outcomes of the requests
sent during it, and the well-behaved clients' served rate (completed requests per second) during each fault next
to the rate outside every fault (`served_rate`).
JSON to bench/results/soak-<time>.json (or --out) and a PNG beside it (memory over time with fault marks,
outcomes over time).

    nice -n 10 python bench/soak.py --count 1000 --rate 2 --fault-interval-s 40
`run_soak(stack, ...)` is the same run on a stack that is already up (tests/integration/reliability).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psutil

from kvpush.client import ChannelConfig, DirectoryCallError, SyncDirectoryClient
from kvpush.localstack.client import call
from kvpush.localstack.model import TinyModelSpec
from kvpush.localstack.pki import HAVE_OPENSSL
from kvpush.localstack.stack import LocalStack
from kvpush.localstack.vllm_bench import kv_cache_usage
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb

RESULTS_DIR = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(RESULTS_DIR.parent))
from bench_io import write_result  # bench/, this script's folder

FAULTS = ("decode-kill", "prefill-kill", "directory-kill", "lease-expiry", "decode-freeze", "oversized",
          "invalid-flood")
LEASE_TTL_S = 30.0  # the stack's directory (kvpush.localstack.stack.DIRECTORY_ARGS)
PROMPT_LENGTHS = (5, 17, 40, 130, 300)
MAX_TOKENS = 8
FIRST_BYTE_TIMEOUT_S = 10.0  # the gateway's bound on a streamed leg's response headers (a frozen engine)
MAX_FAILOVERS = 2
GATEWAY_ARGS = ("--prefill-timeout", "60", "--decode-timeout", "60", "--max-failovers", str(MAX_FAILOVERS),
                "--prefill-first-byte-timeout", f"{FIRST_BYTE_TIMEOUT_S:g}",
                "--decode-first-byte-timeout", f"{FIRST_BYTE_TIMEOUT_S:g}")
# The directory's transfer cap per engine and each client's share of it (docs/directory.md), low enough that a
# flooding client meets its share long before the engine's cap; the well-behaved clients stay far under both.
TRANSFER_CAP_PER_ENGINE = 64
CLIENT_SHARE = 0.25
DIRECTORY_ENV = {"KVPUSH_DIRECTORY_MAX_ACTIVE_TRANSFERS_PER_ENGINE": str(TRANSFER_CAP_PER_ENGINE),
                 "KVPUSH_DIRECTORY_MAX_CLIENT_SHARE": f"{CLIENT_SHARE:g}"}
FREEZE_S = 20.0  # decode-freeze: under LEASE_TTL_S, over FIRST_BYTE_TIMEOUT_S
FREEZE_PROBE_PROMPT = list(range(11, 75))  # decode-freeze's own streamed request (token ids of the tiny model)
# decode-freeze: a probe answered this soon after the freeze was not planned on the frozen engine (its first byte
# waits FIRST_BYTE_TIMEOUT_S there); the freeze is then tried again, this many times in all.
FREEZE_PROBE_SETTLE_S = 2.0
FREEZE_ATTEMPTS = 5
FLOOD_S = 10.0  # oversized and invalid-flood
OVERSIZED_MIB = (20, 40, 60)  # over the directory's 16 MiB message cap; under the client's own 64 MiB send cap
OVERSIZED_CONCURRENCY = 4
INVALID_FLOOD_RATE = 40.0  # invalid requests per second, over two connections
FLOOD_SOURCE_ADDRESS = "127.0.0.2"  # the flooding client's address: loopback, but not the soak clients' one
# A client's pause after a 503 (no engine of a role reachable: e.g. the only prefill engine restarting).
RETRY_AFTER_S = 5.0
LIVE_STATES = (tpb.TRANSFER_STATE_PLANNED, tpb.TRANSFER_STATE_ALLOCATED, tpb.TRANSFER_STATE_STREAMING)


def say(message: str) -> None:
    """Progress on stderr (stdout is the JSON)."""
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the load


def prompt_pool(size: int, seed: int) -> list[list[int]]:
    """`size` token-id prompts of the PROMPT_LENGTHS, seeded."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 1024) for _ in range(PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)])] for i in range(size)]


def body_of(prompt: list[int]) -> dict:
    """A greedy completion of `prompt` that returns its token ids."""
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}


def references(colocated_url: str, prompts: list[list[int]]) -> list[list[int]]:
    """The colocated engine's token ids for every prompt."""
    out = []
    for prompt in prompts:
        result = call("POST", colocated_url + "/v1/completions", body_of(prompt), timeout_s=120)
        if result.status != 200:
            raise RuntimeError(f"colocated engine failed a reference: {result.status} {result.text[:300]}")
        out.append(result.body["choices"][0]["token_ids"])
    return out


@dataclass
class Outcome:
    """How one request ended."""

    index: int
    kind: str  # completed | failed | aborted | hung
    started_s: float  # since the soak began
    elapsed_s: float
    stream: bool
    status: int = 0
    error: str = ""
    corrupt: bool = False


def _stream(url: str, body: dict, bound_s: float, abort: bool) -> tuple[int, list[int], str, bool]:
    """A streamed completion: (status, token ids, error, aborted). Aborting closes the socket after the first event."""
    address, _, rest = url.split("//", 1)[1].partition("/")
    host, _, port = address.partition(":")
    conn = http.client.HTTPConnection(host, int(port or 80), timeout=bound_s)
    ids: list[int] = []
    try:
        conn.request("POST", "/" + rest, body=json.dumps({**body, "stream": True}).encode(),
                     headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
        response = conn.getresponse()
        if response.status != 200:
            return response.status, [], response.read().decode(errors="replace")[:300], False
        while True:
            line = response.readline()
            if not line:
                return 200, ids, "stream ended without [DONE]", False
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return 200, ids, "", False
            event = json.loads(data)
            if "error" in event:
                return 200, ids, json.dumps(event["error"])[:300], False
            for choice in event.get("choices", []):
                ids += choice.get("token_ids") or []
            if abort:
                return 200, ids, "", True
    finally:
        conn.close()


def one_request(gateway_url: str, index: int, prompt_index: int, prompt: list[int], want: list[int], stream: bool,
                abort: bool, bound_s: float, t0: float, send_at_s: float = 0.0) -> Outcome:
    """Send one request (not before `send_at_s` into the soak) and classify how it ended (module docstring)."""
    delay = t0 + send_at_s - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    started = time.monotonic()
    outcome = Outcome(index, "failed", started - t0, 0.0, stream)
    try:
        if stream:
            status, ids, error, aborted = _stream(gateway_url + "/v1/completions", body_of(prompt), bound_s, abort)
        else:
            result = call("POST", gateway_url + "/v1/completions", body_of(prompt), timeout_s=bound_s)
            status, aborted = result.status, False
            ids = result.body["choices"][0]["token_ids"] if status == 200 and result.body else []
            error = "" if status == 200 else ((result.body or {}).get("error", {}).get("message") or result.text)[:300]
        outcome.status, outcome.error = status, error
        if aborted:
            outcome.kind = "aborted"
        elif status == 200 and not error:
            outcome.kind = "completed"
            outcome.corrupt = ids != want
        else:
            outcome.kind = "failed"
    except TimeoutError:
        outcome.kind, outcome.error = "hung", f"no answer within {bound_s:.0f} s"
    except (OSError, http.client.HTTPException, ValueError) as error:
        outcome.kind, outcome.error = "failed", f"client: {error!r}"[:300]
    outcome.elapsed_s = time.monotonic() - started
    if outcome.elapsed_s > bound_s:
        outcome.kind = "hung"
    if outcome.kind == "failed" and outcome.status == 503:
        time.sleep(RETRY_AFTER_S)  # as a client honouring Retry-After would: no tight loop while an engine restarts
    return outcome


# ---------------------------------------------------------------- memory


class Sampling:
    """Calls `sample()` at `start()` and every `interval_s` after, in a background thread, until `stop()`."""

    interval_s: float
    _stop: threading.Event | None = None
    _thread: threading.Thread | None = None

    def sample(self) -> None:
        raise NotImplementedError

    def start(self):
        stop = self._stop = threading.Event()

        def loop() -> None:
            while not stop.wait(self.interval_s):
                self.sample()
        self.sample()
        self._thread = threading.Thread(target=loop, name=f"soak-{type(self).__name__}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()
        if self._thread is not None:
            self._thread.join(10)


@dataclass
class MemorySampler(Sampling):
    """RSS of named process groups over time, in a background thread."""

    stack: LocalStack
    interval_s: float
    t0: float
    samples: dict[str, list[tuple[float, float, int]]] = field(default_factory=dict)  # name -> (t, MiB, pid)

    def groups(self) -> dict[str, int]:
        """Process name -> its group leader's pid (the directory, the gateway, every engine but the colocated)."""
        out = {}
        if self.stack.directory and self.stack.directory.process.alive():
            out["directory"] = self.stack.directory.process.pid
        if self.stack.gateway and self.stack.gateway.process.alive():
            out["gateway"] = self.stack.gateway.process.pid
        for engine in (self.stack.prefill, *self.stack.decodes):
            if engine is not None and engine.process.alive():
                out[engine.spec.name] = engine.process.pid
        return out

    def sample(self) -> None:
        """One sample of every group's summed RSS."""
        groups = self.groups()
        rss: Counter[int] = Counter()
        for proc in psutil.process_iter(["pid", "memory_info"]):
            try:
                pgid = os.getpgid(proc.info["pid"])
            except OSError:
                continue
            if pgid in groups.values() and proc.info["memory_info"] is not None:
                rss[pgid] += proc.info["memory_info"].rss
        now = time.monotonic() - self.t0
        for name, pid in groups.items():
            if rss[pid]:
                self.samples.setdefault(name, []).append((round(now, 1), round(rss[pid] / 2**20, 1), pid))


def slope_mib_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MiB) points in MiB/min (None under 5 points)."""
    if len(points) < 5:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_m = sum(m for _, m in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return None
    return round(60 * sum((t - mean_t) * (m - mean_m) for t, m in points) / var, 3)


def settled(points: list[tuple[float, float]], share: float = 0.9) -> list[tuple[float, float]]:
    """A life's points from the first one at `share` of its largest RSS on: a (re)started engine loads its model
    and allocates its KV cache first, and that ramp is start-up, not growth."""
    peak = max(m for _, m in points)
    first = next(i for i, (_, m) in enumerate(points) if m >= share * peak)
    return points[first:]


def memory_summary(samples: dict[str, list[tuple[float, float, int]]]) -> dict[str, Any]:
    """Per process: each life's (pid's) first/last/max RSS and its slope once settled (`settled`)."""
    out: dict[str, Any] = {}
    for name, series in samples.items():
        lives: dict[int, list[tuple[float, float]]] = {}
        for t, mib, pid in series:
            lives.setdefault(pid, []).append((t, mib))
        summary = []
        for pid, points in lives.items():
            steady = settled(points)
            summary.append({"pid": pid, "from_s": points[0][0], "to_s": points[-1][0], "first_mib": points[0][1],
                            "last_mib": points[-1][1], "max_mib": max(m for _, m in points),
                            "slope_mib_per_min": slope_mib_per_min(steady), "settled_from_s": steady[0][0],
                            "sample_count": len(points)})
        longest = max(summary, key=lambda life: life["to_s"] - life["from_s"])
        out[name] = {"lives": summary, "longest_life_slope_mib_per_min": longest["slope_mib_per_min"],
                     "longest_life_s": round(longest["to_s"] - longest["from_s"], 1)}
    return out


# ---------------------------------------------------------------- faults


class FaultInjector:
    """Applies one fault at a time at seeded random moments, in a background thread (module docstring)."""

    def __init__(self, stack: LocalStack, faults: list[str], interval_s: float, seed: int, t0: float,
                 relaunch_timeout_s: float = 420.0, freeze_s: float = FREEZE_S, flood_s: float = FLOOD_S) -> None:
        self.stack = stack
        self.freeze_s = freeze_s
        self.flood_s = flood_s
        self.faults = faults
        self.interval_s = interval_s
        self.rng = random.Random(seed + 1)
        self.t0 = t0
        self.relaunch_timeout_s = relaunch_timeout_s
        self.events: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.busy = threading.Lock()

    def _client(self) -> SyncDirectoryClient:
        return SyncDirectoryClient(self.stack.directory_channel(timeout_s=5.0, max_attempts=2))

    def registered(self) -> set[str]:
        """Engine ids the directory lists now (empty while it is unreachable)."""
        client = self._client()
        try:
            return {w.engine_id for w in client.list_engines()}
        except DirectoryCallError:
            return set()
        finally:
            client.close()

    @staticmethod
    def _wait(predicate, timeout_s: float) -> bool:
        """Poll `predicate` every second up to `timeout_s` (a fault in progress always finishes its recovery)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(1.0)
        return predicate()

    def _engine_id(self, engine) -> str:
        return engine.spec.kv_transfer_config["engine_id"]

    def apply(self, fault: str) -> dict[str, Any]:
        """Inject one fault and wait until the stack has recovered (bounded); returns what happened."""
        stack = self.stack
        event: dict[str, Any] = {"fault": fault, "at_s": round(time.monotonic() - self.t0, 1)}
        all_ids = {self._engine_id(e) for e in (stack.prefill, *stack.decodes)}
        if fault in ("decode-kill", "prefill-kill"):
            engine = self.rng.choice(stack.decodes) if fault == "decode-kill" else stack.prefill
            engine_id = self._engine_id(engine)
            event["engine_id"] = engine_id
            stack.kill(engine)
            # A restarted engine registers as a new worker: the old lease must lapse first (30 s).
            event["lease_lapsed"] = self._wait(lambda: engine_id not in self.registered(), LEASE_TTL_S + 15)
            fresh = stack.relaunch(engine)
            took = fresh.wait_ready(self.relaunch_timeout_s)
            event["relaunch_s"] = round(took, 1)
        elif fault == "directory-kill":
            stack.restart_directory()
            event["reregistered"] = self._wait(lambda: self.registered() >= all_ids, 60)
        elif fault == "lease-expiry":
            engine = self.rng.choice(stack.decodes)
            engine_id = self._engine_id(engine)
            event["engine_id"] = engine_id
            engine.process._signal_group(signal.SIGSTOP)
            try:
                event["lease_lapsed"] = self._wait(lambda: engine_id not in self.registered(), LEASE_TTL_S + 15)
            finally:
                engine.process._signal_group(signal.SIGCONT)
            event["reregistered"] = self._wait(lambda: engine_id in self.registered(), 60)
        elif fault == "decode-freeze":
            event.update(self._freeze())
        elif fault == "oversized":
            event.update(self._oversized())
        elif fault == "invalid-flood":
            event.update(self._invalid_flood())
        else:
            raise ValueError(f"unknown fault {fault!r}")
        event["recovered_at_s"] = round(time.monotonic() - self.t0, 1)
        say(f"fault {event}")
        return event

    def _first_choice(self) -> str:
        """The decode engine id the directory would plan next (a probe plan, cancelled at once); a seeded choice
        when the probe fails."""
        client = self._client()
        try:
            probe = client.plan_transfer(model="tiny").transfer
            client.cancel_transfer(probe.transfer_id, "soak probe")
            return probe.decode_engine_id
        except DirectoryCallError:
            return self._engine_id(self.rng.choice(self.stack.decodes))
        finally:
            client.close()

    def _freeze(self) -> dict[str, Any]:
        """decode-freeze (module docstring): SIGSTOP for `freeze_s`, watching the gateway's decode failover counters.

        The probe request must be planned on the frozen engine, or there is no leg to fail over. The directory's
        first choice can move between the choice and the probe's plan (the other engine reports more free blocks,
        while the frozen one's report stays as it was), so a probe that completes within `FREEZE_PROBE_SETTLE_S`
        was planned elsewhere: the engine is thawed and the freeze tried again, `FREEZE_ATTEMPTS` times at most."""
        attempts = 0
        while True:
            attempts += 1
            engine_id = self._first_choice()
            engine = next(e for e in self.stack.decodes if self._engine_id(e) == engine_id)
            before = gateway_metrics(self.stack)
            frozen_wall = time.time()
            frozen = time.monotonic()
            engine.process._signal_group(signal.SIGSTOP)
            probe: list[Outcome] = []
            prober = threading.Thread(target=lambda into=probe, since=frozen: into.append(one_request(
                self.stack.gateway_url, -1, -1, FREEZE_PROBE_PROMPT, [], True, False, self.freeze_s + 60.0,
                since)), name="soak-freeze-probe", daemon=True)
            prober.start()
            prober.join(FREEZE_PROBE_SETTLE_S)
            if not probe or attempts >= FREEZE_ATTEMPTS:
                break
            engine.process._signal_group(signal.SIGCONT)  # the probe went elsewhere: try again
            time.sleep(0.5)
        first_failover_s = None
        try:
            while time.monotonic() - frozen < self.freeze_s:
                if first_failover_s is None and _decode_failovers(gateway_metrics(self.stack)) > \
                        _decode_failovers(before):
                    first_failover_s = round(time.monotonic() - frozen, 2)
                time.sleep(0.25)
        finally:
            engine.process._signal_group(signal.SIGCONT)
        thawed_wall = time.time()
        prober.join(self.freeze_s + 60.0)
        after = gateway_metrics(self.stack)
        out: dict[str, Any] = {"engine_id": engine_id, "freeze_attempts": attempts,
                               "frozen_s": round(time.monotonic() - frozen, 1),
                               "first_decode_failover_s": first_failover_s,
                               "gateway_counters_during": {k: after.get(k, 0.0) - before.get(k, 0.0)
                                                           for k in after if after.get(k, 0.0) != before.get(k, 0.0)}}
        out["probe"] = ({"kind": probe[0].kind, "status": probe[0].status, "elapsed_s": round(probe[0].elapsed_s, 2),
                         "error": probe[0].error} if probe else {"kind": "no answer"})
        out.update(self._planned_during(engine_id, frozen_wall, thawed_wall))
        out["reregistered"] = self._wait(lambda: engine_id in self.registered(), 60)
        return out

    def _planned_during(self, engine_id: str, since: float, until: float) -> dict[str, Any]:
        """Where the directory planned transfers between two wall times (seconds after `since`)."""
        client = self._client()
        try:
            transfers = client.list_transfers(limit=1000)
        except DirectoryCallError as error:
            return {"planned_during": f"not listed: {error}"[:300]}
        finally:
            client.close()
        decode_ids = {self._engine_id(e) for e in self.stack.decodes}
        on_frozen, elsewhere = [], []
        for transfer in transfers:
            created = transfer.create_time.ToNanoseconds() / 1e9
            if since <= created <= until and transfer.decode_engine_id in decode_ids:
                (on_frozen if transfer.decode_engine_id == engine_id else elsewhere).append(created - since)
        return {"planned_on_frozen_count": len(on_frozen),
                "last_planned_on_frozen_s": round(max(on_frozen), 2) if on_frozen else None,
                "planned_elsewhere_count": len(elsewhere),
                "first_planned_elsewhere_s": round(min(elsewhere), 2) if elsewhere else None}

    def _oversized(self) -> dict[str, Any]:
        """oversized (module docstring): the flood in one thread, the directory's RSS and health probed beside it."""
        stack = self.stack
        engine_id = self._engine_id(stack.decodes[-1])
        channel = ChannelConfig(address=stack.directory.address, timeout_s=10.0, max_attempts=1)
        if stack.pki is not None:  # the engine's own certificate: the directory sees that engine calling
            channel = ChannelConfig(address=stack.directory.address, root_cert_file=str(stack.pki.ca),
                                    client_cert_file=str(stack.pki.root / f"{engine_id}.pem"),
                                    client_key_file=str(stack.pki.root / f"{engine_id}.key"),
                                    timeout_s=10.0, max_attempts=1)
        pid = stack.directory.process.pid
        rss_before = _rss_mib(pid)
        health_before = directory_health(stack)
        rss = RssWatch(pid).start()
        flood = OversizedFlood(channel, engine_id, self.flood_s, self.rng.randrange(2**31))
        thread = threading.Thread(target=flood.run, name="soak-oversized", daemon=True)
        thread.start()
        health_during = []
        while thread.is_alive():
            health_during.append(directory_health(stack))
            thread.join(0.5)
        thread.join(self.flood_s + 30)
        rss.stop()
        time.sleep(5.0)  # gRPC gives buffers back once their calls ended
        health_after = [directory_health(stack) for _ in range(5)]
        return {"engine_identity": engine_id if stack.pki is not None else "none (plaintext stack)",
                "flood_s": self.flood_s, "sent": flood.sent, "sent_mib": flood.sent_mib,
                "status_counts": dict(flood.statuses), "slowest_answer_s": round(flood.slowest_s, 3),
                "directory_rss_mib": {"before": rss_before, "peak": rss.peak_mib, "after_5s": _rss_mib(pid)},
                "health_before": health_before, "health_during": _health_summary(health_during),
                "health_after": _health_summary(health_after)}

    def _invalid_flood(self) -> dict[str, Any]:
        """invalid-flood (module docstring): the flood, then a bounded wait for its transfers to end."""
        stack = self.stack
        flood = InvalidFlood(stack.gateway_url, self.flood_s, INVALID_FLOOD_RATE)
        threads = [threading.Thread(target=flood.run, args=(i, 2), name=f"soak-invalid-{i}", daemon=True)
                   for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(self.flood_s + 60)
        ended_wall = time.time()
        left = self._wait(lambda: not self._planned_before(ended_wall), 30)
        client = self._client()
        try:
            engines = {w.engine_id: w.active_transfer_count for w in client.list_engines()}
        except DirectoryCallError:
            engines = {}
        finally:
            client.close()
        return {"flood_s": self.flood_s, "sent": flood.sent, "rate_per_s": round(flood.sent / self.flood_s, 1),
                "status_counts": dict(flood.statuses), "errors": dict(flood.errors.most_common(5)),
                "left_planned": len(self._planned_before(ended_wall)), "planned_cleared": left,
                "active_transfers": engines, "transfer_cap_per_engine": TRANSFER_CAP_PER_ENGINE,
                "client_share_cap": max(1, int(CLIENT_SHARE * TRANSFER_CAP_PER_ENGINE)),
                "most_active_share_of_cap": round(max(engines.values(), default=0) / TRANSFER_CAP_PER_ENGINE, 3)}

    def _planned_before(self, wall: float) -> list[str]:
        """Ids of transfers still PLANNED that were planned before `wall` (the directory's clock)."""
        client = self._client()
        try:
            planned = client.list_transfers(state=tpb.TRANSFER_STATE_PLANNED, limit=1000)
        except DirectoryCallError:
            return ["(directory unreachable)"]
        finally:
            client.close()
        return [t.transfer_id for t in planned if t.create_time.ToNanoseconds() / 1e9 < wall]

    def start(self) -> FaultInjector:
        # Each kind in turn (a seeded order, repeated), so a short soak still sees every kind once.
        order = list(self.faults)
        self.rng.shuffle(order)

        def loop() -> None:
            turn = 0
            while not self._stop.wait(self.rng.uniform(0.5, 1.5) * self.interval_s):
                with self.busy:
                    if self._stop.is_set():
                        return
                    fault = order[turn % len(order)]
                    turn += 1
                    try:
                        self.events.append(self.apply(fault))
                    except Exception as error:  # the soak records it and goes on: the report says what broke
                        say(f"fault injection failed: {error!r}")
                        self.events.append({"fault": "injection-error", "error": repr(error)[:500],
                                            "at_s": round(time.monotonic() - self.t0, 1)})
        if self.faults:
            self._thread = threading.Thread(target=loop, name="soak-faults", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop injecting; waits for a fault in progress to recover."""
        self._stop.set()
        with self.busy:
            pass
        if self._thread is not None:
            self._thread.join(30)


def _decode_failovers(metrics: dict[str, float]) -> float:
    """The gateway's decode-leg failovers and first-byte timeouts, summed (either one means a leg moved on)."""
    return sum(v for k, v in metrics.items() if 'leg="decode"' in k and k.startswith(
        ("kvpush_gateway_failovers_total", "kvpush_gateway_first_byte_timeouts_total")))


def _rss_mib(pid: int | None) -> float | None:
    """RSS of one process in MiB (None when it is gone)."""
    try:
        return round(psutil.Process(pid).memory_info().rss / 2**20, 1)
    except (psutil.Error, ValueError, TypeError):
        return None


@dataclass
class RssWatch(Sampling):
    """The largest RSS of one process, sampled every 0.1 s (a flood's peak is short)."""

    pid: int | None
    interval_s: float = 0.1
    peak_mib: float = 0.0

    def sample(self) -> None:
        self.peak_mib = max(self.peak_mib, _rss_mib(self.pid) or 0.0)


def directory_health(stack: LocalStack) -> tuple[str, float]:
    """The directory's gRPC health status as the operator sees it, and how long the check took (s)."""
    started = time.monotonic()
    client = SyncDirectoryClient(stack.directory_channel(timeout_s=5.0, max_attempts=1))
    try:
        status = client.health()
    except DirectoryCallError as error:
        status = f"error {error}"[:120]
    finally:
        client.close()
    return status, round(time.monotonic() - started, 4)


def _health_summary(checks: list[tuple[str, float]]) -> dict[str, Any]:
    latencies = sorted(t for _, t in checks)
    return {"count": len(checks), "statuses": dict(Counter(status for status, _ in checks)),
            "latency_p50_s": latencies[len(latencies) // 2] if latencies else None,
            "latency_max_s": latencies[-1] if latencies else None}


def _with_padding(message: bytes, size: int, field_number: int = 1000) -> bytes:
    """`message` plus one unknown length-delimited field of `size` zero bytes: the same request to the directory,
    `size` bytes longer (protobuf keeps unknown fields)."""
    def varint(value: int) -> bytes:
        out = bytearray()
        while True:
            byte, value = value & 0x7F, value >> 7
            out.append(byte | (0x80 if value else 0))
            if not value:
                return bytes(out)
    return message + varint(field_number << 3 | 2) + varint(size) + bytes(size)


@dataclass
class OversizedFlood:
    """GetEngine requests of OVERSIZED_MIB sizes, OVERSIZED_CONCURRENCY at once, for `flood_s` (bounded count)."""

    channel: ChannelConfig
    engine_id: str
    flood_s: float
    seed: int
    sent: int = 0
    sent_mib: int = 0
    slowest_s: float = 0.0
    statuses: Counter[str] = field(default_factory=Counter)

    def run(self) -> None:
        asyncio.run(self._flood())

    async def _flood(self) -> None:
        rng = random.Random(self.seed)
        request = dpb.GetEngineRequest(engine_id=self.engine_id).SerializeToString()
        payloads = {mib: _with_padding(request, mib * 2**20) for mib in OVERSIZED_MIB}
        channel = self.channel.create_channel()
        # Raw bytes out (the padded payload), raw bytes back: nothing here parses what it did not send.
        get_engine = channel.unary_unary("/kvpush.v1.KVDirectoryService/GetEngine")
        deadline = time.monotonic() + self.flood_s
        budget = [int(self.flood_s * 20)]  # at most 20 messages a second in all, whatever the answers' speed

        async def sender() -> None:
            while time.monotonic() < deadline and budget[0] > 0:
                budget[0] -= 1
                mib = rng.choice(OVERSIZED_MIB)
                started = time.monotonic()
                try:
                    await get_engine(payloads[mib], timeout=10.0, metadata=self.channel.metadata)
                    self.statuses["OK"] += 1
                except grpc.aio.AioRpcError as error:
                    self.statuses[error.code().name] += 1
                self.slowest_s = max(self.slowest_s, time.monotonic() - started)
                self.sent += 1
                self.sent_mib += mib

        try:
            await asyncio.gather(*(sender() for _ in range(OVERSIZED_CONCURRENCY)))
        finally:
            await channel.close()


@dataclass
class InvalidFlood:
    """Invalid completions to the gateway from FLOOD_SOURCE_ADDRESS at `rate` per second for `flood_s`."""

    gateway_url: str
    flood_s: float
    rate: float
    sent: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    BODIES = (
        json.dumps({"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": "hot"}).encode(),
        json.dumps({"model": "tiny", "prompt": [9, 10, 11], "max_tokens": 4, "temperature": "hot",
                    "stream": True}).encode(),
        b'{"model": "tiny", "prompt": [5, 6, 7',
    )

    def run(self, index: int, of: int) -> None:
        """One connection's share (`of` connections in all), paced; a closed connection is opened again."""
        host, _, port = self.gateway_url.split("//", 1)[1].partition(":")
        per_connection = self.rate / of
        count = int(self.flood_s * per_connection)
        started = time.monotonic()
        conn = None
        for i in range(count):
            delay = started + i / per_connection - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            if time.monotonic() - started > self.flood_s:
                break
            body = self.BODIES[(i * of + index) % len(self.BODIES)]
            try:
                if conn is None:
                    conn = http.client.HTTPConnection(host, int(port), timeout=30,
                                                      source_address=(FLOOD_SOURCE_ADDRESS, 0))
                conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
                response = conn.getresponse()
                text = response.read().decode(errors="replace")
                status = response.status
                error = "" if status == 200 else text[:160]
            except (OSError, http.client.HTTPException) as failure:
                if conn is not None:
                    conn.close()
                conn = None
                status, error = 0, f"client: {failure!r}"[:160]
            with self._lock:
                self.sent += 1
                self.statuses[status] += 1
                if error:
                    self.errors[error] += 1
        if conn is not None:
            conn.close()


# ---------------------------------------------------------------- leaks


def leak_check(stack: LocalStack, quiet_timeout_s: float = 90.0) -> dict[str, Any]:
    """Once every transfer ended (bounded wait): blocks each engine still holds and the directory's live transfers."""
    client = SyncDirectoryClient(stack.directory_channel(timeout_s=5.0, max_attempts=3))
    engines = {e.spec.name: e for e in (stack.prefill, *stack.decodes)}
    deadline = time.monotonic() + quiet_timeout_s
    try:
        while True:
            live = sum(len(client.list_transfers(state=s, limit=1000)) for s in LIVE_STATES)
            workers = {w.engine_id: w for w in client.list_engines()}
            usage = {name: kv_cache_usage(e.url) for name, e in engines.items()}
            if (live == 0 and not any(usage.values())) or time.monotonic() > deadline:
                break
            time.sleep(2.0)
        blocks = {}
        for name, engine in engines.items():
            worker = workers.get(engine.spec.kv_transfer_config["engine_id"])
            block_count = worker.layout.block_count if worker is not None else 0
            blocks[name] = round(usage[name] * block_count)
        return {"kv_cache_usage_perc": usage, "engine_blocks_held": blocks,
                "directory_live_transfers": live,
                "directory_active_transfers": {w.engine_id: w.active_transfer_count for w in workers.values()},
                "leaked_blocks": sum(blocks.values()),
                "leaked": sum(blocks.values()) + live + sum(w.active_transfer_count for w in workers.values())}
    finally:
        client.close()


# ---------------------------------------------------------------- the run


def gateway_metrics(stack: LocalStack) -> dict[str, float]:
    """The gateway's failover and timeout counters."""
    result = call("GET", stack.gateway_url + "/metrics", timeout_s=10)
    wanted = ("kvpush_gateway_failovers_total", "kvpush_gateway_failovers_exhausted_total",
              "kvpush_gateway_unreachable_reports_total", "kvpush_gateway_leg_timeouts_total",
              "kvpush_gateway_cancelled_transfers_total", "kvpush_gateway_first_byte_timeouts_total",
              "kvpush_gateway_cancel_failures_total")
    out = {}
    for line in result.text.splitlines():
        if line.startswith(wanted):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def run_soak(stack: LocalStack, *, count: int, rate: float = 2.0, concurrency: int = 4, seed: int = 0,
             faults: list[str] | None = None,
             fault_interval_s: float = 60.0, abort_share: float = 0.05, request_bound_s: float = 180.0,
             sample_s: float = 2.0, prompt_count: int = 20, freeze_s: float = FREEZE_S,
             flood_s: float = FLOOD_S) -> dict[str, Any]:
    """The soak on a running stack (module docstring); returns the result document."""
    faults = list(FAULTS if faults is None else faults)
    prompts = prompt_pool(prompt_count, seed)
    say(f"references for {len(prompts)} prompts from the colocated engine")
    wants = references(stack.colocated.url, prompts)
    rng = random.Random(seed)
    plan = [(i, rng.randrange(len(prompts)), rng.random() < 0.5) for i in range(count)]
    plan = [(i, p, s, s and rng.random() < abort_share / 0.5) for i, p, s in plan]
    t0 = time.monotonic()
    memory = MemorySampler(stack, sample_s, t0).start()
    injector = FaultInjector(stack, faults, fault_interval_s, seed, t0, freeze_s=freeze_s, flood_s=flood_s).start()
    outcomes: list[Outcome] = []
    done = Counter()
    say(f"{count} requests at {rate}/s, concurrency {concurrency}, faults {faults or 'none'} "
        f"every ~{fault_interval_s:.0f} s")
    try:
        with ThreadPoolExecutor(concurrency, thread_name_prefix="soak-client") as pool:
            futures = [pool.submit(one_request, stack.gateway_url, i, p, prompts[p], wants[p], s, a, request_bound_s,
                                   t0, i / rate) for i, p, s, a in plan]
            for future in futures:
                outcome = future.result()
                outcomes.append(outcome)
                done[outcome.kind] += 1
                if len(outcomes) % 50 == 0:
                    say(f"{len(outcomes)}/{count}: {dict(done)}")
    finally:
        injector.stop()
    load_s = time.monotonic() - t0
    say("load done; waiting for quiet, then checking for leaks")
    leaks = leak_check(stack)
    memory.sample()
    memory.stop()
    kinds = Counter(o.kind for o in outcomes)
    failures = Counter(f"{o.status} {o.error[:120]}" for o in outcomes if o.kind == "failed")
    completed = [o for o in outcomes if o.kind == "completed"]
    for event in injector.events:
        event["outcomes"] = fault_outcomes(outcomes, event)
        if event["fault"] == "decode-freeze" and "recovered_at_s" in event:
            # The thawed engine is planned again: a transfer to it must not wait on what the freeze left behind.
            thawed = event["recovered_at_s"]
            event["outcomes_after"] = fault_outcomes(
                outcomes, {"at_s": thawed, "recovered_at_s": thawed + AFTER_FREEZE_S})
    result = {
        "benchmark": "soak",
        "settings": {"count": count, "rate_per_s": rate, "concurrency": concurrency, "seed": seed, "faults": faults,
                     "fault_interval_s": fault_interval_s, "abort_share": abort_share,
                     "request_bound_s": request_bound_s, "prompt_lengths": list(PROMPT_LENGTHS),
                     "max_tokens": MAX_TOKENS, "lease_ttl_s": LEASE_TTL_S, "gateway_args": list(GATEWAY_ARGS),
                     "decode_engine_count": len(stack.decodes), "freeze_s": freeze_s, "flood_s": flood_s,
                     "first_byte_timeout_s": FIRST_BYTE_TIMEOUT_S, "directory_env": DIRECTORY_ENV,
                     "oversized_mib": list(OVERSIZED_MIB), "oversized_concurrency": OVERSIZED_CONCURRENCY,
                     "invalid_flood_rate_per_s": INVALID_FLOOD_RATE},
        "duration_s": round(load_s, 1),
        "outcomes": {kind: kinds.get(kind, 0) for kind in ("completed", "failed", "aborted", "hung")},
        "corrupt": sum(o.corrupt for o in completed),
        "checked_token_identical": len(completed),
        "failures_by_cause": dict(failures.most_common(20)),
        "latency_s": _latency(completed),
        "faults_injected": injector.events,
        "fault_counts": dict(Counter(e["fault"] for e in injector.events)),
        "served_rate": served_rate(outcomes, injector.events, load_s),
        "write_failure": "not injected: the connector has no write-failure fault knob yet",
        "gateway_metrics": gateway_metrics(stack),
        "leaks": leaks,
        "hung": kinds.get("hung", 0),
        "leaked": leaks["leaked"],
        "memory": memory_summary(memory.samples),
        "memory_samples": {name: [[t, m, pid] for t, m, pid in series] for name, series in memory.samples.items()},
        # [ended at s, kind, took s]
        "timeline": [[round(o.started_s + o.elapsed_s, 1), o.kind, round(o.elapsed_s, 2)] for o in outcomes],
    }
    return result


# After a fault recovered, requests it delayed still end: its window for the served rate runs this much longer.
FAULT_TAIL_S = 5.0
# decode-freeze: the requests sent this long after the thaw are summed apart (the event's outcomes_after).
AFTER_FREEZE_S = 30.0


def fault_outcomes(outcomes: list[Outcome], event: dict[str, Any]) -> dict[str, Any]:
    """How the requests sent during one fault (from its start to its recovery) ended, their slowest, and how many
    took longer than the gateway's failover bound ((1 + max failovers) x the first-byte bound: they waited on an
    engine instead of being moved off it)."""
    sent = [o for o in outcomes if event["at_s"] <= o.started_s <= event.get("recovered_at_s", event["at_s"])]
    kinds = Counter(o.kind for o in sent)
    failover_bound_s = (1 + MAX_FAILOVERS) * FIRST_BYTE_TIMEOUT_S
    return {**{kind: kinds.get(kind, 0) for kind in ("completed", "failed", "aborted", "hung")},
            "corrupt": sum(o.corrupt for o in sent),
            "slowest_s": round(max((o.elapsed_s for o in sent), default=0.0), 2),
            "over_failover_bound": sum(o.elapsed_s > failover_bound_s for o in sent),
            "failed_by_status": dict(Counter(o.status for o in sent if o.kind == "failed"))}


def served_rate(outcomes: list[Outcome], events: list[dict[str, Any]], load_s: float,
                warm_up_s: float = 10.0) -> dict[str, Any]:
    """The well-behaved clients' completed requests per second (by when they ended) outside every fault (from
    `warm_up_s` to the end of the load, less each fault's window and FAULT_TAIL_S after it), and during each fault,
    with its ratio to the rate outside. Beside each, the requests sent per second: the clients send on a schedule
    but at most `concurrency` at once, so a rate under the schedule's means requests that waited held every slot."""
    windows = [(e["at_s"], e.get("recovered_at_s", e["at_s"]) + FAULT_TAIL_S) for e in events]
    ended = [o.started_s + o.elapsed_s for o in outcomes if o.kind == "completed"]
    started = [o.started_s for o in outcomes]

    def inside(t: float) -> bool:
        return any(start <= t <= end for start, end in windows)

    # Time outside every window, on a 0.1 s grid (windows may overlap the load's end or each other).
    grid = [warm_up_s + i / 10 for i in range(int(max(0.0, load_s - warm_up_s) * 10))]
    outside_s = sum(0.1 for t in grid if not inside(t))
    outside = sum(1 for t in ended if warm_up_s <= t <= load_s and not inside(t))
    rate_outside = outside / outside_s if outside_s else None
    sent_outside = sum(1 for t in started if warm_up_s <= t <= load_s and not inside(t))
    per_fault = []
    for event, (start, end) in zip(events, windows):
        end = min(end, load_s)
        if end <= start:
            continue
        rate = sum(1 for t in ended if start <= t <= end) / (end - start)
        per_fault.append({"fault": event["fault"], "from_s": start, "to_s": round(end, 1),
                          "completed_per_s": round(rate, 3),
                          "sent_per_s": round(sum(1 for t in started if start <= t <= end) / (end - start), 3),
                          "ratio_to_outside": round(rate / rate_outside, 3) if rate_outside else None})
    return {"completed_per_s_outside_faults": round(rate_outside, 3) if rate_outside else None,
            "sent_per_s_outside_faults": round(sent_outside / outside_s, 3) if outside_s else None,
            "outside_faults_s": round(outside_s, 1), "completed_per_s_overall": round(len(ended) / load_s, 3),
            "during_faults": per_fault}


def _latency(completed: list[Outcome]) -> dict[str, float]:
    if not completed:
        return {}
    values = sorted(o.elapsed_s for o in completed)
    p99 = values[min(len(values) - 1, int(len(values) * 0.99))]
    return {"p50": round(values[len(values) // 2], 3), "p99": round(p99, 3), "max": round(values[-1], 3)}


def plot(result: dict[str, Any], path: Path) -> None:
    """Memory over time (fault marks) and cumulative outcomes over time, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, out) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for name, points in result["memory_samples"].items():
        mem.plot([p[0] for p in points], [p[1] for p in points], ".", markersize=2, label=name)
    for event in result["faults_injected"]:
        for axis in (mem, out):
            axis.axvline(event["at_s"], color="grey", linewidth=0.6, linestyle="--")
        mem.annotate(event["fault"], (event["at_s"], mem.get_ylim()[1]), fontsize=6, rotation=90, va="top")
    mem.set_ylabel("RSS (MiB, process group)")
    mem.set_yscale("log")
    mem.legend(fontsize=7, loc="center right")
    totals = Counter()
    series: dict[str, list[tuple[float, int]]] = {}
    for t, kind, *_ in sorted(result["timeline"]):
        totals[kind] += 1
        series.setdefault(kind, []).append((t, totals[kind]))
    for kind, points in series.items():
        out.step([p[0] for p in points], [p[1] for p in points], where="post", label=kind)
    out.set_xlabel("seconds since the soak began")
    out.set_ylabel("requests ended (cumulative)")
    out.legend(fontsize=7)
    s = result["outcomes"]
    fig.suptitle(f"soak: {result['settings']['count']} requests, {len(result['faults_injected'])} faults — "
                 f"completed {s['completed']}, failed {s['failed']}, aborted {s['aborted']}, hung {s['hung']}, "
                 f"corrupt {result['corrupt']}, leaked {result['leaked']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def soak_stack(log_dir: Path, progress=say) -> LocalStack:
    """The soak's stack (module docstring), not started."""
    return LocalStack(spec=TinyModelSpec(), log_dir=log_dir, progress=progress, engine_timeout_s=600.0,
                      decode_engine_count=2, gateway_args=GATEWAY_ARGS, mutual_tls=HAVE_OPENSSL,
                      service_env=dict(DIRECTORY_ENV))


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The command line's settings and its fault kinds (the parser exits on an unknown one)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=2.0, help="requests sent per second (open loop)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated subset of {FAULTS} ('' none)")
    parser.add_argument("--fault-interval-s", type=float, default=60.0)
    parser.add_argument("--abort-share", type=float, default=0.05)
    parser.add_argument("--request-bound-s", type=float, default=180.0)
    parser.add_argument("--sample-s", type=float, default=2.0)
    parser.add_argument("--freeze-s", type=float, default=FREEZE_S,
                        help="decode-freeze: how long the engine is stopped")
    parser.add_argument("--flood-s", type=float, default=FLOOD_S, help="oversized, invalid-flood: how long each lasts")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--log-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    faults = [f for f in args.faults.split(",") if f]
    unknown = set(faults) - set(FAULTS)
    if unknown:
        parser.error(f"unknown faults {sorted(unknown)}; choose from {FAULTS}")
    return args, faults


def main(argv: list[str] | None = None) -> int:
    """Start the stack, soak, write JSON and PNG, print the JSON; exit 1 when a request hung, was corrupt or leaked."""
    args, faults = parse_args(argv)
    out = args.out or RESULTS_DIR / f"soak-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    log_dir = args.log_dir or Path(f"/tmp/kvpush-soak-{os.getpid()}")
    stack = soak_stack(log_dir)
    stack.start()
    try:
        result = run_soak(stack, count=args.count, rate=args.rate, concurrency=args.concurrency, seed=args.seed,
                          faults=faults, fault_interval_s=args.fault_interval_s, abort_share=args.abort_share,
                          request_bound_s=args.request_bound_s, sample_s=args.sample_s, freeze_s=args.freeze_s,
                          flood_s=args.flood_s)
    finally:
        stack.stop()
    result["command"] = "python bench/soak.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result["log_dir"] = str(log_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, result, indent=1, echo=False)
    plot(result, out.with_suffix(".png"))
    summary = {k: result[k] for k in ("outcomes", "corrupt", "hung", "leaked", "fault_counts", "duration_s",
                                      "served_rate")}
    print(json.dumps(summary, indent=1))
    say(f"{result['hung']} hung, {result['corrupt']} corrupt, {result['leaked']} leaked")
    say(f"wrote {out} and {out.with_suffix('.png')}")
    return 0 if result["hung"] == 0 and result["corrupt"] == 0 and result["leaked"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
