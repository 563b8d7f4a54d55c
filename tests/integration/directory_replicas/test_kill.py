"""Three directory replicas on a real etcd; one is SIGKILLed while transfers are in flight.

What must hold: transfers of the killed replica's shards end (FAILED, told to decode by the new owner,
only after prefill confirmed no write is in flight) within session TTL + lease TTL + slack; the others
complete; the engines' registrations survive (their etcd leases are taken over by another replica) and
new transfers go through; nothing is left in etcd.
"""

from __future__ import annotations

import asyncio
import time

from kvpush.directory.etcd_store import EtcdStore
from kvpush.v1 import types_pb2 as tpb
from tests.integration.directory_replicas.conftest import LEASE_TTL_S, SESSION_TTL_S
from tests.integration.directory_replicas.harness import Engines, wait_all_owned


def test_sigkill_one_replica_mid_transfer(etcd, replica_set):
    asyncio.run(_sigkill_one_replica_mid_transfer(etcd, replica_set))


async def _sigkill_one_replica_mid_transfer(etcd, replica_set):
    engines = Engines([r.address for r in replica_set])
    try:
        await wait_all_owned(engines.routed, 3)
        await engines.start()
        transfer_ids = [await engines.begin() for _ in range(12)]
        await engines.wait_instructed(transfer_ids, 10)
        owner = {t: await engines.owner_of(t) for t in transfer_ids}
        victim = replica_set[0]  # also the home replica of both registrations
        affected = [t for t in transfer_ids if owner[t] == victim.address]
        unaffected = [t for t in transfer_ids if owner[t] != victim.address]
        assert affected and unaffected, owner

        victim.kill()
        engines.live_addresses.discard(victim.address)
        killed_at = time.monotonic()
        for transfer_id in unaffected:
            await engines.finish(transfer_id)
        bound_s = SESSION_TTL_S + LEASE_TTL_S + 3.0
        ended = await engines.wait_terminal(transfer_ids, bound_s + 2)

        for transfer_id in unaffected:
            assert ended[transfer_id].state == tpb.TRANSFER_STATE_COMPLETE, ended.get(transfer_id)
        for transfer_id in affected:
            event = ended.get(transfer_id)
            assert event is not None, f"affected transfer {transfer_id} never ended"
            assert event.state == tpb.TRANSFER_STATE_FAILED, event
            assert "moved to replica" in event.reason
            when, _ = engines.events[transfer_id][0]
            assert when - killed_at < bound_s, f"{transfer_id} ended {when - killed_at:.1f}s after the kill"
            # The block-lifetime rule: decode heard FAILED only after prefill was told to stop (and confirmed).
            assert engines.cancellations[transfer_id], f"prefill never told to stop {transfer_id}"
            assert engines.cancellations[transfer_id][0] < when

        # The prefill worker heard of the victim's transfers only: the others were never stopped by a reset.
        assert len(engines.resets) == 1, engines.resets
        _, concerns = engines.resets[0]
        assert concerns is not None
        assert all(concerns(t) for t in affected) and not any(concerns(t) for t in unaffected)

        # Engines keep working: leases outlive two TTLs on the surviving replicas, and transfers complete.
        await asyncio.sleep(2 * LEASE_TTL_S)
        assert len(await engines.routed.get_engine("p1")) == 1
        assert engines.prefill.registration_count == 1, "the lease was taken over, not re-registered"
        fresh = [await engines.begin() for _ in range(4)]
        await engines.wait_instructed(fresh, 10)
        for transfer_id in fresh:
            await engines.finish(transfer_id)
        done = await engines.wait_terminal(fresh, 10)
        assert [done[t].state for t in fresh] == [tpb.TRANSFER_STATE_COMPLETE] * 4

        store = EtcdStore([etcd.endpoint])
        try:
            left, _ = await store.get_prefix(b"/kvpush/transfers/")
            assert left == [], f"transfers left in etcd: {[kv.key for kv in left]}"
        finally:
            await store.close()
    finally:
        await engines.close()
