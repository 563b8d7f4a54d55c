"""The decode scheduler half with vLLM's own Request / KVCacheBlocks / SchedulerOutput objects and a real
directory on loopback behind its DirectoryLink: the wait for remote KV, the allocation report, a refused
report, and an abort while waiting. The wait for prefill's start before allocating (decode_allocation_wait_s)
is driven with a recording reporter and a hand-moved clock."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from vllm import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvpush.client.config import ChannelConfig
from kvpush.client.sync import SyncDirectoryClient
from kvpush.connector.config import ConnectorConfig
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
    """Without the wait for prefill's start: (n, True) for the tokens past decode's hit; after allocation the
    directory holds the blocks and the next step's metadata starts the receive; a second update_state_after_alloc
    changes nothing."""
    with directory_on_loopback() as address:
        client = SyncDirectoryClient(ChannelConfig(address=address))
        link = DirectoryLink(connector_config(address, "decode", "d"))
        try:
            client.register_engine(register_request("p", PREFILL))
            client.register_engine(register_request("d", DECODE))
            transfer_id = client.plan_transfer(prompt_token_count=40).transfer.transfer_id
            scheduler = DecodeScheduler(connector_config(address, "decode", "d", decode_allocation_wait_s=None), BS,
                                        link)
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


# ------------------------------------------------------- waiting for prefill's start (decode_allocation_wait_s)

WAIT_S = 5.0


class _Directory:
    """Records what the scheduler half asks of the directory link; `start` plays the link seeing prefill start."""

    def __init__(self) -> None:
        self.watched: dict[str, Callable[[str], None]] = {}
        self.forgotten: list[str] = []
        self.reports: list[tuple[str, list[int], int]] = []
        self.cancels: list[tuple[str, str]] = []

    def report_allocation(self, transfer_id: str, block_ids: list[int], prompt_token_count: int,
                          skip_token_count: int, on_refused: Callable[[str], None],
                          block_groups: Sequence[tuple[Sequence[int], int]] = ()) -> None:
        self.reports.append((transfer_id, block_ids, skip_token_count))

    def cancel_transfer(self, transfer_id: str, reason: str) -> None:
        self.cancels.append((transfer_id, reason))

    def watch_prefill_start(self, transfer_id: str, on_started: Callable[[str], None]) -> None:
        self.watched[transfer_id] = on_started

    def forget_prefill_start(self, transfer_id: str) -> None:
        self.watched.pop(transfer_id, None)
        self.forgotten.append(transfer_id)

    def start(self, transfer_id: str) -> None:
        self.watched.pop(transfer_id)(transfer_id)


class _Deferrals:
    def __init__(self) -> None:
        self.seen: list[tuple[float, str]] = []

    def on_allocation_deferred(self, seconds: float, ended_by: str) -> None:
        self.seen.append((seconds, ended_by))


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _waiting_scheduler(wait_s: float | None = WAIT_S) -> tuple[DecodeScheduler, _Directory, _Deferrals, _Clock]:
    config = ConnectorConfig.from_extra_config({"directory_address": "127.0.0.1:1",
                                                "decode_allocation_wait_s": wait_s}, role="decode", engine_id="d")
    directory, deferrals, clock = _Directory(), _Deferrals(), _Clock()
    return DecodeScheduler(config, BS, directory, deferrals=deferrals, clock=clock), directory, deferrals, clock


def test_the_wait_is_on_by_default_and_null_or_zero_turns_it_off():
    def wait_of(**extra) -> float | None:
        return ConnectorConfig.from_extra_config({"directory_address": "127.0.0.1:1", **extra}, role="decode",
                                                 engine_id="d").decode_allocation_wait_s

    assert wait_of() == 10.0
    assert wait_of(decode_allocation_wait_s=2.5) == 2.5
    assert wait_of(decode_allocation_wait_s=None) is None and wait_of(decode_allocation_wait_s=0) is None


def test_a_leg_allocates_nothing_until_its_prefill_started():
    """None (ask again later) while prefill has not started, however often vLLM asks and however its local hit
    changes; a plain request and another leg are untouched; once the link saw the start: (n, True), the report
    goes out, the watch is dropped and the deferral is measured as ended by prefill's start."""
    scheduler, directory, deferrals, clock = _waiting_scheduler()
    leg, other, plain = _request("r1", "t1"), _request("r2", "t2"), _request("r3", "t3")
    plain.kv_transfer_params.clear()
    for request in (leg, other, plain):
        scheduler.on_new_request(request)
    assert sorted(directory.watched) == ["t1", "t2"]
    for computed in (0, 16, 16):
        assert scheduler.get_num_new_matched_tokens(leg, computed) == (None, False)
    # The workers learn that legs wait (they pace vLLM's empty steps meanwhile).
    assert scheduler.build_connector_meta(SchedulerOutput.make_empty()).legs_awaiting_prefill == 2
    assert scheduler.get_num_new_matched_tokens(plain, 0) == (0, False)
    clock.now += 1.5
    directory.start("t1")
    assert scheduler.get_num_new_matched_tokens(leg, 16) == (24, True)
    assert scheduler.get_num_new_matched_tokens(other, 16) == (None, False)
    assert directory.reports == []
    scheduler.update_state_after_alloc(leg, _blocks(5, 6, 7), 24)
    assert directory.reports == [("t1", [5, 6, 7], 16)] and directory.forgotten == ["t1"]
    assert deferrals.seen == [(1.5, "prefill_started")]
    meta = scheduler.build_connector_meta(SchedulerOutput.make_empty())
    (receive,) = meta.receives
    assert receive.transfer_id == "t1" and scheduler.waiting_leg_count() == 1 and meta.legs_awaiting_prefill == 1


