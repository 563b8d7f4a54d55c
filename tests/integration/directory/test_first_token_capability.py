"""`forces_first_token`: what each decode worker registers is what ListEngines shows, and a plan says its decode
engine forces prefill's first token only when every rank registered it (a real directory on loopback)."""

from __future__ import annotations

from kvpush.v1 import directory_pb2 as dpb
from tests.fixtures.directory import DECODE, PREFILL, register_request, running_directory
from tests.integration.directory.helpers import run, stub


def _register(engine_id: str, role: int, forces: bool, tp_rank: int = 0, tp_size: int = 1) -> dpb.RegisterEngineRequest:
    request = register_request(engine_id, role, tp_rank=tp_rank, tp_size=tp_size, endpoint=f"http://{engine_id}:8000")
    request.forces_first_token = forces
    return request


def test_a_plan_forces_the_first_token_only_when_every_decode_rank_does():
    async def body():
        async with running_directory() as directory:
            channel, s = stub(directory.address)
            for rank in (0, 1):
                await s.RegisterEngine(_register("p1", PREFILL, False, tp_rank=rank, tp_size=2))
            await s.RegisterEngine(_register("d1", DECODE, True, tp_rank=0, tp_size=2))
            await s.RegisterEngine(_register("d1", DECODE, False, tp_rank=1, tp_size=2))
            listed = await s.ListEngines(dpb.ListEnginesRequest())
            assert [(w.engine_id, w.tp_rank, w.forces_first_token) for w in listed.workers] == [
                ("d1", 0, True), ("d1", 1, False), ("p1", 0, False), ("p1", 1, False)]
            plan = await s.PlanTransfer(dpb.PlanTransferRequest())
            assert plan.transfer.decode_engine_id == "d1" and not plan.decode_forces_first_token
            # Rank 1 registers again (same agent: its registration is refreshed) now that its engine forces.
            await s.RegisterEngine(_register("d1", DECODE, True, tp_rank=1, tp_size=2))
            assert (await s.PlanTransfer(dpb.PlanTransferRequest())).decode_forces_first_token
            engine = await s.GetEngine(dpb.GetEngineRequest(engine_id="d1"))
            assert [w.forces_first_token for w in engine.workers] == [True, True]
            await channel.close()
    run(body())
