"""`EtcdStore`: the few etcd v3 calls the replicated directory makes, over grpc.aio.

etcd's own gRPC API (KV, Lease, Watch), with the message and stub classes generated from etcd's
`rpc.proto` that the `aetcd` package ships (`aetcd.rpc`); aetcd's high-level client is not used: it
opens a new LeaseKeepAlive stream per refresh and has no TLS, while a directory replica renews many
leases on one stream and must reach a TLS etcd. docs/directory-replicas.md says why in full.

Calls:
- `grant(ttl_s)`, `revoke(lease)`, `time_to_live(lease)`; `keep_alive(lease)` renews once over ONE
  bidi LeaseKeepAlive stream shared by every lease of the process (reopened when it breaks) and
  returns the TTL etcd granted (0: the lease is gone).
- `put`, `delete`, `get_prefix`, `create(key, value, lease)` (a Txn that succeeds only when the key
  does not exist), `txn(ops)` (several puts/deletes committed as one revision).
- `watch_prefix(prefix, start_revision)`: an async iterator of (revision, events) batches.
Every unary call has a deadline (`timeout_s`); errors surface as `grpc.aio.AioRpcError`.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from aetcd.rpc import kv_pb2, rpc_pb2, rpc_pb2_grpc


def prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with `prefix` (etcd's convention)."""
    end = bytearray(prefix)
    for index in range(len(end) - 1, -1, -1):
        if end[index] < 0xFF:
            end[index] += 1
            return bytes(end[:index + 1])
    return b"\0"


@dataclass(frozen=True)
class KeyValue:
    """One stored key: its value, lease and revisions (etcd's mvccpb.KeyValue, decoded)."""

    key: bytes
    value: bytes
    lease: int
    create_revision: int
    mod_revision: int


@dataclass(frozen=True)
class WatchEvent:
    """A PUT (value set) or DELETE (value empty) of one key."""

    deleted: bool
    kv: KeyValue


def _kv(message: kv_pb2.KeyValue) -> KeyValue:
    return KeyValue(message.key, message.value, message.lease, message.create_revision, message.mod_revision)


@dataclass(frozen=True)
class Put:
    """A put inside `txn`."""

    key: bytes
    value: bytes
    lease: int = 0


@dataclass(frozen=True)
class Delete:
    """A delete inside `txn`."""

    key: bytes


