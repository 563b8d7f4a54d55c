"""`DirectoryClient`: typed async calls to the KV-directory with deadlines and retries.

Every unary call has a deadline (`ChannelConfig.timeout_s` per attempt) and is retried with
exponential backoff and full jitter on UNAVAILABLE only, at most `max_attempts` times; any other
status raises `DirectoryCallError` at once. Streams live in their own helpers, built from here:
`EngineRegistration` (lease keep-alive), `PrefillSession` (StreamPrefill), `watch_transfers`.

Replicas (docs/directory-replicas.md): `ChannelConfig.address` may list several replicas
("a:50051,b:50051"). Calls that name a transfer (ReportAllocation, CancelTransfer, GetTransfer) go to
the replica serving its shard: a replica that does not serve it answers FAILED_PRECONDITION with a
google.rpc.ErrorInfo naming the owner, and the client follows it at once (remembering the shard's
owner); UNAVAILABLE (a replica down, a shard between owners) moves the call to the next replica after a
backoff. Other calls and the streams go to the current home replica, which moves on the same way.

Create the client on the event loop that will use it (grpc.aio channels are bound to a loop);
from threads use `SyncDirectoryClient`, which owns a private loop thread.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import re
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

import grpc
from google.protobuf import duration_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpush.api.shards import SHARD_NOT_OWNED, ShardRedirect, shard_of, shard_redirect
from kvpush.client.config import ChannelConfig
from kvpush.client.errors import DirectoryCallError
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import directory_pb2_grpc as dgrpc
from kvpush.v1 import types_pb2 as tpb

# The client a plan serves (PlanTransferRequest.client_id) when `plan_transfer` is not given one: a gateway sets it
# once per incoming request, in the request's task, so every plan made for that request names its client.
PLAN_CLIENT_ID: contextvars.ContextVar[str] = contextvars.ContextVar("kvpush_plan_client_id", default="")
_NOT_ID = re.compile("[^A-Za-z0-9._:@+=~-]")


class _Answer(Protocol):
    """A directory response: it names the process that answered (ResponseHeader, and the deprecated field)."""

    @property
    def header(self) -> dpb.ResponseHeader: ...

    @property
    def directory_incarnation_id(self) -> str: ...


def incarnation_of(response: _Answer) -> str:
    """The incarnation of the directory process that answered: the response header's, else (a directory that
    predates the header) the response's deprecated `directory_incarnation_id`; "" when neither is set."""
    return response.header.directory_incarnation_id or response.directory_incarnation_id


def client_id_of(api_key: str = "", peer: str = "") -> str:
    """A stable, non-secret client id for PlanTransferRequest.client_id: "key-" and 16 hex digits of the API key's
    SHA-256 when a key is given (the key itself never leaves), else "addr-" and the peer's address ("" for neither)."""
    if api_key:
        return "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:16]
    if peer:
        return "addr-" + _NOT_ID.sub("_", peer)[:120]
    return ""


