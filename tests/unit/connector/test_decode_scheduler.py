"""The decode scheduler half with vLLM's own Request / KVCacheBlocks / SchedulerOutput objects and a real
directory on loopback behind its DirectoryLink: the wait for remote KV, the allocation report, a refused
report, and an abort while waiting."""

from __future__ import annotations

import time

from vllm import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvpush.client.config import ChannelConfig
from kvpush.client.sync import SyncDirectoryClient
from kvpush.connector.directory_link import DirectoryLink
from kvpush.connector.halves import SchedulerHalf
from kvpush.connector.scheduler.decode import DecodeScheduler
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import DECODE, PREFILL, directory_on_loopback, register_request
from tests.unit.connector.inmemory_helpers import connector_config

BS = 16
BOUND_S = 10.0


def _request(request_id: str, transfer_id: str, prompt: int = 40) -> Request:
    params = {"transfer_id": transfer_id, "do_remote_prefill": True}
    return Request(request_id=request_id, prompt_token_ids=list(range(prompt)), pooling_params=None,
                   sampling_params=SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params}))


def _blocks(*ids: int) -> KVCacheBlocks:
    return KVCacheBlocks(([KVCacheBlock(i) for i in ids],))


def _until(predicate, what: str):
    deadline = time.monotonic() + BOUND_S
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
    return value


def test_allocation_is_reported_and_the_receive_handed_to_the_workers():
    """(n, True) for the tokens past decode's hit; after allocation the directory holds the blocks and the
    next step's metadata starts the receive; a second update_state_after_alloc changes nothing."""
    with directory_on_loopback() as address:
        client = SyncDirectoryClient(ChannelConfig(address=address))
        link = DirectoryLink(connector_config(address, "decode", "d"))
        try:
            client.register_engine(register_request("p", PREFILL))
            client.register_engine(register_request("d", DECODE))
            transfer_id = client.plan_transfer(prompt_token_count=40).transfer.transfer_id
            scheduler = DecodeScheduler(connector_config(address, "decode", "d"), BS, link)
            assert isinstance(scheduler, SchedulerHalf)
            request = _request("r1", transfer_id)
            scheduler.on_new_request(request)
            assert scheduler.get_num_new_matched_tokens(request, 16) == (24, True)
            assert scheduler.get_num_new_matched_tokens(request, 16) == (24, True)  # no side effects
            scheduler.update_state_after_alloc(request, _blocks(5, 6, 7), 24)
            scheduler.update_state_after_alloc(request, _blocks(5, 6, 7), 0)
            (receive,) = scheduler.build_connector_meta(SchedulerOutput.make_empty()).receives
            assert (receive.block_ids, receive.skip_token_count) == ((5, 6, 7), 16)
            transfer = _until(lambda: (t := client.get_transfer(transfer_id)).decode_block_ids and t, "allocation")
            assert list(transfer.decode_block_ids) == [5, 6, 7] and transfer.prefix_hit_token_count == 16
            scheduler.update_connector_output(KVConnectorOutput(finished_recving={"r1"}))
            assert scheduler.receiving_count() == 0
        finally:
            link.close()
            client.close()


def test_a_refused_report_fails_the_receive_and_an_abort_cancels_the_transfer():
    """An unknown transfer id is refused by the directory: the next step fails that receive, whose end then
    cancels nothing (a duplicate of another request's transfer id must not cancel that one). Aborting a
    waiting request cancels its transfer at the directory and keeps the blocks until the workers confirm."""
    with directory_on_loopback() as address:
        client = SyncDirectoryClient(ChannelConfig(address=address))
        link = DirectoryLink(connector_config(address, "decode", "d"))
        try:
            client.register_engine(register_request("p", PREFILL))
            client.register_engine(register_request("d", DECODE))
            scheduler = DecodeScheduler(connector_config(address, "decode", "d"), BS, link)
            ghost = _request("r-ghost", "no-such-transfer")
            scheduler.on_new_request(ghost)
            scheduler.update_state_after_alloc(ghost, _blocks(1, 2, 3), 40)
            scheduler.build_connector_meta(SchedulerOutput.make_empty())

            def refused():
                failed = scheduler.build_connector_meta(SchedulerOutput.make_empty()).failed_receives
                return failed or None

            ((request_id, reason),) = _until(refused, "the refusal")
            assert request_id == "r-ghost" and "NOT_FOUND" in reason
            # A request whose allocation was refused owns nothing of the transfer: finishing it cancels nothing.
            assert scheduler.request_finished(ghost, [1, 2, 3]) == (False, None)
            assert scheduler.receiving_count() == 0
            transfer_id = client.plan_transfer(prompt_token_count=40).transfer.transfer_id
            waiting = _request("r2", transfer_id)
            scheduler.on_new_request(waiting)
            scheduler.update_state_after_alloc(waiting, _blocks(8, 9, 10), 40)
            assert scheduler.request_finished(waiting, [8, 9, 10]) == (True, None)
            assert scheduler.build_connector_meta(SchedulerOutput.make_empty()).cancelled_receives == ["r2"]
            _until(lambda: client.get_transfer(transfer_id).state == tpb.TRANSFER_STATE_CANCELLED
                   or client.get_transfer(transfer_id).failure_reason, "the cancellation")
        finally:
            link.close()
            client.close()


def test_prefill_first_token_is_attached_before_the_request_is_scheduled():
    """A first_token_from_prefill leg: the receive waits for the token; the workers' token (worker metadata, with
    the finished receive) lands in the request's kv_transfer_params.first_token_id, the very dict vLLM hands the
    logits processor in the request's sampling params."""
    from kvpush.connector.first_token import forced_first_token
    from kvpush.connector.metadata import KVPushWorkerMetadata

    with directory_on_loopback() as address:
        client = SyncDirectoryClient(ChannelConfig(address=address))
        link = DirectoryLink(connector_config(address, "decode", "d"))
        try:
            client.register_engine(register_request("p", PREFILL))
            client.register_engine(register_request("d", DECODE))
            transfer_id = client.plan_transfer(prompt_token_count=40).transfer.transfer_id
            scheduler = DecodeScheduler(connector_config(address, "decode", "d"), BS, link)
            request = _request("r1", transfer_id)
            request.kv_transfer_params["first_token_from_prefill"] = True
            scheduler.on_new_request(request)
            scheduler.update_state_after_alloc(request, _blocks(5, 6, 7), 40)
            (receive,) = scheduler.build_connector_meta(SchedulerOutput.make_empty()).receives
            assert receive.awaits_first_token
            assert forced_first_token(request.sampling_params) is None
            scheduler.update_connector_output(KVConnectorOutput(
                finished_recving={"r1"}, kv_connector_worker_meta=KVPushWorkerMetadata(first_tokens={"r1": 99})))
            assert forced_first_token(request.sampling_params) == 99 and scheduler.receiving_count() == 0
        finally:
            link.close()
            client.close()
