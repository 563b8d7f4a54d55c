"""The decode worker's receives that await prefill's first token: the notification alone never ends them; the
directory's COMPLETE (with the token) or its failure does, whichever order the signals come in. No directory
call is made on these paths (no deadline passes), so the worker runs without one."""

from __future__ import annotations

import time

from kvpush.connector.config import ConnectorConfig
from kvpush.connector.metadata import KVPushMetadata, ReceiveStart
from kvpush.connector.worker.decode import DecodeWorker
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb


def _worker() -> DecodeWorker:
    config = ConnectorConfig.from_extra_config({"directory_address": "127.0.0.1:1", "idle_step_wait_s": 0},
                                               role="decode", engine_id="d1")
    return DecodeWorker(config, None, block_size_tokens=16)


def _start(worker: DecodeWorker, awaits: bool, transfer_id: str = "t1") -> None:
    worker.begin_step(KVPushMetadata(receives=[ReceiveStart("r1", transfer_id, (1, 2), 32, 0,
                                                            awaits_first_token=awaits)]))


def _event(state: int, token: int | None = None, transfer_id: str = "t1") -> dpb.TransferEvent:
    event = dpb.TransferEvent(sequence_number=1, transfer_id=transfer_id, state=state, reason="why")
    if token is not None:
        event.first_token_id = token
    return event


def test_notification_then_complete_with_token():
    worker = _worker()
    _start(worker, awaits=True)
    worker.on_notification("p-agent", b"t1")
    assert worker.collect() == (set(), set()) and worker.take_first_tokens() == {}
    worker.on_event(_event(tpb.TRANSFER_STATE_COMPLETE, token=5))
    assert worker.collect() == ({"r1"}, set())
    assert worker.take_first_tokens() == {"r1": 5} and worker.take_first_tokens() == {}


def test_notification_then_cancelled_ends_at_once_as_a_failure():
    """A notification followed by CANCELLED (prefill's leg failed): the receive ends now, blocks as load errors,
    rather than waiting out transfer_timeout_s for a token that will not come."""
    worker = _worker()
    _start(worker, awaits=True)
    worker.on_notification("p-agent", b"t1")
    worker.on_event(_event(tpb.TRANSFER_STATE_CANCELLED))
    assert worker.collect() == ({"r1"}, {1, 2}) and worker.take_first_tokens() == {}


def test_complete_before_the_receive_started_carries_the_token():
    worker = _worker()
    worker.on_event(_event(tpb.TRANSFER_STATE_COMPLETE, token=0))
    _start(worker, awaits=True)
    assert worker.collect() == ({"r1"}, set()) and worker.take_first_tokens() == {"r1": 0}


def test_a_plain_receive_still_ends_on_the_notification():
    worker = _worker()
    _start(worker, awaits=False)
    worker.on_notification("p-agent", b"t1")
    assert worker.collect() == ({"r1"}, set()) and worker.take_first_tokens() == {}


def test_only_an_empty_step_after_an_empty_step_waits():
    """A receive in flight: the empty step right after a forward returns at once (that forward's tokens go out
    only after it); back-to-back empty steps wait up to idle_step_wait_s for a transfer signal."""
    config = ConnectorConfig.from_extra_config({"directory_address": "127.0.0.1:1", "idle_step_wait_s": 0.1},
                                               role="decode", engine_id="d1")
    worker = DecodeWorker(config, None, block_size_tokens=16)
    _start(worker, awaits=True)
    worker.collect()
    worker.begin_step(KVPushMetadata())  # a step that computed tokens (another request's decode)
    worker.collect()
    waited = []
    for _ in range(3):
        worker.begin_step(KVPushMetadata(empty_step=True))
        started = time.monotonic()
        assert worker.collect() == (set(), set())
        waited.append(time.monotonic() - started)
    assert waited[0] < 0.08 and waited[1] >= 0.09 and waited[2] >= 0.09, waited


def test_back_to_back_empty_steps_wait_while_legs_wait_for_their_prefill():
    """No receive in flight, but the scheduler says legs wait for their prefill's start (vLLM keeps stepping for
    them): back-to-back empty steps wait up to idle_step_wait_s instead of spinning; none waiting: no wait."""
    config = ConnectorConfig.from_extra_config({"directory_address": "127.0.0.1:1", "idle_step_wait_s": 0.1},
                                               role="decode", engine_id="d1")
    worker = DecodeWorker(config, None, block_size_tokens=16)
    waited = {}
    for awaiting in (0, 2):
        times = []
        for _ in range(3):
            worker.begin_step(KVPushMetadata(empty_step=True, legs_awaiting_prefill=awaiting))
            started = time.monotonic()
            assert worker.collect() == (set(), set())
            times.append(time.monotonic() - started)
        waited[awaiting] = times
    assert max(waited[0]) < 0.05 and min(waited[2]) >= 0.09, waited