class DirectoryClient:
    """Async client of KVDirectoryService over one channel."""

    def __init__(self, config: ChannelConfig | None = None) -> None:
        self.config = config or ChannelConfig.from_env()
        # Every replica address known (the configured ones first, then those replicas named), in order.
        self.addresses: list[str] = list(self.config.addresses)
        self._channels: dict[str, tuple[grpc.aio.Channel, dgrpc.KVDirectoryServiceStub]] = {}
        self.home = self.addresses[0]
        # shard -> the replica address serving it, learnt from redirects (replicas only)
        self.shard_owners: dict[int, str] = {}
        self.shard_count = 0
        self.redirect_count = 0

    def _connection(self, address: str) -> tuple[grpc.aio.Channel, dgrpc.KVDirectoryServiceStub]:
        connection = self._channels.get(address)
        if connection is None:
            channel = self.config.create_channel(address)
            connection = self._channels[address] = (channel, dgrpc.KVDirectoryServiceStub(channel))
        return connection

    def stub_for(self, address: str) -> dgrpc.KVDirectoryServiceStub:
        """The stub on one replica's channel (opened on first use)."""
        return self._connection(address)[1]

    def owner_address(self, transfer_id: str) -> str | None:
        """The replica known to serve the transfer's shard; None when unknown (replicas only)."""
        if not self.shard_count:
            return None
        return self.shard_owners.get(shard_of(transfer_id, self.shard_count))

    @property
    def channel(self) -> grpc.aio.Channel:
        """The channel to the home replica (the only one without replicas)."""
        return self._connection(self.home)[0]

    @property
    def stub(self) -> dgrpc.KVDirectoryServiceStub:
        """The stub on the home replica; streams are opened on it."""
        return self._connection(self.home)[1]

    def move_home(self, away_from: str | None = None) -> str:
        """Make the next known replica the home one (after `away_from` failed); returns the new home."""
        if len(self.addresses) > 1 and (away_from is None or away_from == self.home):
            self.home = self.addresses[(self.addresses.index(self.home) + 1) % len(self.addresses)]
        return self.home

    def learn(self, redirect: ShardRedirect) -> None:
        """Remember who serves a shard (a replica's redirect), and that replica's address."""
        self.shard_count = redirect.shard_count or self.shard_count
        if redirect.owner_address:
            self.shard_owners[redirect.shard] = redirect.owner_address
            if redirect.owner_address not in self.addresses:
                self.addresses.append(redirect.owner_address)
        else:
            self.shard_owners.pop(redirect.shard, None)

    def address_for(self, transfer_id: str) -> str:
        """The replica a call about `transfer_id` goes to first (the home one until a redirect taught better)."""
        if transfer_id and self.shard_count:
            return self.shard_owners.get(shard_of(transfer_id, self.shard_count), self.home)
        return self.home

    async def close(self) -> None:
        """Close every channel (ends every stream opened on them)."""
        for channel, _ in self._channels.values():
            await channel.close()
        self._channels.clear()

    async def __aenter__(self) -> DirectoryClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def _unary(self, method: str, request, timeout_s: float | None = None, transfer_id: str = ""):
        """Call one unary RPC with a deadline: follow shard redirects, retry UNAVAILABLE elsewhere with backoff."""
        timeout = timeout_s or self.config.timeout_s
        attempt = 0
        redirects = 0
        # A replica that knows no owner of the shard yet (it moved a moment ago): ask the others too.
        ask_next: str | None = None
        while True:
            address = ask_next or self.address_for(transfer_id)
            ask_next = None
            call = getattr(self._connection(address)[1], method)
            try:
                return await call(request, timeout=timeout, metadata=self.config.metadata)
            except grpc.aio.AioRpcError as error:
                redirect = shard_redirect(error)
                if redirect is not None:
                    self.learn(redirect)
                if (error.code() == grpc.StatusCode.FAILED_PRECONDITION and redirect is not None
                        and redirect.reason == SHARD_NOT_OWNED and redirect.owner_address != address
                        and redirects < len(self.addresses) + 1):
                    redirects += 1  # the owner is named: go there at once
                    self.redirect_count += 1
                    continue
                attempt += 1
                if error.code() != grpc.StatusCode.UNAVAILABLE or attempt == self.config.max_attempts:
                    raise DirectoryCallError.from_rpc_error(method, error) from None
                if redirect is None:  # the replica itself is down or stopping: try the next one
                    self.move_home(address)
                    self.shard_owners = {s: a for s, a in self.shard_owners.items() if a != address}
                elif len(self.addresses) > 1:
                    ask_next = self.addresses[(self.addresses.index(address) + 1) % len(self.addresses)] \
                        if address in self.addresses else None
                await asyncio.sleep(self.config.backoff_s(attempt - 1))

    # ---------------------------------------------------------------- engines

    async def register_engine(self, request: dpb.RegisterEngineRequest,
                              timeout_s: float | None = None) -> dpb.RegisterEngineResponse:
        """Register one worker; returns its lease id and TTL."""
        return await self._unary("RegisterEngine", request, timeout_s)

    async def deregister_engine(self, engine_id: str, tp_rank: int, lease_id: str,
                                timeout_s: float | None = None) -> None:
        """Remove one worker registration."""
        await self._unary("DeregisterEngine", dpb.DeregisterEngineRequest(
            engine_id=engine_id, tp_rank=tp_rank, lease_id=lease_id), timeout_s)

    async def get_engine(self, engine_id: str, timeout_s: float | None = None) -> list[tpb.EngineWorker]:
        """One engine's workers in rank order."""
        response = await self._unary("GetEngine", dpb.GetEngineRequest(engine_id=engine_id), timeout_s)
        return list(response.workers)

    async def list_engines(self, role: tpb.EngineRole = tpb.ENGINE_ROLE_UNSPECIFIED, page_size: int = 0,
                           timeout_s: float | None = None) -> list[tpb.EngineWorker]:
        """Every registered worker (all pages), ordered by engine id then rank."""
        workers: list[tpb.EngineWorker] = []
        token = ""
        while True:
            response = await self._unary("ListEngines", dpb.ListEnginesRequest(
                page_size=page_size, page_token=token, role=role), timeout_s)
            workers.extend(response.workers)
            token = response.next_page_token
            if not token:
                return workers

    # ---------------------------------------------------------------- transfers

    async def plan_transfer(self, request_id: str = "", prompt_token_count: int = 0, prefill_engine_id: str = "",
                            decode_engine_id: str = "", traceparent: str = "", ttl_s: float | None = None,
                            timeout_s: float | None = None, model: str = "",
                            transfer_id: str = "", client_id: str | None = None, *,
                            trace_context: str = "") -> dpb.PlanTransferResponse:
        """Pick engines (serving `model` when given) and mint a transfer (state PLANNED). `transfer_id`: the
        caller's id for it (the prefill leg may already be on its way; `prefill_engine_id` is then required),
        sent to the replica that owns its shard. `client_id`: the client the transfer serves (the directory bounds
        each client's share of an engine; `client_id_of`); None: `PLAN_CLIENT_ID` of the calling context.
        `traceparent`: the caller's W3C trace context (`trace_context` is its older name, still accepted)."""
        request = dpb.PlanTransferRequest(
            request_id=request_id, prompt_token_count=prompt_token_count, prefill_engine_id=prefill_engine_id,
            decode_engine_id=decode_engine_id, trace_context=traceparent or trace_context, model=model,
            transfer_id=transfer_id,
            client_id=PLAN_CLIENT_ID.get() if client_id is None else client_id)
        if ttl_s is not None:
            request.ttl.CopyFrom(_duration(ttl_s))
        return await self._unary("PlanTransfer", request, timeout_s, transfer_id=transfer_id)

    async def report_allocation(self, transfer_id: str, engine_id: str, block_ids: Sequence[int],
                                prompt_token_count: int, skip_token_count: int = 0,
                                timeout_s: float | None = None,
                                block_groups: Sequence[tuple[Sequence[int], int]] = ()) -> tpb.Transfer:
        """Report decode's blocks for a transfer (`skip_token_count`: leading tokens decode already holds, not
        pushed); returns the transfer after the report. block_groups: with several KV-cache groups, each group's
        (block ids, first token) by group index (block_ids then repeats group 0's)."""
        response = await self._unary("ReportAllocation", dpb.ReportAllocationRequest(
            transfer_id=transfer_id, engine_id=engine_id, block_ids=block_ids,
            prompt_token_count=prompt_token_count, prefix_hit_token_count=skip_token_count,
            block_groups=[tpb.BlockGroup(group_index=index, block_ids=ids, first_token=first_token)
                          for index, (ids, first_token) in enumerate(block_groups)]), timeout_s,
            transfer_id=transfer_id)
        return response.transfer

    async def cancel_transfer(self, transfer_id: str, reason: str = "",
                              timeout_s: float | None = None) -> tpb.Transfer:
        """Cancel a transfer; returns it (CANCELLED, or still live with the cancellation pending)."""
        response = await self._unary("CancelTransfer", dpb.CancelTransferRequest(
            transfer_id=transfer_id, reason=reason), timeout_s, transfer_id=transfer_id)
        return response.transfer

    async def report_engine_unreachable(self, engine_id: str, transfer_id: str = "", reason: str = "",
                                        timeout_s: float | None = None) -> bool:
        """Tell the directory an engine's endpoint could not be reached (planning leaves it out until its next
        renewal); True when it is now marked, False when the report concerned an earlier registration."""
        response = await self._unary("ReportEngineUnreachable", dpb.ReportEngineUnreachableRequest(
            engine_id=engine_id, transfer_id=transfer_id, reason=reason), timeout_s, transfer_id=transfer_id)
        return response.marked

    async def get_transfer(self, transfer_id: str, timeout_s: float | None = None) -> tpb.Transfer:
        """One transfer."""
        response = await self._unary("GetTransfer", dpb.GetTransferRequest(transfer_id=transfer_id), timeout_s,
                                     transfer_id=transfer_id)
        return response.transfer

    async def list_transfers(self, state: tpb.TransferState = tpb.TRANSFER_STATE_UNSPECIFIED, engine_id: str = "",
                             limit: int = 100, timeout_s: float | None = None) -> list[tpb.Transfer]:
        """Up to `limit` transfers, newest first, following pages as needed (replicas: every replica's, merged)."""
        from kvpush.client.replicas import replica_addresses

        replicas = await replica_addresses(self)  # [] for one directory process
        if len(replicas) > 1:
            merged: list[tpb.Transfer] = []
            for address in replicas:
                merged.extend(await self._list_transfers_at(address, state, engine_id, limit, timeout_s))
            merged.sort(key=lambda t: t.create_time.ToNanoseconds(), reverse=True)
            return merged[:limit]
        return await self._list_transfers_at(None, state, engine_id, limit, timeout_s)

    async def _list_transfers_at(self, address: str | None, state: tpb.TransferState, engine_id: str, limit: int,
                                 timeout_s: float | None) -> list[tpb.Transfer]:
        transfers: list[tpb.Transfer] = []
        token = ""
        while len(transfers) < limit:
            request = dpb.ListTransfersRequest(page_size=min(1000, limit - len(transfers)), page_token=token,
                                               state=state, engine_id=engine_id)
            if address is None:
                response = await self._unary("ListTransfers", request, timeout_s)
            else:  # one replica's own transfers: no redirect or failover applies
                try:
                    response = await self.stub_for(address).ListTransfers(
                        request, timeout=timeout_s or self.config.timeout_s, metadata=self.config.metadata)
                except grpc.aio.AioRpcError as error:
                    if error.code() == grpc.StatusCode.UNAVAILABLE:
                        return transfers  # a replica down: list the others'
                    raise DirectoryCallError.from_rpc_error("ListTransfers", error) from None
            transfers.extend(response.transfers)
            token = response.next_page_token
            if not token:
                break
        return transfers

    async def get_replicas(self, timeout_s: float | None = None) -> dpb.GetReplicasResponse:
        """The replica set and shard map; also learnt (every shard's owner) for routing."""
        response = await self._unary("GetReplicas", dpb.GetReplicasRequest(), timeout_s)
        by_id = {r.replica_id: r.address for r in response.replicas}
        for address in by_id.values():
            if address and address not in self.addresses:
                self.addresses.append(address)
        if response.replica_id:
            self.shard_count = response.shard_count
            self.shard_owners = {shard: by_id[owner] for shard, owner in enumerate(response.shard_owner_replica_ids)
                                 if owner and by_id.get(owner)}
        return response

    async def health(self, service: str = "", timeout_s: float | None = None) -> str:
        """The server's health status name for a service ("" = the whole server), e.g. "SERVING"."""
        try:
            response = await health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s or self.config.timeout_s,
                metadata=self.config.metadata)
        except grpc.aio.AioRpcError as error:
            raise DirectoryCallError.from_rpc_error("Health.Check", error) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    # ---------------------------------------------------------------- streams

    def watch_transfers(self, engine_id: str, after_sequence_number: int = 0,
                        on_gap: Callable[[int], None] | None = None) -> AsyncIterator[dpb.TransferEvent]:
        """Terminal events of a decode engine's transfers; reconnects and resumes (see `watch`)."""
        from kvpush.client.watch import watch_transfers

        return watch_transfers(self, engine_id, after_sequence_number, on_gap)


def _duration(seconds: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromNanoseconds(int(seconds * 1e9))
    return duration
