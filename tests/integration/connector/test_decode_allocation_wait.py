"""Decode waits for its prefill's start before allocating (decode_allocation_wait_s), against a real directory on
loopback: the decode scheduler half behind its real DirectoryLink, a prefill engine's real StreamPrefill session.

The directory's transfer record says when decode allocated (allocate_time) and when prefill first reported a ready
layer (first_ready_time): decode reports no allocation before that readiness and does after; past the bound it
allocates anyway; a transfer cancelled while its leg waits fails that request as an allocation for an ended
transfer always did (the refused report)."""

from __future__ import annotations

import time

from vllm import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request

from kvpush.client.config import ChannelConfig
from kvpush.client.sync import SyncDirectoryClient
from kvpush.connector import metrics
from kvpush.connector.directory_link import DirectoryLink
from kvpush.connector.metrics import DecodeSchedulerMetrics
from kvpush.connector.scheduler.decode import DecodeScheduler
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import DECODE, PREFILL, directory_on_loopback, ready, register_request
from tests.unit.connector.inmemory_helpers import connector_config

BS = 16
PROMPT = 40
BOUND_S = 10.0


def _request(request_id: str, transfer_id: str) -> Request:
    params = {"transfer_id": transfer_id, "do_remote_prefill": True}
    return Request(request_id=request_id, prompt_token_ids=list(range(PROMPT)), pooling_params=None,
                   sampling_params=SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params}))


def _blocks() -> KVCacheBlocks:
    return KVCacheBlocks(([KVCacheBlock(i) for i in (4, 5, 6)],))


def _until(predicate, what: str, bound_s: float = BOUND_S):
    deadline = time.monotonic() + bound_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
    return value


def _deferred_count(engine_id: str, ended_by: str) -> float:
    return metrics.registry().get_sample_value("kvpush_connector_decode_allocation_deferred_seconds_count",
                                               {"engine_id": engine_id, "ended_by": ended_by}) or 0.0


class _Decode:
    """A decode engine's scheduler half as vLLM drives it: ask, and allocate once the answer is a token count."""

    def __init__(self, address: str, engine_id: str, wait_s: float) -> None:
        config = connector_config(address, "decode", engine_id, decode_allocation_wait_s=wait_s)
        self.link = DirectoryLink(config)
        self.scheduler = DecodeScheduler(config, BS, self.link, deferrals=DecodeSchedulerMetrics(engine_id))

    def allocate_when_asked(self, request: Request) -> tuple[int | None, bool]:
        """One scheduling pass over the waiting request: allocate if the half says how many tokens come."""
        answer = self.scheduler.get_num_new_matched_tokens(request, 0)
        if answer[0] is not None:
            self.scheduler.update_state_after_alloc(request, _blocks(), answer[0])
        return answer


def test_decode_allocates_only_after_prefill_first_readiness():
    with directory_on_loopback() as address:
        client = SyncDirectoryClient(ChannelConfig(address=address))
        decode = _Decode(address, "d-wait", wait_s=60.0)
        instructions: list[dpb.PushInstruction] = []
        try:
            registration = client.start_registration(register_request("p-wait", PREFILL))
            client.register_engine(register_request("d-wait", DECODE))
            session = client.open_prefill_session(registration, on_instruction=instructions.append)
            transfer_id = client.plan_transfer(prompt_token_count=PROMPT).transfer.transfer_id
            before = _deferred_count("d-wait", "prefill_started")
            request = _request("r1", transfer_id)
            decode.scheduler.on_new_request(request)
            waited_until = time.monotonic() + 0.5
            while time.monotonic() < waited_until:  # vLLM asks every step; nothing is allocated meanwhile
                assert decode.allocate_when_asked(request) == (None, False)
                time.sleep(0.01)
            transfer = client.get_transfer(transfer_id)
            assert transfer.state == tpb.TRANSFER_STATE_PLANNED and not transfer.HasField("allocate_time")

            session.send_ready([ready(transfer_id, 0, 1, prompt=PROMPT)])
            assert _until(lambda: decode.allocate_when_asked(request)[1], "the allocation")
            transfer = _until(lambda: (t := client.get_transfer(transfer_id)).HasField("allocate_time") and t,
                              "the allocation report")
            assert transfer.first_ready_time.ToNanoseconds() <= transfer.allocate_time.ToNanoseconds()
            assert list(transfer.decode_block_ids) == [4, 5, 6]
            # Readiness was known at allocation: the instruction goes out at once.
            (instruction,) = _until(lambda: instructions, "the push instruction")
            assert instruction.transfer_id == transfer_id and list(instruction.decode_block_ids) == [4, 5, 6]
            assert _deferred_count("d-wait", "prefill_started") == before + 1
            assert decode.scheduler.waiting_leg_count() == 0
        finally:
            decode.link.close()
            client.close()


def test_the_bound_allocates_when_prefill_never_starts():
    with directory_on_loopback() as address:
        client = SyncDirectoryClient(ChannelConfig(address=address))
        decode = _Decode(address, "d-bound", wait_s=0.5)
        try:
            client.register_engine(register_request("p-bound", PREFILL))
            client.register_engine(register_request("d-bound", DECODE))
            transfer_id = client.plan_transfer(prompt_token_count=PROMPT).transfer.transfer_id
            before = _deferred_count("d-bound", "wait_bound")
            request = _request("r1", transfer_id)
            arrived = time.monotonic()
            decode.scheduler.on_new_request(request)
            assert decode.allocate_when_asked(request) == (None, False)
            assert _until(lambda: decode.allocate_when_asked(request)[1], "the bound")
            assert time.monotonic() - arrived >= 0.5
            transfer = _until(lambda: (t := client.get_transfer(transfer_id)).HasField("allocate_time") and t,
                              "the allocation report")
            assert transfer.state == tpb.TRANSFER_STATE_ALLOCATED and not transfer.HasField("first_ready_time")
            assert _deferred_count("d-bound", "wait_bound") == before + 1
        finally:
            decode.link.close()
            client.close()


def test_a_transfer_cancelled_while_its_leg_waits_fails_the_request():
    """The link sees the transfer ended: the leg allocates at once (no waiting out the bound), the directory refuses
    the report, and the next step fails the receive (vLLM's load-failure policy decides, as before)."""
    with directory_on_loopback() as address:
        client = SyncDirectoryClient(ChannelConfig(address=address))
        decode = _Decode(address, "d-cancel", wait_s=60.0)
        try:
            client.register_engine(register_request("p-cancel", PREFILL))
            client.register_engine(register_request("d-cancel", DECODE))
            transfer_id = client.plan_transfer(prompt_token_count=PROMPT).transfer.transfer_id
            request = _request("r1", transfer_id)
            decode.scheduler.on_new_request(request)
            assert decode.allocate_when_asked(request) == (None, False)
            client.cancel_transfer(transfer_id, "gateway gave up")
            assert _until(lambda: decode.allocate_when_asked(request)[1], "the allocation")

            def failed():
                return decode.scheduler.build_connector_meta(SchedulerOutput.make_empty()).failed_receives or None

            ((request_id, reason),) = _until(failed, "the refused report")
            assert request_id == "r1" and "FAILED_PRECONDITION" in reason
            assert decode.scheduler.request_finished(request, [4, 5, 6]) == (False, None)
            assert decode.scheduler.receiving_count() == 0
        finally:
            decode.link.close()
            client.close()
