"""A real network partition: replica A runs in its own network namespace and its only link goes down.

A reaches etcd (and its clients reach A) over a veth pair between its namespace and the root one
(`kvpush.localstack.netns.PDNetwork`'s control link); B and C run in the root namespace. Taking the root
end of the link down cuts A off from everything. A must stop serving its shards before B or C claims
any of them (the replicas' own log lines, on one machine clock), and etcd's history must show every
claim created after the previous one's DELETE. Needs root with `ip` (skipped otherwise, with the socket-level
cut of test_partition.py covering the same property everywhere).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime

import pytest

from kvpush.client import ChannelConfig, DirectoryClient
from kvpush.directory.etcd_store import EtcdStore
from kvpush.localstack.netns import PDNetwork
from kvpush.localstack.processes import free_port
from tests.integration.directory.helpers import run
from tests.integration.directory_replicas.conftest import _wait_port
from tests.integration.directory_replicas.harness import wait_all_owned

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("etcd"),
                                reason="needs root with ip (network namespaces) and etcd")
SHARDS = 12
SESSION_TTL_S = 2


def _log_events(path, message: str) -> list[dict]:
    events = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == message:
            entry["at"] = datetime.fromisoformat(entry["timestamp"].replace("Z", "+00:00")).timestamp()
            events.append(entry)
    return events


def test_replica_in_a_cut_network_namespace_stops_before_takeover(tmp_path):
    network = PDNetwork(prefix="kvr", subnet_index=50, rate=None)
    etcd_port, peer_port = free_port(), free_port()
    processes: list[subprocess.Popen] = []
    with network:
        root_ip, a_ip = network.root_ip_for_prefill, network.prefill_ctl_ip
        etcd = subprocess.Popen(
            ["etcd", "--name", "n", "--data-dir", str(tmp_path / "etcd"),
             "--listen-client-urls", f"http://127.0.0.1:{etcd_port},http://{root_ip}:{etcd_port}",
             "--advertise-client-urls", f"http://{root_ip}:{etcd_port}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
             "--initial-cluster", f"n=http://127.0.0.1:{peer_port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        processes.append(etcd)
        try:
            _wait_port(etcd_port, 20)
            ports = {}

            def replica(replica_id: str, netns: str | None, listen_ip: str, endpoint: str) -> None:
                port = ports[replica_id] = free_port()
                argv = [sys.executable, "-m", "kvpush.cli.main", "directory", "--host", listen_ip,
                        "--port", str(port), "--etcd-endpoints", endpoint, "--replica-id", replica_id,
                        "--advertise-address", f"{listen_ip}:{port}", "--shard-count", str(SHARDS),
                        "--session-ttl-s", str(SESSION_TTL_S), "--lease-ttl-s", "3", "--no-uvloop"]
                if netns:
                    argv = ["ip", "netns", "exec", netns, *argv]
                with open(tmp_path / f"{replica_id}.log", "wb") as log:
                    processes.append(subprocess.Popen(
                        argv, stdout=subprocess.DEVNULL, stderr=log,
                        env={**os.environ, "KVPUSH_LOG_FORMAT": "json", "KVPUSH_LOG_LEVEL": "info"}))

            replica("a", network.prefill_ns, a_ip, f"{root_ip}:{etcd_port}")
            replica("b", None, "127.0.0.1", f"127.0.0.1:{etcd_port}")
            replica("c", None, "127.0.0.1", f"127.0.0.1:{etcd_port}")
            run(_scenario(network, etcd_port, ports, tmp_path), timeout_s=90)
        finally:
            for process in reversed(processes):
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


async def _scenario(network: PDNetwork, etcd_port: int, ports: dict[str, int], log_dir) -> None:
    client = DirectoryClient(ChannelConfig(address=f"127.0.0.1:{ports['b']}", timeout_s=2.0))
    try:
        await wait_all_owned(client, 3, timeout_s=40)
        # Settled: every replica serves its share and none is handing shards over (no release in flight).
        deadline = time.monotonic() + 30
        while True:
            owners = list((await client.get_replicas()).shard_owner_replica_ids)
            if sorted(owners.count(r) for r in "abc") == [SHARDS // 3] * 3:
                break
            assert time.monotonic() < deadline, f"replicas never balanced: {owners}"
            await asyncio.sleep(0.2)
        a_shards = {s for s, owner in enumerate(owners) if owner == "a"}
        subprocess.run(["ip", "link", "set", f"{network.prefix}-rp", "down"], check=True)
        cut_at = time.time()
        deadline = time.monotonic() + 4 * SESSION_TTL_S + 10
        claims: list[dict] = []
        fences: list[dict] = []
        while time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            claims = [e for r in ("b", "c") for e in _log_events(log_dir / f"{r}.log", "replica serves shard")
                      if e["shard"] in a_shards and e["at"] > cut_at]
            fences = _log_events(log_dir / "a.log", "replica stopped serving shards")
            if fences and a_shards <= {e["shard"] for e in claims}:
                break
        assert a_shards <= {e["shard"] for e in claims}, f"A's shards {sorted(a_shards)} not all taken: {claims}"
        assert fences, "A never stopped serving"
        assert set(fences[0]["shards"]) == a_shards, fences[0]
        # No two owners: A stopped serving (`served_until`: when its serves() began refusing) before the first
        # successor's claim (one machine clock).
        assert fences[0]["served_until"] < min(e["at"] for e in claims), (fences[0], claims)

        store = EtcdStore([f"127.0.0.1:{etcd_port}"])
        try:
            history: dict[bytes, list[str]] = {}

            async def read_history():
                async for _, events in store.watch_prefix(b"/kvpush/shards/", 1):
                    for event in events:
                        history.setdefault(event.kv.key, []).append("DELETE" if event.deleted else "PUT")

            reader = asyncio.ensure_future(read_history())
            await asyncio.sleep(1.0)
            reader.cancel()
            for key, kinds in history.items():
                assert all(not (x == "PUT" and y == "PUT") for x, y in itertools.pairwise(kinds)), (key, kinds)
        finally:
            await store.close()

        subprocess.run(["ip", "link", "set", f"{network.prefix}-rp", "up"], check=True)
        await wait_all_owned(client, 3, timeout_s=40)  # A rejoins with a new session and gets a share
    finally:
        await client.close()
