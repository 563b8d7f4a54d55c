"""A real etcd on loopback (free ports, a temporary data dir) and directory replicas as real processes.

Skipped with a message where the `etcd` binary is missing (scripts/setup.sh installs Debian's etcd-server).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvpush.directory.etcd_store import prefix_end  # noqa: F401  (the module must import)
from kvpush.localstack.processes import free_port


def _wait_port(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on port {port} after {timeout_s}s")


@dataclass
class Etcd:
    """A running etcd: its client endpoint."""

    endpoint: str
    process: subprocess.Popen


@pytest.fixture
def etcd(tmp_path) -> Iterator[Etcd]:
    """A fresh single-member etcd for one test."""
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("etcd is not installed (scripts/setup.sh installs Debian's etcd-server; "
                    "apt-get install etcd-server)")
    client, peer = free_port(), free_port()
    # The child keeps its own copy of the log's descriptor; ours closes once it has started.
    with open(tmp_path / "etcd.log", "wb") as log:
        process = subprocess.Popen(
            [binary, "--name", "kvpush-test", "--data-dir", str(tmp_path / "etcd"),
             "--listen-client-urls", f"http://127.0.0.1:{client}",
             "--advertise-client-urls", f"http://127.0.0.1:{client}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"kvpush-test=http://127.0.0.1:{peer}"],
            stdout=subprocess.DEVNULL, stderr=log)
    try:
        _wait_port(client, 20)
        # Replicas wait for etcd to answer (Replica.start retries), so a listening port is enough here.
        yield Etcd(f"127.0.0.1:{client}", process)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class ReplicaProcess:
    """One `kvpush directory` replica process."""

    replica_id: str
    port: int
    process: subprocess.Popen

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kill(self) -> None:
        """SIGKILL: no goodbye, no shard released, no lease revoked."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        """SIGTERM and wait (graceful: shards released once empty)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


SHARD_COUNT = 12
SESSION_TTL_S = 2
LEASE_TTL_S = 3.0


def start_replica(etcd_endpoint: str, replica_id: str, log_dir, port: int | None = None) -> ReplicaProcess:
    """Start a replica on loopback (short TTLs so failures show within seconds)."""
    port = port or free_port()
    env = {**os.environ, "KVPUSH_LOG_LEVEL": "info"}
    with open(log_dir / f"{replica_id}.log", "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvpush.cli.main", "directory", "--host", "127.0.0.1", "--port", str(port),
             "--etcd-endpoints", etcd_endpoint, "--replica-id", replica_id, "--shard-count", str(SHARD_COUNT),
             "--session-ttl-s", str(SESSION_TTL_S), "--lease-ttl-s", str(LEASE_TTL_S), "--transfer-ttl-s", "30",
             "--grace-s", "2", "--no-uvloop"],
            stdout=subprocess.DEVNULL, stderr=log, env=env)
    _wait_port(port, 30)
    return ReplicaProcess(replica_id, port, process)


@pytest.fixture
def replica_set(etcd, tmp_path) -> Iterator[list[ReplicaProcess]]:
    """Three replicas on one etcd."""
    replicas = [start_replica(etcd.endpoint, f"r{i}", tmp_path) for i in range(3)]
    try:
        yield replicas
    finally:
        for replica in replicas:
            replica.stop()