def test_the_bound_allocates_a_leg_whose_prefill_never_started():
    """Past decode_allocation_wait_s since the leg arrived, decode allocates as it would without the wait."""
    scheduler, directory, deferrals, clock = _waiting_scheduler()
    leg = _request("r1", "t1")
    scheduler.on_new_request(leg)
    clock.now += WAIT_S - 0.01
    assert scheduler.get_num_new_matched_tokens(leg, 0) == (None, False)
    clock.now += 0.01
    assert scheduler.get_num_new_matched_tokens(leg, 0) == (40, True)
    scheduler.update_state_after_alloc(leg, _blocks(1, 2, 3), 40)
    assert directory.reports == [("t1", [1, 2, 3], 0)] and directory.watched == {}
    assert deferrals.seen == [(WAIT_S, "wait_bound")]


def test_without_the_wait_a_leg_allocates_at_once_and_nothing_is_watched():
    scheduler, directory, deferrals, _ = _waiting_scheduler(None)
    leg = _request("r1", "t1")
    scheduler.on_new_request(leg)
    assert scheduler.get_num_new_matched_tokens(leg, 16) == (24, True)
    assert scheduler.build_connector_meta(SchedulerOutput.make_empty()).legs_awaiting_prefill == 0
    scheduler.update_state_after_alloc(leg, _blocks(5, 6, 7), 24)
    assert directory.watched == {} and directory.forgotten == [] and deferrals.seen == []
    assert directory.reports == [("t1", [5, 6, 7], 16)]


def test_a_leg_carrying_prefills_first_token_never_waits():
    """The gateway had prefill's answer before it sent this leg: prefill ended, so nothing is watched."""
    scheduler, directory, deferrals, _ = _waiting_scheduler()
    leg = _request("r1", "t1")
    leg.kv_transfer_params.update(first_token_from_prefill=True, first_token_id=7)
    scheduler.on_new_request(leg)
    assert scheduler.get_num_new_matched_tokens(leg, 0) == (40, True)
    scheduler.update_state_after_alloc(leg, _blocks(1, 2, 3), 40)
    assert directory.watched == {} and directory.forgotten == [] and deferrals.seen == []
    assert directory.reports == [("t1", [1, 2, 3], 0)]


