"""A prefill worker that reports a decode agent dropped (WriteResult.dropped_decode_agent_name) gets the agent's
metadata again with its stream's next instruction to it: a real directory server on 127.0.0.1, a raw stream."""

from __future__ import annotations

import grpc

from kvpush.v1 import directory_pb2 as dpb
from tests.fixtures.directory import DECODE, PREFILL, allocation, ready, register_request, result, running_directory
from tests.integration.directory.helpers import open_prefill, read, run, send_ready, stub

FAILED = dpb.WRITE_RESULT_STATUS_FAILED
DONE = dpb.WRITE_RESULT_STATUS_DONE


def test_metadata_is_sent_again_after_the_worker_reports_the_agent_dropped():
    """Metadata with the first instruction, none with the second; the second fails reporting the agent dropped, so
    the third carries the metadata and layout again, and the fourth none. A bad agent name is refused precisely."""
    async def body():
        async with running_directory() as directory:
            channel, s = stub(directory.address)
            p_lease = (await s.RegisterEngine(register_request("p1", PREFILL))).lease_id
            await s.RegisterEngine(register_request("d1", DECODE))
            prefill = await open_prefill(s, "p1", p_lease)
            sent = []
            for round_ in range(4):
                tid = (await s.PlanTransfer(dpb.PlanTransferRequest())).transfer.transfer_id
                await s.ReportAllocation(allocation(tid, block_ids=[1, 2, 3]))
                await send_ready(prefill, ready(tid, 0, 4))
                instruction = (await read(prefill)).instruction
                sent.append((instruction.decode_agent_metadata, instruction.HasField("decode_layout")))
                if round_ == 1:
                    outcome = result(tid, FAILED, error="instruction refused: decode agent is unknown here")
                    outcome.dropped_decode_agent_name = instruction.decode_agent_name
                else:
                    outcome = result(tid, DONE)
                # Applied before the next round's readiness (one stream, read in order), so before its instruction.
                await prefill.write(dpb.StreamPrefillRequest(result=outcome))
            assert sent == [(b"nixl-md-d1-0", True), (b"", False), (b"nixl-md-d1-0", True), (b"", False)]

            bad = result("no-such-transfer", FAILED, error="x")
            bad.dropped_decode_agent_name = "bad\nname"
            await prefill.write(dpb.StreamPrefillRequest(result=bad))
            rejection = (await read(prefill)).rejection
            assert rejection.status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert "dropped_decode_agent_name" in rejection.status.message
            await prefill.done_writing()
            await channel.close()
    run(body())
