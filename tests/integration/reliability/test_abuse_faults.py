"""The soak's abuse and freeze faults on the folder's shared stack (conftest.py), in one short run.

Runs before test_soak_and_failover.py (file order): it leaves every engine up.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.engines


def test_freeze_oversized_and_invalid_flood_end_every_request_and_leak_nothing(soak, soak_stack):
    """A decode engine frozen past the gateway's first-byte bound, a flood of 20-60 MiB messages to the directory
    under a decode engine's identity and a flood of invalid requests from another client: every fault ran once, no
    request hung, none was corrupt, nothing leaked; a streamed leg on the frozen engine was failed over once past
    the gateway's first-byte bound, and later requests were planned on the other engine; the transport refused
    every oversized message and the directory stayed SERVING; every invalid request got a 4xx and none left a
    transfer PLANNED; every request sent after the thaw completed within the failover bound. (A non-streamed request
    planned on the frozen engine may wait: its legs have no first-byte bound, docs/reliability.md.)"""
    result = soak.run_soak(soak_stack, count=150, rate=4.0, concurrency=4, seed=11,
                           faults=["decode-freeze", "oversized", "invalid-flood"], fault_interval_s=3.0,
                           abort_share=0.0, request_bound_s=120.0, sample_s=1.0, freeze_s=16.0, flood_s=3.0)
    events = {e["fault"]: e for e in result["faults_injected"]}
    assert set(events) == {"decode-freeze", "oversized", "invalid-flood"}, result["faults_injected"]
    assert result["hung"] == 0, result["outcomes"]
    assert result["corrupt"] == 0
    assert result["leaked"] == 0, result["leaks"]
    assert result["outcomes"]["completed"] > 0

    freeze = events["decode-freeze"]
    assert freeze["reregistered"], freeze
    # The gateway moved a decode leg off the frozen engine while it was stopped, after its first-byte bound; the
    # directory planned the other decode engine from then on.
    assert soak.FIRST_BYTE_TIMEOUT_S <= freeze["first_decode_failover_s"] < 16.0, freeze
    assert freeze["planned_elsewhere_count"] > 0, freeze
    # The soak's own streamed request was planned on the frozen engine and failed over past the bound.
    assert freeze["probe"]["kind"] == "completed", freeze
    assert freeze["probe"]["elapsed_s"] >= soak.FIRST_BYTE_TIMEOUT_S, freeze
    assert freeze["outcomes"]["hung"] == 0, freeze
    # After the thaw, transfers to the engine that was frozen (whose peer a timed-out write may have made prefill
    # drop) land again: every request sent in the 30 s after it completed, none past the gateway's failover bound.
    after = freeze["outcomes_after"]
    assert after["completed"] > 0 and after["failed"] == after["hung"] == 0, freeze
    assert after["over_failover_bound"] == 0, freeze

    oversized = events["oversized"]
    assert oversized["sent"] > 0 and set(oversized["status_counts"]) == {"RESOURCE_EXHAUSTED"}, oversized
    assert set(oversized["health_during"]["statuses"]) == {"SERVING"}, oversized
    assert set(oversized["health_after"]["statuses"]) == {"SERVING"}, oversized

    flood = events["invalid-flood"]
    assert flood["sent"] > 0 and all(400 <= status < 500 for status in map(int, flood["status_counts"])), flood
    assert flood["left_planned"] == 0, flood
    assert flood["most_active_share_of_cap"] < 0.5, flood

    # The well-behaved clients kept being served during every fault (this short load has little time outside them).
    during = {f["fault"]: f for f in result["served_rate"]["during_faults"]}
    assert set(during) == set(events), result["served_rate"]
    assert all(f["sent_per_s"] > 0 and f["completed_per_s"] > 0 for f in during.values()), during
