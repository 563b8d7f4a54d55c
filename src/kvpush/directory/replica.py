"""A directory replica: one of N `kvpush directory` processes sharing engines and transfers through etcd.

What lives where (docs/directory-replicas.md has the whole design):
- etcd, under `<prefix>/` (default `/kvpush`):
  `replicas/<replica_id>` = {"address"} under the replica's SESSION lease (TTL `session_ttl_s`);
  `shards/<k>` = owner replica id, under the owner's session lease (created only when absent: one owner);
  `engines/reg/<engine_id>/<rank>` = the registration (RegisterEngineRequest, the lease key = sha256 of
  the lease id, never the id itself) under an etcd lease of `lease_ttl_s` per worker, kept alive by the
  replica that takes the worker's renewals; `engines/load/<engine_id>/<rank>` = its last load, same lease;
  `transfers/<k>/<transfer_id>` = `records.StoredTransfer` (parties, deadline, decode's blocks), written
  when planned and when decode's blocks are reported, deleted when the transfer ends.
- memory (the owner's `DirectoryState`): per-layer readiness, instructions, write results, watch logs.

Life cycle:
1. `start()`: grant the session lease, publish the replica, mirror every registration (list, then watch),
   start the session keep-alive, the shard loop and the etcd writer.
2. Session keep-alive every ttl/4: `valid_until` = send time + granted TTL. Past it (etcd unreachable), the
   replica stops serving every shard at once and forgets their transfers: etcd's lease cannot have ended
   before, so no successor can own a shard while this one still serves it.
3. Shard loop every ttl/6: shards with no owner are claimed (a Txn that creates the key only if absent),
   up to ceil(shard_count / live replicas); a claimed shard's stored transfers are adopted
   (`DirectoryState.adopt`) BEFORE it is served. Shards over that share are drained (no new transfers minted
   in them) and released once empty, so a joining replica gets its share without moving live transfers.
4. Engine registrations: every replica mirrors them into its state (`mirror_register` / `mirror_remove`);
   the etcd lease, renewed on each engine renewal by the replica that takes it (any replica can: an etcd
   lease is not bound to a connection), replaces the in-process reaper for registrations.
5. `stop()`: drain, release owned shards once empty (bounded by `grace_s`), revoke the session lease.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import math
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field

import grpc

from kvpush.api.shards import SHARD_HAS_NO_OWNER, SHARD_NOT_OWNED, ShardRedirect, shard_of
from kvpush.directory.errors import NotFound, Unavailable
from kvpush.directory.etcd_store import Delete, EtcdStore, Put
from kvpush.directory.records import Effects, StoredTransfer, TransferObserver, TransferRecord, Worker
from kvpush.directory.state import DirectoryState
from kvpush.observability import get_logger
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb

log = get_logger("directory.replica")
# A queued etcd write: its shard, the operation, and the future of a caller waiting for the commit (None: nobody).
_Op = tuple[int, Put | Delete, asyncio.Future[None] | None]
# Ops of one etcd Txn at most (etcd's default --max-txn-ops is 128).
MAX_OPS_PER_TXN = 64
# The session is presumed lost this long before etcd could end it (clock rate differences, scheduling).
SESSION_SAFETY_MARGIN_S = 0.25


def lease_key(lease_id: str) -> str:
    """What etcd and every replica know of a lease id: its hash (the id itself stays the engine's secret)."""
    return hashlib.sha256(lease_id.encode()).hexdigest()[:40]


@dataclass(frozen=True)
class ReplicaConfig:
    """How a directory replica reaches etcd and what it tells clients."""

    etcd_endpoints: tuple[str, ...]
    # host:port clients use to reach this replica (redirects name it).
    advertise_address: str = ""
    replica_id: str = ""
    shard_count: int = 16
    # The replica's etcd session lease: a dead or partitioned replica's shards move after at most this.
    session_ttl_s: int = 3
    key_prefix: str = "/kvpush"
    etcd_timeout_s: float = 1.0
    etcd_root_cert_file: str = ""
    etcd_client_cert_file: str = ""
    etcd_client_key_file: str = ""


@dataclass
class ShardFacts:
    """What this replica did with shards, with etcd revisions (for operators and the no-two-owners tests)."""

    # (shard, etcd revision of the claim, wall time the replica started serving it)
    claims: list[tuple[int, int, float]] = field(default_factory=list)
    # (wall time the replica stopped serving, shards, why)
    fences: list[tuple[float, tuple[int, ...], str]] = field(default_factory=list)
    releases: list[tuple[int, float]] = field(default_factory=list)


class Replica:
    """Shard ownership, registrations and stored transfers of one directory replica (module docstring)."""

    def __init__(self, config: ReplicaConfig, state: DirectoryState, deliver: Callable[[Effects], None]) -> None:
        if config.shard_count < 1:
            raise ValueError("shard_count must be at least 1")
        self.config = config
        self.state = state
        self.deliver = deliver
        self.replica_id = config.replica_id or uuid.uuid4().hex[:12]
        self.etcd = EtcdStore(config.etcd_endpoints, config.etcd_timeout_s, config.etcd_root_cert_file,
                              config.etcd_client_cert_file, config.etcd_client_key_file)
        self.prefix = config.key_prefix.rstrip("/").encode()
        self.session_lease = 0
        self.valid_until = 0.0
        self.owned: set[int] = set()
        self.draining: set[int] = set()
        # shard -> owner replica id, replica id -> address (as last read from etcd)
        self.owners: dict[int, str] = {}
        self.addresses: dict[str, str] = {}
        self.facts = ShardFacts()
        # (engine id, rank) -> (lease key, etcd lease id) of every mirrored registration
        self.engine_leases: dict[tuple[str, int], tuple[str, int]] = {}
        self._loads: dict[tuple[str, int], bytes] = {}
        self._ops: list[_Op] = []
        self._ops_wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        # Revocations sent off without waiting, kept referenced until done (the loop holds tasks weakly).
        self._background: set[asyncio.Future[object]] = set()
        self._stopping = False
        state.new_transfer_id = self._mint_transfer_id
        state.on_lease_revoked = self._revoke_engine_lease
        state.observer = _EndObserver(state.observer, self)

    # ---------------------------------------------------------------- keys

    def _key(self, *parts: str | int) -> bytes:
        return self.prefix + b"/" + "/".join(str(p) for p in parts).encode()

    def shard_key(self, shard: int) -> bytes:
        """The etcd key that names a shard's owner."""
        return self._key("shards", f"{shard:04d}")

    def transfer_key(self, transfer_id: str) -> bytes:
        """The etcd key of a stored transfer."""
        return self._key("transfers", f"{shard_of(transfer_id, self.config.shard_count):04d}", transfer_id)

    # ---------------------------------------------------------------- life cycle

    async def start(self, etcd_wait_s: float = 30.0) -> None:
        """Join: session lease, replica key, registrations mirrored, background loops running.

        etcd not answering yet (it starts alongside): retried for `etcd_wait_s`, then ConnectionError.
        """
        deadline = time.monotonic() + etcd_wait_s
        while True:
            try:
                await self._new_session()
                break
            except (TimeoutError, grpc.aio.AioRpcError) as error:
                if time.monotonic() >= deadline:
                    raise ConnectionError(f"etcd at {','.join(self.config.etcd_endpoints)} did not answer "
                                          f"within {etcd_wait_s}s: {error}") from None
                log.info("waiting for etcd", endpoints=list(self.config.etcd_endpoints), error=str(error))
                await asyncio.sleep(0.2)
        revision = await self._load_engines()
        self._tasks = [asyncio.create_task(self._keep_session(), name="kvpush-replica-session"),
                       asyncio.create_task(self._fence_on_time(), name="kvpush-replica-fence"),
                       asyncio.create_task(self._shard_loop(), name="kvpush-replica-shards"),
                       asyncio.create_task(self._mirror_engines(revision), name="kvpush-replica-engines"),
                       asyncio.create_task(self._write_loop(), name="kvpush-replica-writer")]
        log.info("directory replica joined", replica_id=self.replica_id, address=self.config.advertise_address,
                 shard_count=self.config.shard_count, session_ttl_s=self.config.session_ttl_s)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Leave: stop minting, release shards once their transfers ended (bounded), revoke the session."""
        self._stopping = True
        self.draining = set(self.owned)
        deadline = time.monotonic() + grace_s
        while self.owned and time.monotonic() < deadline:
            await self._release_empty()
            if self.owned:
                await asyncio.sleep(0.05)
        await self._flush_ops(deadline)
        for task in self._tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await self.etcd.revoke(self.session_lease)
        self.owned.clear()
        await self.etcd.close()

    async def _flush_ops(self, deadline: float) -> None:
        while self._ops and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def _new_session(self) -> None:
        start = time.monotonic()
        self.session_lease, ttl = await self.etcd.grant(self.config.session_ttl_s)
        self.valid_until = start + ttl - SESSION_SAFETY_MARGIN_S
        await self.etcd.put(self._key("replicas", self.replica_id),
                            json.dumps({"address": self.config.advertise_address}).encode(), self.session_lease)

    async def _keep_session(self) -> None:
        period = self.config.session_ttl_s / 4
        while not self._stopping:
            sent = time.monotonic()
            ttl: int | None
            try:  # bounded below the TTL, so a short glitch leaves room for another try before valid_until
                ttl = await asyncio.wait_for(self.etcd.keep_alive(self.session_lease), period)
            except (TimeoutError, ConnectionError, grpc.aio.AioRpcError):
                ttl = None
            if ttl:
                self.valid_until = sent + ttl - SESSION_SAFETY_MARGIN_S
            elif ttl == 0:  # etcd ended the session: every claim is gone with it
                self.fence(tuple(self.owned), "the replica's etcd session ended")
                with contextlib.suppress(ConnectionError, grpc.aio.AioRpcError, asyncio.TimeoutError):
                    await self._new_session()
            await asyncio.sleep(period)

    async def _fence_on_time(self) -> None:
        """Forget the shards the moment the session may have lapsed (`serves()` already refuses them then),
        whatever a keep-alive blocked on a dead network is doing."""
        while not self._stopping:
            delay = self.valid_until - time.monotonic()
            if delay <= 0 and self.owned:
                self.fence(tuple(self.owned), "no session keep-alive answered by etcd within its TTL")
            await asyncio.sleep(max(0.01, delay) if delay > 0 else self.config.session_ttl_s / 4)

    def fence(self, shards: tuple[int, ...], why: str) -> None:
        """Stop serving shards at once and forget their transfers (a successor adopts them from etcd).

        `served_until` in the log and the facts is the wall time `serves()` stopped answering for them.
        """
        if not shards:
            return
        served_until = time.time() - max(0.0, time.monotonic() - self.valid_until)
        self.owned.difference_update(shards)
        self.draining.difference_update(shards)
        lost = set(shards)
        count = self.config.shard_count
        dropped = self.state.forget([r.transfer_id for r in self.state.live_transfers()
                                     if shard_of(r.transfer_id, count) in lost])
        self.facts.fences.append((min(time.time(), served_until), tuple(sorted(shards)), why))
        log.warning("replica stopped serving shards", replica_id=self.replica_id, shards=sorted(shards),
                    reason=why, forgotten_transfer_count=dropped, served_until=round(served_until, 6))

    # ---------------------------------------------------------------- serving

    def serves(self, shard: int) -> bool:
        """True while this replica may act on the shard (owned, and the session surely alive)."""
        return shard in self.owned and time.monotonic() < self.valid_until

    def redirect(self, transfer_id: str) -> ShardRedirect | None:
        """None when this replica serves the transfer's shard; else who does (or that nobody does now)."""
        shard = shard_of(transfer_id, self.config.shard_count)
        if self.serves(shard):
            return None
        owner = self.owners.get(shard, "")
        if owner == self.replica_id:
            owner = ""
        address = self.addresses.get(owner, "") if owner else ""
        return ShardRedirect(SHARD_NOT_OWNED if address else SHARD_HAS_NO_OWNER, shard, self.config.shard_count,
                             owner, address)

    def can_mint(self) -> bool:
        """True when some shard may take a new transfer here."""
        return any(self.serves(s) for s in self.owned - self.draining)

    def check_mintable(self, transfer_id: str) -> None:
        """Unavailable when a caller's transfer id falls in a shard being handed over (it takes no new transfers)."""
        shard = shard_of(transfer_id, self.config.shard_count)
        if shard in self.draining:
            raise Unavailable(f"shard {shard} of transfer {transfer_id} is being handed over; plan again shortly")

    def _mint_transfer_id(self) -> str:
        open_shards = {s for s in self.owned - self.draining if self.serves(s)}
        if not open_shards:
            raise Unavailable(f"replica {self.replica_id} serves no shard that takes new transfers now; "
                              "ask another replica")
        while True:  # expected tries: shard_count / len(open_shards)
            transfer_id = uuid.uuid4().hex
            if shard_of(transfer_id, self.config.shard_count) in open_shards:
                return transfer_id

    @property
    def queued_write_count(self) -> int:
        """Transfer writes queued for etcd, not yet committed."""
        return len(self._ops)

    def replica_addresses(self) -> dict[str, str]:
        """Live replicas by id (as last read from etcd)."""
        return dict(self.addresses)

    # ---------------------------------------------------------------- stored transfers

    def _queue(self, shard: int, op: Put | Delete, wait: bool) -> asyncio.Future[None] | None:
        future: asyncio.Future[None] | None = asyncio.get_running_loop().create_future() if wait else None
        self._ops.append((shard, op, future))
        self._ops_wake.set()
        return future

    async def store(self, record: TransferRecord) -> None:
        """Store (or update) a live transfer in etcd; returns once committed. ConnectionError when it could not be."""
        shard = shard_of(record.transfer_id, self.config.shard_count)
        future = self._queue(shard, Put(self.transfer_key(record.transfer_id), StoredTransfer.of(record).to_json()),
                             wait=True)
        assert future is not None  # wait=True
        await future

    def transfer_ended(self, record: TransferRecord) -> None:
        """Delete an ended transfer from etcd (ordered after its puts; nothing waits for it)."""
        shard = shard_of(record.transfer_id, self.config.shard_count)
        if shard in self.owned:
            self._queue(shard, Delete(self.transfer_key(record.transfer_id)), wait=False)

    async def _write_loop(self) -> None:
        """The only etcd writer of transfers: ops in order, many per Txn, each guarded by its shard's claim."""
        while True:
            await self._ops_wake.wait()
            self._ops_wake.clear()
            while self._ops:
                batch, self._ops = self._ops[:MAX_OPS_PER_TXN], self._ops[MAX_OPS_PER_TXN:]
                await self._commit(batch)

    async def _commit(self, batch: list[_Op]) -> None:
        groups: list[list[_Op]] = [batch]
        first = True
        while groups:
            group = groups.pop()
            shards = sorted({shard for shard, _, _ in group})
            error: Exception | None = None
            try:
                ok = await self.etcd.txn([op for _, op, _ in group],
                                         [(self.shard_key(s), self.session_lease) for s in shards])
                if not ok and first and len(shards) > 1:  # one shard lost: commit the others alone
                    first = False
                    groups.extend([[item for item in group if item[0] == s] for s in shards])
                    continue
                if not ok:
                    error = ConnectionError(f"shard {shards} is no longer this replica's")
            except (TimeoutError, grpc.aio.AioRpcError) as exc:
                error = ConnectionError(f"etcd write failed: {exc}")
            for _, _, future in group:
                if future is not None and not future.done():
                    if error is None:
                        future.set_result(None)
                    else:
                        future.set_exception(error)

    # ---------------------------------------------------------------- shards

    async def _shard_loop(self) -> None:
        period = self.config.session_ttl_s / 6
        while not self._stopping:
            try:
                await self._balance()
            except (TimeoutError, grpc.aio.AioRpcError, ConnectionError) as error:
                log.info("shard scan failed; retrying", error=str(error))
            await asyncio.sleep(period)

    async def _balance(self) -> None:
        replicas, _ = await self.etcd.get_prefix(self._key("replicas") + b"/")
        self.addresses = {kv.key.rsplit(b"/", 1)[1].decode(): json.loads(kv.value).get("address", "")
                          for kv in replicas}
        claims, _ = await self.etcd.get_prefix(self._key("shards") + b"/")
        owners: dict[int, str] = {}
        mine: set[int] = set()
        for kv in claims:
            shard = int(kv.key.rsplit(b"/", 1)[1])
            owners[shard] = kv.value.decode()
            if owners[shard] == self.replica_id and kv.lease == self.session_lease:
                mine.add(shard)
        self.owners = owners
        lost = self.owned - mine
        if lost:
            self.fence(tuple(lost), "the shard's claim is gone from etcd")
        if self._stopping or time.monotonic() >= self.valid_until:
            return
        count = self.config.shard_count
        share = math.ceil(count / max(1, len(self.addresses)))
        for shard in range(count):
            if len(self.owned) >= share:
                break
            if shard in owners:
                continue
            created, revision = await self.etcd.create(self.shard_key(shard), self.replica_id.encode(),
                                                       self.session_lease)
            if created:
                await self._adopt(shard, revision)
        excess = sorted(self.owned - self.draining, reverse=True)[:max(0, len(self.owned) - share)]
        if excess and len(owners) >= count:  # someone waits for a share and no shard is free: hand some over
            self.draining.update(excess)
        elif len(self.owned) <= share:
            self.draining.clear()
        await self._release_empty()

    async def _adopt(self, shard: int, revision: int) -> None:
        stored, _ = await self.etcd.get_prefix(self._key("transfers", f"{shard:04d}") + b"/")
        reason = f"directory shard {shard} moved to replica {self.replica_id} while the transfer was in flight"
        adopted = 0
        for kv in stored:
            try:
                transfer = StoredTransfer.from_json(kv.value)
            except (ValueError, KeyError, TypeError) as error:
                log.warning("unreadable stored transfer skipped", key=kv.key.decode(errors="replace"), error=str(error))
                continue
            self.deliver(self.state.adopt(transfer, self.state.limits.lease_ttl_s, reason))
            adopted += 1
        self.owned.add(shard)
        self.facts.claims.append((shard, revision, time.time()))
        log.info("replica serves shard", replica_id=self.replica_id, shard=shard, revision=revision,
                 adopted_transfer_count=adopted)

    async def _release_empty(self) -> None:
        if not self.draining:
            return
        count = self.config.shard_count
        busy = {shard_of(r.transfer_id, count) for r in self.state.live_transfers()}
        for shard in sorted(self.draining - busy):
            if any(s == shard for s, _, _ in self._ops):
                continue  # its deletes are not written yet
            self.owned.discard(shard)
            self.draining.discard(shard)
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.TimeoutError):
                await self.etcd.delete_if_lease(self.shard_key(shard), self.session_lease)
            self.facts.releases.append((shard, time.time()))
            log.info("replica released shard", replica_id=self.replica_id, shard=shard)

    # ---------------------------------------------------------------- engine registrations

    def _reg_key(self, engine_id: str, tp_rank: int) -> bytes:
        return self._key("engines", "reg", engine_id, tp_rank)

    async def register_engine(self, request: dpb.RegisterEngineRequest) -> tuple[str, Effects]:
        """Store a registration under a fresh etcd lease; returns the (secret) lease id and the local effects."""
        existing = self.state.engines.existing(request, self.state.clock.monotonic())  # ALREADY_EXISTS, ...
        lease_id = uuid.uuid4().hex
        key = lease_key(lease_id)
        etcd_lease, _ = await self.etcd.grant(max(1, math.ceil(self.state.limits.lease_ttl_s)))
        register_wall = self.state.clock.wall()
        value = json.dumps({"request": base64.b64encode(request.SerializeToString()).decode(), "lease_key": key,
                            "etcd_lease": etcd_lease, "replica_id": self.replica_id,
                            "register_wall": register_wall}).encode()
        await self.etcd.put(self._reg_key(request.engine_id, request.tp_rank), value, etcd_lease)
        previous = self.engine_leases.get((request.engine_id, request.tp_rank))
        fx = self._mirror_put(request, key, etcd_lease, register_wall)
        if existing is not None and previous is not None and previous[1] != etcd_lease:
            # The key now hangs on the new lease: revoking the old one deletes nothing.
            self._spawn(self.etcd.revoke(previous[1]))
        return lease_id, fx

    async def renew_engine(self, lease_id: str, load: tpb.EngineLoad | None) -> None:
        """Keep a worker's etcd lease alive (NotFound when etcd no longer has it) and publish a changed load."""
        worker = self.state.lease_holder(lease_key(lease_id))
        entry = self.engine_leases.get((worker.engine_id, worker.tp_rank))
        if entry is None:
            raise NotFound(f"lease {lease_id!r} is unknown or expired")
        try:
            ttl = await self.etcd.keep_alive(entry[1])
        except (TimeoutError, ConnectionError, grpc.aio.AioRpcError) as error:
            raise Unavailable(f"etcd did not take the renewal: {error}") from None
        if ttl <= 0:
            raise NotFound(f"lease {lease_id!r} is unknown or expired")
        if load is not None:
            self.state.renew(lease_key(lease_id), load)
            body = load.SerializeToString()
            slot = (worker.engine_id, worker.tp_rank)
            if self._loads.get(slot) != body:
                self._loads[slot] = body
                with contextlib.suppress(grpc.aio.AioRpcError, asyncio.TimeoutError):
                    await self.etcd.put(self._key("engines", "load", worker.engine_id, worker.tp_rank), body, entry[1])

    def _revoke_engine_lease(self, worker: Worker) -> None:
        """The state revoked a worker's lease (it did not confirm a transfer's end): revoke it in etcd, so no
        replica renews it any more and the worker stops posting writes when its lease runs out."""
        entry = self.engine_leases.pop((worker.engine_id, worker.tp_rank), None)
        if entry is not None:
            self._spawn(self._revoke_quietly(entry[1]))

    def _spawn(self, work: Coroutine[object, object, object]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _revoke_quietly(self, etcd_lease: int) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.TimeoutError):
            await self.etcd.revoke(etcd_lease)

    async def deregister_engine(self, engine_id: str, tp_rank: int, lease_id: str) -> Effects:
        """Remove a registration from etcd (its lease revoked) and from this replica at once."""
        worker = self.state.engines.worker(engine_id, tp_rank)
        if worker.lease_id != lease_key(lease_id):
            raise NotFound(f"engine {engine_id!r} rank {tp_rank} holds no lease {lease_id!r}")
        entry = self.engine_leases.pop((engine_id, tp_rank), None)
        if entry is not None:
            await self.etcd.revoke(entry[1])
        return self.state.mirror_remove(engine_id, tp_rank, f"engine {engine_id} rank {tp_rank} deregistered")

    def _mirror_put(self, request: dpb.RegisterEngineRequest, key: str, etcd_lease: int,
                    register_wall: float | None) -> Effects:
        self.engine_leases[(request.engine_id, request.tp_rank)] = (key, etcd_lease)
        fx = self.state.mirror_register(request, key)
        if register_wall is not None:  # every replica shows the registration's own time, not its mirroring's
            self.state.lease_holder(key).register_wall = register_wall
        return fx

    def _apply_engine_kv(self, key: bytes, value: bytes, deleted: bool) -> None:
        parts = key[len(self._key("engines")) + 1:].decode().split("/")
        if len(parts) != 3:
            return
        kind, engine_id, rank_text = parts
        rank = int(rank_text)
        if kind == "load":
            if not deleted:
                group = self.state.engines.groups.get(engine_id)
                worker = group.workers.get(rank) if group is not None else None
                if worker is not None:
                    worker.load = tpb.EngineLoad.FromString(value)
            return
        if deleted:
            self.engine_leases.pop((engine_id, rank), None)
            self._loads.pop((engine_id, rank), None)
            self.deliver(self.state.mirror_remove(engine_id, rank,
                                                  f"engine {engine_id} rank {rank} lease expired or revoked"))
            return
        body = json.loads(value)
        request = dpb.RegisterEngineRequest.FromString(base64.b64decode(body["request"]))
        self.deliver(self._mirror_put(request, body["lease_key"], int(body["etcd_lease"]), body.get("register_wall")))

    async def _load_engines(self) -> int:
        kvs, revision = await self.etcd.get_prefix(self._key("engines") + b"/")
        present = set()
        for kv in sorted(kvs, key=lambda kv: b"/load/" in kv.key):  # registrations before loads
            self._apply_engine_kv(kv.key, kv.value, False)
            if b"/reg/" in kv.key:
                parts = kv.key.decode().rsplit("/", 2)
                present.add((parts[1], int(parts[2])))
        for slot in [s for s in self.engine_leases if s not in present]:
            self._apply_engine_kv(self._reg_key(*slot), b"", True)
        return revision

    async def _mirror_engines(self, revision: int) -> None:
        while not self._stopping:
            try:
                async for _, events in self.etcd.watch_prefix(self._key("engines") + b"/", revision + 1):
                    for event in events:
                        revision = max(revision, event.kv.mod_revision)
                        try:
                            self._apply_engine_kv(event.kv.key, event.kv.value, event.deleted)
                        except (ValueError, KeyError) as error:
                            log.warning("unreadable registration skipped", error=str(error))
            except (grpc.aio.AioRpcError, ConnectionError) as error:
                log.info("registration watch broke; re-reading", error=str(error))
                await asyncio.sleep(0.2)
                with contextlib.suppress(grpc.aio.AioRpcError, asyncio.TimeoutError):
                    revision = await self._load_engines()


class _EndObserver(TransferObserver):
    """Wraps the state's observer: an ended transfer is also deleted from etcd; every other hook is the inner's."""

    def __init__(self, inner: TransferObserver, replica: Replica) -> None:
        self._inner = inner
        self._replica = replica

    def on_early_readiness(self, outcome: str) -> None:
        """The inner observer's."""
        self._inner.on_early_readiness(outcome)

    def on_engine_skipped(self, reason: str) -> None:
        """The inner observer's."""
        self._inner.on_engine_skipped(reason)

    def on_planned(self, transfer: TransferRecord) -> None:
        """The inner observer's."""
        self._inner.on_planned(transfer)

    def on_allocated(self, transfer: TransferRecord) -> None:
        """The inner observer's."""
        self._inner.on_allocated(transfer)

    def on_first_ready(self, transfer: TransferRecord) -> None:
        """The inner observer's."""
        self._inner.on_first_ready(transfer)

    def on_dispatched(self, transfer: TransferRecord) -> None:
        """The inner observer's."""
        self._inner.on_dispatched(transfer)

    def on_ended(self, transfer: TransferRecord) -> None:
        """Delete from etcd, then the inner observer."""
        self._replica.transfer_ended(transfer)
        self._inner.on_ended(transfer)
