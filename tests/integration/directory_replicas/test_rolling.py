"""A rolling restart of all three replicas under load loses nothing.

Each replica in turn gets SIGTERM (it stops minting, its shards' transfers finish, it releases them,
revokes its session) and starts again on the same address; meanwhile transfers are planned, allocated,
announced and finished without pause. Every one of them must COMPLETE, and the engines' registrations
must never be lost (their etcd leases move from replica to replica with the renewals).
"""

from __future__ import annotations

import asyncio

from kvpush.v1 import types_pb2 as tpb
from tests.integration.directory.helpers import run
from tests.integration.directory_replicas.conftest import start_replica
from tests.integration.directory_replicas.harness import Engines, wait_all_owned

IN_FLIGHT = 4


def test_rolling_restart_under_load_loses_nothing(etcd, replica_set, tmp_path):
    run(_rolling(etcd, replica_set, tmp_path), timeout_s=150)


async def _rolling(etcd, replica_set, tmp_path) -> None:
    engines = Engines([r.address for r in replica_set])
    begun: list[str] = []
    stop = asyncio.Event()

    async def load() -> None:
        while not stop.is_set():
            transfer_id = await engines.begin()
            begun.append(transfer_id)
            await engines.wait_instructed([transfer_id], 15)
            await engines.finish(transfer_id)

    try:
        await wait_all_owned(engines.routed, 3)
        await engines.start()
        workers = [asyncio.create_task(load()) for _ in range(IN_FLIGHT)]
        await asyncio.sleep(1.0)
        for index, replica in enumerate(list(replica_set)):
            engines.live_addresses.discard(replica.address)
            await asyncio.to_thread(replica.stop)
            assert replica.process.returncode == 0, f"{replica.replica_id} did not stop cleanly"
            replica_set[index] = await asyncio.to_thread(
                start_replica, etcd.endpoint, replica.replica_id, tmp_path, replica.port)
            engines.live_addresses.add(replica.address)
            await wait_all_owned(engines.routed, 3, timeout_s=30)
            await asyncio.sleep(0.5)
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*workers), 30)
        ended = await engines.wait_terminal(begun, 20)
        states = {t: tpb.TransferState.Name(e.state) for t, e in ended.items()}
        not_complete = {t: (s, ended[t].reason) for t, s in states.items() if s != "TRANSFER_STATE_COMPLETE"}
        assert len(begun) >= 20, f"too little load: {len(begun)} transfers"
        assert len(ended) == len(begun), f"{len(begun) - len(ended)} transfers never ended"
        assert not not_complete, not_complete
        assert engines.prefill.registration_count == 1 and engines.decode.registration_count == 1
        # A stopping replica's stream may close while the worker still counts a just-finished transfer as
        # carried: a reset may be reported then, but (above) it cost no transfer.
    finally:
        stop.set()
        await engines.close()
