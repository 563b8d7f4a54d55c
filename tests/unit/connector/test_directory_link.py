"""DirectoryLink against a real directory on loopback (and against none): start-up registration and its
bounded failure, the calls the scheduler submits, and close."""

from __future__ import annotations

import threading
import time

import pytest

from kvpush.client.config import ChannelConfig
from kvpush.client.sync import SyncDirectoryClient
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.directory_link import DirectoryLink
from kvpush.localstack.processes import free_port
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import DECODE, PREFILL, directory_on_loopback, make_layout, register_request


def _config(address: str, **extra) -> ConnectorConfig:
    return ConnectorConfig.from_extra_config({"directory_address": address, **extra}, role="decode", engine_id="d")


def test_registration_without_a_directory_fails_in_bounded_time_naming_the_address():
    """No directory listening: register raises RuntimeError with the engine id and the address, within the
    client's retry budget, instead of hanging the engine's start-up."""
    address = f"127.0.0.1:{free_port()}"
    link = DirectoryLink(_config(address, directory_timeout_s=0.5, directory_max_attempts=2))
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=f"engine 'd'.*{address}"):
            link.register(tpb.ENGINE_ROLE_DECODE, 0, 1, "d-agent", b"md", make_layout())
        assert time.monotonic() - started < 10
    finally:
        link.close(timeout_s=1.0)


def test_registered_worker_reports_an_allocation_and_cancels_and_close_deregisters():
    """The link registers, submits ReportAllocation and CancelTransfer without
    waiting (results arrive on its thread), and close() deregisters the worker."""
    with directory_on_loopback() as address:
        link = DirectoryLink(_config(address))
        helper = SyncDirectoryClient(ChannelConfig(address=address))
        try:
            link.register(DECODE, 0, 1, "d-agent", b"md", make_layout())
            helper.register_engine(register_request("p", PREFILL))
            transfer_id = helper.plan_transfer(prompt_token_count=40).transfer.transfer_id
            refused: list[str] = []
            link.report_allocation(transfer_id, [1, 2, 3], 40, 0, refused.append)
            link.report_allocation("no-such-transfer", [1, 2, 3], 40, 0, refused.append)
            deadline = time.monotonic() + 5  # submitted, not awaited: the directory has it a moment later
            while not helper.get_transfer(transfer_id).decode_block_ids and time.monotonic() < deadline:
                time.sleep(0.01)
            done = threading.Event()
            seen: list = []
            link.cancel_transfer(transfer_id, "test", lambda transfer, error: (seen.append((transfer, error)),
                                                                              done.set()))
            assert done.wait(5)
            ((transfer, error),) = seen
            assert error == "" and transfer.transfer_id == transfer_id and list(transfer.decode_block_ids) == [1, 2, 3]
            deadline = time.monotonic() + 5
            while not refused and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(refused) == 1 and "NOT_FOUND" in refused[0]
            link.close()
            workers = helper.list_engines()
            assert [w.engine_id for w in workers] == ["p"]
        finally:
            helper.close()


def test_an_allocation_of_blocks_a_live_transfer_owns_waits_for_it_to_end_within_transfer_timeout_s():
    """Blocks still owned by a live transfer (decode completed it on prefill's notification, the directory has not
    had prefill's result yet): the report is retried until that transfer ends, then accepted; a transfer that does
    not end within transfer_timeout_s leaves the refusal as the directory gave it."""
    with directory_on_loopback() as address:
        link = DirectoryLink(_config(address, transfer_timeout_s=0.6))
        helper = SyncDirectoryClient(ChannelConfig(address=address))
        try:
            link.register(DECODE, 0, 1, "d-agent", b"md", make_layout())
            helper.register_engine(register_request("p", PREFILL))
            owner, waiting, never = (helper.plan_transfer(prompt_token_count=40).transfer.transfer_id
                                     for _ in range(3))
            helper.report_allocation(owner, "d", [1, 2, 3], 40)
            refused: list[str] = []
            link.report_allocation(waiting, [1, 2, 3], 40, 0, refused.append)
            time.sleep(0.2)
            assert refused == [] and not helper.get_transfer(waiting).decode_block_ids  # still retrying
            helper.cancel_transfer(owner, "ended")  # not dispatched: terminal at once, its blocks released
            deadline = time.monotonic() + 5
            while not helper.get_transfer(waiting).decode_block_ids and time.monotonic() < deadline:
                time.sleep(0.01)
            assert list(helper.get_transfer(waiting).decode_block_ids) == [1, 2, 3] and refused == []
            started = time.monotonic()
            link.report_allocation(never, [3, 4, 5], 40, 0, refused.append)  # block 3 is the waiting transfer's
            while not refused and time.monotonic() - started < 5:
                time.sleep(0.01)
            assert 0.4 < time.monotonic() - started < 2.0
            assert len(refused) == 1 and "FAILED_PRECONDITION" in refused[0] and "block 3 is already allocated" \
                in refused[0]
            assert not helper.get_transfer(never).decode_block_ids
        finally:
            link.close()
            helper.close()