def test_a_full_local_hit_never_waits_and_stops_the_push():
    scheduler, directory, deferrals, _ = _waiting_scheduler()
    leg = _request("r1", "t1", prompt=32)
    scheduler.on_new_request(leg)
    assert scheduler.get_num_new_matched_tokens(leg, 32) == (0, False)
    scheduler.update_state_after_alloc(leg, _blocks(1, 2), 0)
    assert directory.cancels == [("t1", "decode needs no pushed tokens")] and directory.reports == []
    assert directory.watched == {} and deferrals.seen == [] and scheduler.waiting_leg_count() == 0


def test_an_abort_while_waiting_cancels_the_transfer_and_leaves_nothing_behind():
    """vLLM aborts a request still in the waiting queue: no blocks to keep, the transfer is cancelled (prefill
    stops), the watch is dropped, and a start seen afterwards changes nothing."""
    scheduler, directory, deferrals, _ = _waiting_scheduler()
    leg = _request("r1", "t1")
    scheduler.on_new_request(leg)
    assert scheduler.get_num_new_matched_tokens(leg, 0) == (None, False)
    on_started = directory.watched["t1"]
    assert scheduler.request_finished(leg, []) == (False, None)
    assert directory.cancels == [("t1", "decode request finished before allocation")]
    assert directory.watched == {} and scheduler.waiting_leg_count() == 0
    on_started("t1")  # the link's answer was already on its way: dropped
    assert scheduler.get_num_new_matched_tokens(leg, 0) == (0, False)
    meta = scheduler.build_connector_meta(SchedulerOutput.make_empty())
    assert (meta.receives, meta.cancelled_receives, meta.failed_receives) == ([], [], [])
    assert scheduler.receiving_count() == 0 and deferrals.seen == []


def _two_legs_of_one_started_transfer() -> tuple[DecodeScheduler, _Directory, Request]:
    """Two legs name transfer t1, its prefill started, the first allocated blocks 1-3 for its 40 tokens; the second
    (the duplicate) is returned."""
    scheduler, directory, _, _ = _waiting_scheduler()
    first, duplicate = _request("r1", "t1"), _request("r2", "t1")
    scheduler.on_new_request(first)
    scheduler.on_new_request(duplicate)
    directory.start("t1")
    scheduler.update_state_after_alloc(first, _blocks(1, 2, 3), 40)
    return scheduler, directory, duplicate


def test_two_legs_of_one_transfer_share_the_watch_until_both_are_gone():
    scheduler, directory, duplicate = _two_legs_of_one_started_transfer()
    assert directory.forgotten == []
    assert scheduler.get_num_new_matched_tokens(duplicate, 0) == (40, True)
    scheduler.request_finished(duplicate, [])
    assert directory.forgotten == ["t1"]


def test_a_second_leg_of_a_transfer_this_engine_receives_fails_without_a_report():
    """Two legs name one transfer and both allocate once its prefill started (one step): the first is reported and
    received; the second is not reported (the directory keeps one allocation per transfer) and fails in the same
    step's metadata, so its receive can never end on the first's pushed KV."""
    scheduler, directory, duplicate = _two_legs_of_one_started_transfer()
    scheduler.update_state_after_alloc(duplicate, _blocks(4, 5, 6), 40)
    assert [report[:2] for report in directory.reports] == [("t1", [1, 2, 3])]
    meta = scheduler.build_connector_meta(SchedulerOutput.make_empty())
    assert [receive.request_id for receive in meta.receives] == ["r1", "r2"]
    assert [request_id for request_id, _ in meta.failed_receives] == ["r2"]
    assert "already received by another request" in meta.failed_receives[0][1]
    assert directory.cancels == []