def _read(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()

class EtcdStore:
    """A connection to an etcd cluster (module docstring). Create and use it on one event loop."""

    def __init__(self, endpoints: Sequence[str], timeout_s: float = 2.0, root_cert_file: str = "",
                 client_cert_file: str = "", client_key_file: str = "") -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        self.endpoints = [e.removeprefix("http://").removeprefix("https://") for e in endpoints]
        self.timeout_s = timeout_s
        # One endpoint: gRPC's DNS resolver takes every address the name has (a headless Service of the
        # members). Several: IP literals, which gRPC's ipv4:/ipv6: resolver spreads calls over and fails over.
        if len(self.endpoints) == 1:
            target = self.endpoints[0]
        else:
            hosts = [e.rsplit(":", 1)[0].strip("[]") for e in self.endpoints]
            try:
                families = {ipaddress.ip_address(h).version for h in hosts}
            except ValueError:
                raise ValueError("several etcd endpoints must be IP addresses; give one DNS name that resolves "
                                 "to every member instead (e.g. a headless Service)") from None
            if len(families) != 1:
                raise ValueError("etcd endpoints mix IPv4 and IPv6 addresses")
            target = ("ipv4:" if families == {4} else "ipv6:") + ",".join(self.endpoints)
        options = [("grpc.lb_policy_name", "round_robin"), ("grpc.keepalive_time_ms", 5_000),
                   ("grpc.keepalive_timeout_ms", 2_000), ("grpc.keepalive_permit_without_calls", 1)]
        if root_cert_file:
            key = cert = None
            if client_cert_file:
                key, cert = _read(client_key_file), _read(client_cert_file)
            credentials = grpc.ssl_channel_credentials(_read(root_cert_file), key, cert)
            self.channel = grpc.aio.secure_channel(target, credentials, options=options)
        else:
            self.channel = grpc.aio.insecure_channel(target, options=options)
        self._kv = rpc_pb2_grpc.KVStub(self.channel)
        self._lease = rpc_pb2_grpc.LeaseStub(self.channel)
        self._watch = rpc_pb2_grpc.WatchStub(self.channel)
        # Any: grpc.aio's call objects are untyped (grpc ships no stubs).
        self._keep_alive_call: Any = None
        self._keep_alive_waiters: dict[int, list[asyncio.Future[int]]] = {}
        self._keep_alive_reader: asyncio.Task[None] | None = None
        self._keep_alive_lock = asyncio.Lock()
        self.round_trip_count = 0

    async def close(self) -> None:
        """Close the channel (ends the keep-alive stream and every watch)."""
        if self._keep_alive_reader is not None:
            self._keep_alive_reader.cancel()
        await self.channel.close()

    # ---------------------------------------------------------------- leases

    async def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease of `ttl_s` seconds; returns (lease id, granted TTL)."""
        self.round_trip_count += 1
        response = await self._lease.LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=ttl_s), timeout=self.timeout_s)
        return response.ID, response.TTL

    async def revoke(self, lease: int) -> None:
        """Revoke a lease: every key attached to it is deleted. A lease already gone is not an error."""
        self.round_trip_count += 1
        try:
            await self._lease.LeaseRevoke(rpc_pb2.LeaseRevokeRequest(ID=lease), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND:
                raise

    async def time_to_live(self, lease: int) -> int:
        """The lease's remaining TTL in seconds (-1: it does not exist)."""
        self.round_trip_count += 1
        response = await self._lease.LeaseTimeToLive(rpc_pb2.LeaseTimeToLiveRequest(ID=lease),
                                                     timeout=self.timeout_s)
        return int(response.TTL)

    async def keep_alive(self, lease: int) -> int:
        """Renew a lease once; returns the TTL etcd gave it (0 when the lease no longer exists)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()
        async with self._keep_alive_lock:
            call = self._keep_alive_call
            if call is None or call.done():
                call = self._open_keep_alive()
            self._keep_alive_waiters.setdefault(lease, []).append(future)
            self.round_trip_count += 1
            try:
                await asyncio.wait_for(call.write(rpc_pb2.LeaseKeepAliveRequest(ID=lease)),
                                       self.timeout_s)
            except (TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError):
                self._reset_keep_alive()
                raise ConnectionError("etcd keep-alive stream broke") from None
        return await asyncio.wait_for(future, self.timeout_s)

    def _open_keep_alive(self) -> Any:  # Any: the untyped grpc.aio call (see __init__)
        self._keep_alive_call = self._lease.LeaseKeepAlive()
        call = self._keep_alive_call

        async def read() -> None:
            try:
                while True:
                    response = await call.read()
                    if response is grpc.aio.EOF:
                        break
                    waiters = self._keep_alive_waiters.get(response.ID)
                    if waiters:
                        waiter = waiters.pop(0)
                        if not waiters:
                            del self._keep_alive_waiters[response.ID]
                        if not waiter.done():
                            waiter.set_result(response.TTL)
            except (grpc.aio.AioRpcError, asyncio.CancelledError):
                pass
            finally:
                if self._keep_alive_call is call:
                    self._reset_keep_alive()

        self._keep_alive_reader = asyncio.ensure_future(read())
        return call

    def _reset_keep_alive(self) -> None:
        call, self._keep_alive_call = self._keep_alive_call, None
        if call is not None:
            call.cancel()
        waiters, self._keep_alive_waiters = self._keep_alive_waiters, {}
        for futures in waiters.values():
            for future in futures:
                if not future.done():
                    future.set_exception(ConnectionError("etcd keep-alive stream broke"))

    # ---------------------------------------------------------------- keys

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Set a key (attached to `lease` when given); returns the new revision."""
        self.round_trip_count += 1
        response = await self._kv.Put(rpc_pb2.PutRequest(key=key, value=value, lease=lease), timeout=self.timeout_s)
        return int(response.header.revision)

    async def delete(self, key: bytes) -> int:
        """Delete a key; returns how many were deleted (0 or 1)."""
        self.round_trip_count += 1
        response = await self._kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=key), timeout=self.timeout_s)
        return int(response.deleted)

    async def get(self, key: bytes) -> KeyValue | None:
        """One key, or None."""
        self.round_trip_count += 1
        response = await self._kv.Range(rpc_pb2.RangeRequest(key=key), timeout=self.timeout_s)
        return _kv(response.kvs[0]) if response.kvs else None

    async def get_prefix(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        """Every key under `prefix` (key order) and the revision they were read at."""
        self.round_trip_count += 1
        response = await self._kv.Range(rpc_pb2.RangeRequest(key=prefix, range_end=prefix_end(prefix)),
                                        timeout=self.timeout_s)
        return [_kv(kv) for kv in response.kvs], response.header.revision

    async def create(self, key: bytes, value: bytes, lease: int = 0) -> tuple[bool, int]:
        """Set `key` only if it does not exist; returns (created, revision)."""
        self.round_trip_count += 1
        response = await self._kv.Txn(rpc_pb2.TxnRequest(
            compare=[rpc_pb2.Compare(key=key, target=rpc_pb2.Compare.CREATE, result=rpc_pb2.Compare.EQUAL,
                                     create_revision=0)],
            success=[rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=key, value=value, lease=lease))]),
            timeout=self.timeout_s)
        return response.succeeded, response.header.revision

    async def delete_if_lease(self, key: bytes, lease: int) -> bool:
        """Delete `key` only while it is attached to `lease` (still ours); True when deleted."""
        self.round_trip_count += 1
        response = await self._kv.Txn(rpc_pb2.TxnRequest(
            compare=[rpc_pb2.Compare(key=key, target=rpc_pb2.Compare.LEASE, result=rpc_pb2.Compare.EQUAL,
                                     lease=lease)],
            success=[rpc_pb2.RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(key=key))]),
            timeout=self.timeout_s)
        return bool(response.succeeded)

    async def txn(self, ops: Sequence[Put | Delete], guards: Sequence[tuple[bytes, int]] = ()) -> bool:
        """Commit puts and deletes as one revision, only while every guard key is attached to its lease.

        Returns False when a guard failed (nothing was written).
        """
        self.round_trip_count += 1
        request_ops = [rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=op.key, value=op.value, lease=op.lease))
                       if isinstance(op, Put) else
                       rpc_pb2.RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(key=op.key))
                       for op in ops]
        compare = [rpc_pb2.Compare(key=key, target=rpc_pb2.Compare.LEASE, result=rpc_pb2.Compare.EQUAL, lease=lease)
                   for key, lease in guards]
        response = await self._kv.Txn(rpc_pb2.TxnRequest(compare=compare, success=request_ops),
                                      timeout=self.timeout_s)
        return bool(response.succeeded)

    async def watch_prefix(self, prefix: bytes, start_revision: int) -> AsyncIterator[tuple[int, list[WatchEvent]]]:
        """Batches of events under `prefix` from `start_revision` on; ends (raises) when the stream breaks."""
        queue: asyncio.Queue[rpc_pb2.WatchRequest] = asyncio.Queue()
        await queue.put(rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(
            key=prefix, range_end=prefix_end(prefix), start_revision=start_revision)))

        async def requests() -> AsyncIterator[rpc_pb2.WatchRequest]:
            while True:
                yield await queue.get()

        call = self._watch.Watch(requests())
        try:
            async for response in call:
                if response.canceled:
                    raise ConnectionError(f"etcd cancelled the watch: {response.cancel_reason or 'compacted'}")
                if response.events:
                    yield response.header.revision, [
                        WatchEvent(event.type == kv_pb2.Event.DELETE, _kv(event.kv)) for event in response.events]
        finally:
            call.cancel()
