"""Engines played through the real client library against directory replicas (no vLLM needed).

`Engines` registers one prefill and one decode engine through a client that knows every replica (its
registrations renew on one replica, and move to another when that one dies), opens the prefill's
StreamPrefill and the decode's WatchTransfers on EVERY replica through the library's replicated streams
(`ReplicatedPrefillSession`, `watch_transfers`: each replica dispatches and reports only the transfers of
its shards), and acts as the connector does: a Cancellation is answered CANCELLED.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import grpc

from kvpush.api.shards import shard_of
from kvpush.client import (
    ChannelConfig,
    DirectoryCallError,
    DirectoryClient,
    EngineRegistration,
    ReplicatedPrefillSession,
    watch_transfers,
)
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import DECODE, PREFILL, make_layout, register_request

LAYERS = 4


class Engines:
    """One prefill (p1) and one decode (d1) engine against a replica set."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses
        self.routed = DirectoryClient(ChannelConfig(address=",".join(addresses), timeout_s=2.0, max_attempts=8))
        self.instructions: dict[str, dpb.PushInstruction] = {}
        self.cancellations: dict[str, list[float]] = defaultdict(list)
        self.events: dict[str, list[tuple[float, dpb.TransferEvent]]] = defaultdict(list)
        # (when, concerns) of every session reset the replicated session reported (concerns None: all)
        self.resets: list[tuple[float, object]] = []
        self._clients: list[DirectoryClient] = []
        self._tasks: list[asyncio.Task] = []
        self.live_addresses = set(addresses)

    async def start(self) -> None:
        layout = make_layout(layer_count=LAYERS, block_count=4096)
        self.prefill = EngineRegistration(self.routed, register_request("p1", PREFILL, layout=layout))
        self.decode = EngineRegistration(self.routed, register_request("d1", DECODE, layout=layout))
        await self.prefill.start()
        await self.decode.start()
        await asyncio.sleep(0.5)  # every replica mirrors the registrations from etcd
        for address in self.addresses:  # planning clients, one per replica (each mints in its own shards)
            self._clients.append(DirectoryClient(ChannelConfig(address=address, timeout_s=2.0, max_attempts=2)))
        # The client library's replicated streams: a session and a watch per replica, routed by shard.
        self.session = ReplicatedPrefillSession(self.routed, self.prefill, on_instruction=self._instructed,
                                                on_cancellation=self._cancelled,
                                                on_reconnect=lambda: self.resets.append((time.monotonic(), None)),
                                                on_replica_reset=lambda concerns: self.resets.append(
                                                    (time.monotonic(), concerns)))
        await self.session.start()
        self._tasks.append(asyncio.create_task(self._watch()))

    async def _watch(self) -> None:
        async for event in watch_transfers(self.routed, "d1", on_gap=lambda _last: None):
            self.events[event.transfer_id].append((time.monotonic(), event))

    def _instructed(self, instruction: dpb.PushInstruction) -> None:
        self.instructions[instruction.transfer_id] = instruction

    def _cancelled(self, cancellation: dpb.Cancellation) -> None:
        # As the connector: stop writing, confirm no write is in flight.
        self.cancellations[cancellation.transfer_id].append(time.monotonic())
        self.session.send_result(dpb.WriteResult(
            transfer_id=cancellation.transfer_id, status=dpb.WRITE_RESULT_STATUS_CANCELLED))

    async def owners(self) -> tuple[int, dict[int, str]]:
        """shard count and shard -> owner address, from a replica."""
        response = await self.routed.get_replicas()
        by_id = {r.replica_id: r.address for r in response.replicas}
        return response.shard_count, {s: by_id.get(o, "") for s, o in enumerate(response.shard_owner_replica_ids)}

    async def owner_of(self, transfer_id: str) -> str:
        count, owners = await self.owners()
        return owners[shard_of(transfer_id, count)]

    _plans = 0

    async def begin(self, prompt_tokens: int = 32) -> str:
        """Plan (on the replicas in turn: each mints ids of its own shards), allocate (routed) and announce
        every layer of one transfer; returns its id."""
        plan = None
        for _ in range(20):  # a stopping replica mints nothing (UNAVAILABLE): plan on the next one
            live = [c for c in self._clients if c.home in self.live_addresses]
            Engines._plans += 1
            try:
                plan = await live[Engines._plans % len(live)].plan_transfer(prompt_token_count=prompt_tokens,
                                                                            ttl_s=30)
                break
            except DirectoryCallError as error:
                if error.code != grpc.StatusCode.UNAVAILABLE:
                    raise
                await asyncio.sleep(0.05)
        assert plan is not None, "no replica planned"
        transfer_id = plan.transfer.transfer_id
        blocks = self._blocks(transfer_id, prompt_tokens)
        await self.routed.report_allocation(transfer_id, "d1", blocks, prompt_tokens)
        self.session.send_ready([dpb.LayerReady(
            transfer_id=transfer_id, layer_start=0, layer_end=LAYERS, token_start=0, token_end=prompt_tokens,
            source_block_ids=list(range(prompt_tokens // 16)), prompt_token_count=prompt_tokens)])
        return transfer_id

    _next_block = 0

    def _blocks(self, transfer_id: str, prompt_tokens: int) -> list[int]:
        count = prompt_tokens // 16
        start = Engines._next_block
        Engines._next_block += count
        return list(range(start % 4000, start % 4000 + count))

    async def finish(self, transfer_id: str) -> None:
        """Prefill reports every layer written (the session routes it to the transfer's owner)."""
        self.session.send_result(dpb.WriteResult(
            transfer_id=transfer_id, status=dpb.WRITE_RESULT_STATUS_DONE, layers_written_count=LAYERS,
            bytes_written=1024))

    def terminal(self, transfer_id: str) -> dpb.TransferEvent | None:
        events = self.events.get(transfer_id)
        return events[0][1] if events else None

    async def wait_terminal(self, transfer_ids, timeout_s: float) -> dict[str, dpb.TransferEvent]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(self.terminal(t) is not None for t in transfer_ids):
                break
            await asyncio.sleep(0.05)
        return {t: self.terminal(t) for t in transfer_ids if self.terminal(t) is not None}

    async def wait_instructed(self, transfer_ids, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not all(t in self.instructions for t in transfer_ids):
            await asyncio.sleep(0.02)
        missing = [t for t in transfer_ids if t not in self.instructions]
        assert not missing, f"no instruction for {missing}"

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.session.stop(1)
        for registration in (self.prefill, self.decode):
            await registration.stop(deregister=False)
        for client in self._clients:
            await client.close()
        await self.routed.close()


async def wait_all_owned(client: DirectoryClient, replica_count: int, timeout_s: float = 20.0) -> None:
    """Until a replica reports `replica_count` replicas and an owner for every shard, balanced."""
    deadline = time.monotonic() + timeout_s
    response = None
    while time.monotonic() < deadline:
        try:
            response = await client.get_replicas()
            owners = list(response.shard_owner_replica_ids)
            if len(response.replicas) == replica_count and all(owners) and \
                    len(set(owners)) == replica_count:
                return
        except Exception:  # a replica still starting
            pass
        await asyncio.sleep(0.2)
    raise AssertionError(f"replicas never took every shard: {response}")


TERMINAL = {tpb.TRANSFER_STATE_COMPLETE, tpb.TRANSFER_STATE_FAILED, tpb.TRANSFER_STATE_CANCELLED,
            tpb.TRANSFER_STATE_EXPIRED}
