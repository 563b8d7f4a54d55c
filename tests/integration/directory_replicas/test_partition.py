"""A replica cut off from etcd stops serving its shards before another replica takes them.

The cut is at the socket level: replica A reaches etcd only through a TCP relay the test owns, and
"partitioning" A closes every relayed connection and refuses new ones (B and C talk to etcd directly).
Three replicas run in this process so their shard facts (when each started and stopped serving a
shard, and the etcd revision of each claim) can be compared; etcd's own history (a watch from
revision 1) shows every claim of a shard was created only after the previous one was deleted.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import grpc
from prometheus_client import generate_latest

from kvpush.api.shards import shard_of, shard_redirect
from kvpush.client import ChannelConfig, DirectoryClient
from kvpush.directory.etcd_store import EtcdStore
from kvpush.directory.replica import ReplicaConfig
from kvpush.directory.server import DirectoryConfig, create_server
from kvpush.directory.state import Limits
from kvpush.v1 import directory_pb2 as dpb
from tests.fixtures.directory import DECODE, PREFILL, register_request
from tests.integration.directory.helpers import run
from tests.integration.directory_replicas.harness import wait_all_owned

SHARDS = 12
SESSION_TTL_S = 2


class Relay:
    """A TCP relay to etcd that can be cut (every connection closed, new ones refused) and healed."""

    def __init__(self, target: str) -> None:
        self.host, port = target.rsplit(":", 1)
        self.target_port = int(port)
        self.cut_off = False
        self._writers: set[asyncio.StreamWriter] = set()
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut_off:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    if self.cut_off:
                        break
                    sink.write(data)
                    await sink.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                sink.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers.difference_update((writer, up_writer))

    def cut(self) -> None:
        self.cut_off = True
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    def heal(self) -> None:
        self.cut_off = False

    async def close(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()


def _replica(endpoint: str, replica_id: str):
    config = DirectoryConfig(port=0, limits=Limits(lease_ttl_s=3.0), replica=ReplicaConfig(
        etcd_endpoints=(endpoint,), replica_id=replica_id, shard_count=SHARDS, session_ttl_s=SESSION_TTL_S,
        etcd_timeout_s=0.5))
    return create_server(config)


def test_partitioned_replica_stops_serving_before_another_takes_over(etcd):
    run(_partition(etcd), timeout_s=90)


async def _partition(etcd) -> None:
    relay = Relay(etcd.endpoint)
    relayed = await relay.start()
    servers = []
    for replica_id, endpoint in (("a", relayed), ("b", etcd.endpoint), ("c", etcd.endpoint)):
        server, port = _replica(endpoint, replica_id)
        await server.start()
        servers.append((server, port))
    a, b, c = (s.servicer.replica for s, _ in servers)
    client = DirectoryClient(ChannelConfig(address=f"127.0.0.1:{servers[1][1]}"))
    a_client = DirectoryClient(ChannelConfig(address=f"127.0.0.1:{servers[0][1]}", max_attempts=1))
    try:
        await wait_all_owned(client, 3)
        await client.register_engine(register_request("p1", PREFILL))
        await client.register_engine(register_request("d1", DECODE))
        await asyncio.sleep(0.3)
        deadline = time.monotonic() + 20  # settled: each serves its share, none hands shards over
        while not all(len(r.owned) == SHARDS // 3 and not r.draining for r in (a, b, c)):
            assert time.monotonic() < deadline, [(sorted(r.owned), sorted(r.draining)) for r in (a, b, c)]
            await asyncio.sleep(0.05)
        a_shards = set(a.owned)
        assert a_shards
        plan = await a_client.plan_transfer(prompt_token_count=16)  # a transfer in one of A's shards
        transfer_id = plan.transfer.transfer_id
        assert shard_of(transfer_id, SHARDS) in a_shards

        relay.cut()
        cut_at = time.time()
        deadline = time.monotonic() + 3 * SESSION_TTL_S + 5
        def claims_since_cut() -> dict[int, tuple[int, float, str]]:  # (earlier claims: the initial balancing)
            return {s: (revision, when, r.replica_id) for r in (b, c) for s, revision, when in r.facts.claims
                    if s in a_shards and when > cut_at}

        while time.monotonic() < deadline and not a_shards <= set(claims_since_cut()):
            await asyncio.sleep(0.05)
        claims = claims_since_cut()
        assert set(claims) == a_shards, f"A's shards {sorted(a_shards)} not all taken over: {claims}"
        assert a.facts.fences, "A never stopped serving"
        fenced_at, fenced_shards, why = a.facts.fences[0]
        assert set(fenced_shards) == a_shards and "keep-alive" in why, a.facts.fences
        first_claim = min(when for _, when, _ in claims.values())
        # No two owners: A stopped serving before anyone else started, and not before its session could lapse.
        assert fenced_at < first_claim, (fenced_at, first_claim)
        assert fenced_at - cut_at < SESSION_TTL_S + 0.5
        scraped = generate_latest(servers[0][0].metrics.registry).decode()
        assert 'kvpush_directory_replica_shards{kind="served"} 0.0' in scraped
        assert "kvpush_directory_replica_fences_total 1.0" in scraped
        # A now refuses its former shard precisely, naming nobody (it cannot know) or the new owner.
        try:
            await a_client.get_transfer(transfer_id)
            raise AssertionError("a partitioned replica answered for a shard it no longer serves")
        except Exception as error:  # DirectoryCallError
            assert error.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION), error
        # The new owner adopted the planned transfer from etcd: it goes on there.
        transfer = await client.get_transfer(transfer_id)
        assert transfer.transfer_id == transfer_id

        # etcd's history: each shard key was created by one session at a time (a DELETE between two claims).
        store = EtcdStore([etcd.endpoint])
        try:
            history: dict[bytes, list[tuple[str, int]]] = {}

            async def read_history():
                async for _, events in store.watch_prefix(b"/kvpush/shards/", 1):
                    for event in events:
                        history.setdefault(event.kv.key, []).append(
                            ("DELETE" if event.deleted else "PUT", event.kv.mod_revision))

            reader = asyncio.ensure_future(read_history())
            await asyncio.sleep(1.0)
            reader.cancel()
            for key, events in history.items():
                kinds = [kind for kind, _ in events]
                assert all(not (x == "PUT" and y == "PUT") for x, y in itertools.pairwise(kinds)), (key, events)
            for shard, (revision, _, _) in claims.items():
                events = history[f"/kvpush/shards/{shard:04d}".encode()]
                delete_revisions = [rev for kind, rev in events if kind == "DELETE" and rev < revision]
                assert delete_revisions, f"shard {shard} claimed at {revision} without A's claim being deleted"
        finally:
            await store.close()

        # Healed, A rejoins with a new session and gets a share again; still one owner per shard.
        relay.heal()
        await wait_all_owned(client, 3, timeout_s=30)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            serving = [sum(r.serves(s) for r in (a, b, c)) for s in range(SHARDS)]
            assert max(serving) <= 1, serving
            await asyncio.sleep(0.05)
        response = await client.get_replicas()
        assert sorted(r.replica_id for r in response.replicas) == ["a", "b", "c"]
    finally:
        await client.close()
        await a_client.close()
        for server, _ in servers:
            await server.stop(0.5)
        await relay.close()


def test_a_replica_on_every_interface_must_advertise_an_address(etcd):
    async def build():
        config = DirectoryConfig(host="0.0.0.0", port=0, replica=ReplicaConfig(etcd_endpoints=(etcd.endpoint,)))
        try:
            create_server(config)
        except ValueError as error:
            return str(error)
        return ""

    assert "--advertise-address" in run(build(), timeout_s=10)


def test_redirect_names_the_owner(etcd):
    run(_redirect(etcd), timeout_s=60)


async def _redirect(etcd) -> None:
    servers = []
    for replica_id in ("a", "b"):
        server, port = _replica(etcd.endpoint, replica_id)
        await server.start()
        servers.append((server, port))
    a_client = DirectoryClient(ChannelConfig(address=f"127.0.0.1:{servers[0][1]}"))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{servers[1][1]}")
    try:
        await wait_all_owned(a_client, 2)
        await a_client.register_engine(register_request("p1", PREFILL))
        await a_client.register_engine(register_request("d1", DECODE))
        plan = await a_client.plan_transfer(prompt_token_count=16)
        from kvpush.v1 import directory_pb2_grpc as dgrpc

        try:
            await dgrpc.KVDirectoryServiceStub(channel).GetTransfer(
                dpb.GetTransferRequest(transfer_id=plan.transfer.transfer_id), timeout=5)
            raise AssertionError("replica b answered for a's transfer")
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
            redirect = shard_redirect(error)
            assert redirect is not None and redirect.reason == "SHARD_NOT_OWNED"
            assert redirect.owner_replica_id == "a" and redirect.owner_address == f"127.0.0.1:{servers[0][1]}"
            assert redirect.shard == shard_of(plan.transfer.transfer_id, SHARDS) and redirect.shard_count == SHARDS
        # Listing through any replica merges every replica's transfers.
        listed = await DirectoryClient(ChannelConfig(address=f"127.0.0.1:{servers[1][1]}")).list_transfers()
        assert plan.transfer.transfer_id in [t.transfer_id for t in listed]
        # A client pointed at b alone follows the redirect to a.
        b_client = DirectoryClient(ChannelConfig(address=f"127.0.0.1:{servers[1][1]}"))
        try:
            transfer = await b_client.report_allocation(plan.transfer.transfer_id, "d1", [1], 16)
            assert transfer.transfer_id == plan.transfer.transfer_id and b_client.redirect_count == 1
        finally:
            await b_client.close()
    finally:
        await channel.close()
        await a_client.close()
        for server, _ in servers:
            await server.stop(0.5)
