"""A frozen engine is left out of plans before its lease lapses: a real directory, real lease renewals by
`EngineRegistration`, and a decode engine whose process is stopped with SIGSTOP (then continued)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

from kvpush.client import ChannelConfig, DirectoryClient, EngineRegistration
from kvpush.directory.state import Limits
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import DECODE, PREFILL, register_request, running_directory
from tests.integration.directory.helpers import run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
LEASE_TTL_S = 3.0  # clients renew every second; an engine is late after 1.5 s, its lease lapses after 3 s

# Registers decode engine d2 and renews its lease until killed (the process the test freezes).
_ENGINE = """
import asyncio, sys
from kvpush.client import ChannelConfig, DirectoryClient, EngineRegistration
from tests.fixtures.directory import DECODE, register_request

async def main():
    registration = EngineRegistration(DirectoryClient(ChannelConfig(address=sys.argv[1])),
                                      register_request("d2", DECODE))
    await registration.start()
    print("registered", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def _until(predicate, timeout_s: float, what: str) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not within {timeout_s}s: {what}")


def test_a_stopped_engine_is_not_planned_until_it_renews_again():
    """d2 is preferred (more free blocks); SIGSTOP: once its renewal is late every plan goes to d1 while d2's lease
    still holds, and the skips are counted; SIGCONT: its next renewal brings it back."""
    async def body():
        async with running_directory(Limits(lease_ttl_s=LEASE_TTL_S)) as directory:
            state, metrics = directory.server.state, directory.server.metrics
            client = DirectoryClient(ChannelConfig(address=directory.address))
            prefill = EngineRegistration(client, register_request("p1", PREFILL))
            decode = EngineRegistration(client, register_request("d1", DECODE),
                                        load_callback=lambda: tpb.EngineLoad(free_block_count=10))
            await prefill.start()
            await decode.start()
            engine = subprocess.Popen([sys.executable, "-c", _ENGINE, directory.address], cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            try:
                while (line := await asyncio.to_thread(engine.stdout.readline)) != "registered\n":
                    assert line, "the engine process ended before registering"
                await _until(lambda: decode.renewal_count >= 1, 5, "d1's first renewal (its load)")

                async def plan_decode() -> str:
                    response = await client.plan_transfer(prompt_token_count=16)
                    await client.cancel_transfer(response.transfer.transfer_id, "test")
                    return response.transfer.decode_engine_id

                assert await plan_decode() == "d2"
                os.kill(engine.pid, signal.SIGSTOP)
                group = state.engines.groups["d2"]
                await _until(lambda: state.engines.late_since(group, state.clock.monotonic()) is not None,
                             LEASE_TTL_S, "d2's renewal late")
                decodes = [await plan_decode() for _ in range(10)]
                lease_left_s = group.workers[0].lease_deadline - state.clock.monotonic()
                assert decodes == ["d1"] * 10
                assert lease_left_s > 0, "d2's lease lapsed before the plans: the skip was not what kept it out"
                skipped = metrics.registry.get_sample_value("kvpush_directory_plan_skipped_engines_total",
                                                            {"reason": "late_renewal"})
                assert skipped >= 10
                os.kill(engine.pid, signal.SIGCONT)
                await _until(lambda: state.engines.late_since(group, state.clock.monotonic()) is None
                             and "d2" in state.engines.groups, 5, "d2 renewing again")
                assert await plan_decode() == "d2"
            finally:
                os.kill(engine.pid, signal.SIGCONT)
                engine.kill()
                engine.wait(10)
                await prefill.stop()
                await decode.stop()
                await client.close()
    run(body())
