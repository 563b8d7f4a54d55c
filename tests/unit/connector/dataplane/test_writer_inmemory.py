"""PushWriter on the in-memory NIXL stand-in: bytes, grouping, notification order, cancel and failure paths.

Real NIXL runs the same writer in tests/integration/dataplane; here the fabric lets a test hold transfers
in flight, complete them in any order and fail them, in milliseconds.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from kvpush.api.outcome import PushOutcome
from kvpush.dataplane.writer import PushWriter, WriteRequest
from tests.integration.dataplane.kvbuffers import block_bytes, make_kv
from tests.unit.connector.inmemory_helpers import new_fabric, started_agent

LAYERS, BLOCKS, BS, HEADS, HEAD = 4, 16, 16, 2, 16
BOUND_S = 5.0


class _Outcomes:
    def __init__(self) -> None:
        self.requests, self.transfers = [], []
        self._cv = threading.Condition()

    def on_request(self, outcome) -> None:
        with self._cv:
            self.requests.append(outcome)
            self._cv.notify_all()

    def on_transfer(self, outcome) -> None:
        with self._cv:
            self.transfers.append(outcome)
            self._cv.notify_all()

    def wait(self, predicate) -> bool:
        with self._cv:
            return self._cv.wait_for(predicate, BOUND_S)


def _pair(**kw):
    name, fab = new_fabric()
    p_layout, p_arrays, p_caches = make_kv(LAYERS, BLOCKS, BS, HEADS, HEAD, seed=1)
    d_layout, d_arrays, d_caches = make_kv(LAYERS, BLOCKS, BS, HEADS, HEAD, seed=None)
    prefill = started_agent(name, p_caches, BS, HEADS, HEAD, **kw)
    decode = started_agent(name, d_caches, BS, HEADS, HEAD)
    prefill.add_peer(decode.agent_name, decode.agent_metadata(), decode.layout).result(BOUND_S)
    out = _Outcomes()
    writer = PushWriter(prefill, out.on_request, out.on_transfer)
    return fab, prefill, decode, writer, out, (p_layout, p_arrays), (d_layout, d_arrays)


def _notifs(decode, count: int) -> list:
    got: list = []
    done = threading.Event()

    def on(agent, message) -> None:
        got.append(message)
        if len(got) >= count:
            done.set()

    decode.add_notification_callback(on)
    done.wait(BOUND_S)
    return got


def _request(peer, layer, notify=None, src=(3, 5), dst=(7, 2), tokens=2 * BS, ready_event=None):
    return WriteRequest("t1", peer, (layer,), src, dst, 0, tokens, notify=notify, ready_event=ready_event)


def test_every_layer_arrives_byte_exact_and_the_notification_after_the_last_write():
    """Scattered blocks of every layer land byte-exact; the transfer outcome is DONE with every write counted."""
    _fab, prefill, decode, writer, out, (pl, pa), (dl, da) = _pair()
    try:
        for layer in range(LAYERS):
            writer.submit(_request(decode.agent_name, layer, notify=b"t1" if layer == LAYERS - 1 else None))
        assert out.wait(lambda: out.transfers)
        (final,) = out.transfers
        assert final.outcome is PushOutcome.DONE and final.write_count == LAYERS and final.notified
        assert _notifs(decode, 1) == [b"t1"]
        for layer in range(LAYERS):
            for s, d in ((3, 7), (5, 2)):
                assert block_bytes(dl, da, layer, d) == block_bytes(pl, pa, layer, s)
        assert not da[0][0].any(), "an untouched block was written"
    finally:
        prefill.stop()
        decode.stop()


def test_notification_waits_for_every_handle_even_when_the_closing_one_lands_first():
    """NIXL does not order handles: with the closing write's handle done first, decode hears nothing until the
    earlier handle is done too, and then exactly once."""
    fab, prefill, decode, writer, out, *_ = _pair(max_group_writes=1)
    fab.hold = True
    received: list = []
    decode.add_notification_callback(lambda agent, message: received.append(message))
    try:
        writer.submit(_request(decode.agent_name, 0))
        writer.submit(_request(decode.agent_name, 1, notify=b"t1"))
        deadline = time.monotonic() + BOUND_S
        while len(fab.held()) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        first, closing = fab.held()
        assert closing.notification == b"", "the notification rode on a handle while another was in flight"
        fab.complete(closing)
        time.sleep(0.05)
        assert received == [] and not out.transfers
        fab.complete(first)
        assert out.wait(lambda: out.transfers)
        time.sleep(0.02)
        assert received == [b"t1"] and out.transfers[0].notified
    finally:
        fab.hold = False
        prefill.stop()
        decode.stop()


def test_writes_ready_together_share_one_handle():
    """A writer that fell behind posts the transfer's queued, ready writes on one handle."""
    gate = _Gate()
    fab, prefill, decode, writer, out, *_ = _pair()
    try:
        writer.submit(_request(decode.agent_name, 0, ready_event=gate))
        for layer in range(1, LAYERS):
            writer.submit(_request(decode.agent_name, layer, notify=b"t1" if layer == LAYERS - 1 else None))
        time.sleep(0.02)
        gate.set()
        assert out.wait(lambda: out.transfers)
        assert len(fab.posted) == 1 and out.requests[0].handle_write_count == LAYERS
    finally:
        prefill.stop()
        decode.stop()


def test_a_failed_transfer_fails_its_queued_writes_and_is_not_notified():
    """ERR on one handle fails the transfer: the write behind it is dropped, no notification goes out."""
    gate = _Gate()
    fab, prefill, decode, writer, out, *_ = _pair(max_group_writes=1)
    fab.fail_next_transfers(1)
    received: list = []
    decode.add_notification_callback(lambda agent, message: received.append(message))
    try:
        writer.submit(_request(decode.agent_name, 0))
        writer.submit(_request(decode.agent_name, 1, notify=b"t1", ready_event=gate))
        assert out.wait(lambda: out.transfers)
        gate.set()
        (final,) = out.transfers
        assert final.outcome is PushOutcome.FAILED and not final.notified
        assert [o.outcome for o in out.requests] == [PushOutcome.FAILED, PushOutcome.FAILED]
        assert "dropped" in out.requests[1].error
        time.sleep(0.02)
        assert received == []
    finally:
        prefill.stop()
        decode.stop()


def test_cancel_drops_queued_writes_waits_for_in_flight_and_refuses_later_ones():
    """cancel: queued writes end CANCELLED at once, the transfer's outcome waits for the handle in flight."""
    gate = _Gate()
    fab, prefill, decode, writer, out, *_ = _pair(max_group_writes=1)
    fab.hold = True
    try:
        writer.submit(_request(decode.agent_name, 0))
        writer.submit(_request(decode.agent_name, 1, ready_event=gate))
        deadline = time.monotonic() + BOUND_S
        while not fab.held() and time.monotonic() < deadline:
            time.sleep(0.001)
        cancelled = writer.cancel("t1")
        assert out.wait(lambda: out.requests)
        assert out.requests[0].outcome is PushOutcome.CANCELLED and not cancelled.done()
        fab.complete()
        final = cancelled.result(BOUND_S)
        assert final.outcome is PushOutcome.CANCELLED and final.write_count == 2
        writer.submit(_request(decode.agent_name, 2))
        assert out.wait(lambda: len(out.requests) == 3)
        assert out.requests[2].outcome is PushOutcome.FAILED and "already ended" in out.requests[2].error
    finally:
        fab.hold = False
        prefill.stop()
        decode.stop()


class _Gate:
    """A ready_event the test opens by hand (the writer polls query())."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def query(self) -> bool:
        return self._event.is_set()


def test_a_write_whose_post_guard_refuses_is_never_posted_and_fails_its_transfer():
    """post_guard (the prefill worker's lease) is asked at post time: a refusal posts nothing and fails the transfer."""
    _fab, prefill, decode, writer, out, _, (_dl, da) = _pair()
    try:
        refusal = ["lease gone"]
        request = WriteRequest("t1", decode.agent_name, (0,), (3, 5), (7, 2), 0, 2 * BS,
                               post_guard=lambda: refusal[0])
        writer.submit(request)
        assert out.wait(lambda: out.transfers)
        assert out.requests[0].outcome is PushOutcome.FAILED and "not posted: lease gone" in out.requests[0].error
        assert out.transfers[0].outcome is PushOutcome.FAILED
        assert not da[0].any(), "a refused write moved bytes"
    finally:
        prefill.stop()
        decode.stop()


def test_a_held_posted_write_cannot_be_cancelled_and_lands_late():
    """Fault knob fault_hold_posted_s: the write counts as in flight, cancel waits for it, its bytes land after the
    hold."""
    _fab, prefill, decode, writer, _out, (pl, pa), (dl, da) = _pair(fault_hold_posted_s=0.5, max_group_writes=1)
    try:
        started = time.monotonic()
        writer.submit(_request(decode.agent_name, 0))
        time.sleep(0.1)
        cancelled = writer.cancel("t1")
        assert not cancelled.done() and not da[0].any(), "the held write moved before its hold ended"
        final = cancelled.result(BOUND_S)
        assert time.monotonic() - started >= 0.5
        assert block_bytes(dl, da, 0, 7) == block_bytes(pl, pa, 0, 3)  # it landed, after the cancel
        assert final.write_count == 1
    finally:
        prefill.stop()
        decode.stop()


def test_fault_hold_from_token_holds_only_writes_reaching_past_it():
    """fault_hold_from_token: a write within the first tokens moves at once; one reaching past them is held."""
    _fab, prefill, decode, writer, out, (pl, pa), (dl, da) = _pair(fault_hold_posted_s=0.5, max_group_writes=1,
                                                                   fault_hold_from_token=BS)
    try:
        writer.submit(WriteRequest("t1", decode.agent_name, (0,), (3,), (7,), 0, BS))
        writer.submit(WriteRequest("t1", decode.agent_name, (1,), (3, 5), (7, 2), BS, 2 * BS, notify=b"t1"))
        time.sleep(0.2)
        assert block_bytes(dl, da, 0, 7) == block_bytes(pl, pa, 0, 3)  # tokens [0, BS): not held
        assert not da[1].any() and not out.transfers  # tokens [BS, 2 BS) of layer 1: held
        assert out.wait(lambda: out.transfers)
        assert block_bytes(dl, da, 1, 2) == block_bytes(pl, pa, 1, 5)
    finally:
        prefill.stop()
        decode.stop()


def test_a_held_write_past_the_write_bound_is_aborted_and_lands_nothing():
    """A posted write still in flight at transfer_timeout_s (max_write_s) is aborted: nothing of it lands later."""
    _fab, prefill, decode, writer, out, _, (_dl, da) = _pair(fault_hold_posted_s=5.0, transfer_timeout_s=0.3)
    try:
        writer.submit(_request(decode.agent_name, 0))
        assert out.wait(lambda: out.transfers)
        assert out.requests[0].outcome is PushOutcome.FAILED and "not done within 0.3s" in out.requests[0].error
        time.sleep(0.2)
        assert not da[0].any()
    finally:
        prefill.stop()
        decode.stop()


def _held_writes(fab, decode, writer, count: int) -> list:
    for layer in range(count):
        writer.submit(_request(decode.agent_name, layer, notify=b"t1" if layer == count - 1 else None))
    deadline = time.monotonic() + BOUND_S
    while len(fab.held()) < count and time.monotonic() < deadline:
        time.sleep(0.001)
    return fab.held()


def test_in_post_order_later_handles_are_checked_only_once_the_earlier_one_is_done():
    """check_in_post_order: while a transfer's oldest handle is in progress nothing after it is checked (one NIXL call
    per transfer per round), so a later handle that finished first is reported right after the earlier one."""
    fab, prefill, decode, writer, out, *_ = _pair(max_group_writes=1)
    checked: list = []
    check = prefill.nixl.check_xfer_state

    def counting_check(handle):
        checked.append(handle)
        return check(handle)

    prefill.nixl.check_xfer_state = counting_check  # type: ignore[method-assign]
    fab.hold = True
    try:
        first, second, closing = _held_writes(fab, decode, writer, 3)
        fab.complete(closing)
        fab.complete(second)
        time.sleep(0.05)
        assert checked and not out.requests, "a write after one still in progress was reported"
        assert len(set(map(id, checked))) == 1, "handles after the oldest one in progress were checked"
        fab.complete(first)
        assert out.wait(lambda: out.transfers)
        assert [r.layers for r in out.requests] == [(0,), (1,), (2,)]
        assert out.transfers[0].outcome is PushOutcome.DONE and out.transfers[0].notified
    finally:
        fab.hold = False
        prefill.stop()
        decode.stop()


def test_without_post_order_a_later_handle_is_reported_as_soon_as_it_is_done():
    """check_in_post_order off: every handle is checked each round; the transfer still ends only after all."""
    fab, prefill, decode, writer, out, *_ = _pair(max_group_writes=1, check_in_post_order=False)
    fab.hold = True
    try:
        first, second, _closing = _held_writes(fab, decode, writer, 3)
        fab.complete(second)
        assert out.wait(lambda: out.requests)
        assert [r.layers for r in out.requests] == [(1,)] and not out.transfers
        fab.complete(first)
        fab.hold = False
        fab.complete(_closing)
        assert out.wait(lambda: out.transfers)
        assert out.transfers[0].outcome is PushOutcome.DONE
    finally:
        fab.hold = False
        prefill.stop()
        decode.stop()


def test_a_write_past_the_bound_behind_one_in_progress_is_still_aborted(tmp_path):
    """A write skipped behind an earlier one in progress is still held to transfer_timeout_s."""
    fab, prefill, decode, writer, out, *_ = _pair(max_group_writes=1, transfer_timeout_s=0.3)
    fab.hold = True
    try:
        _held_writes(fab, decode, writer, 2)
        assert out.wait(lambda: out.transfers)
        assert out.transfers[0].outcome is PushOutcome.FAILED
        assert "not done within 0.3s" in (out.transfers[0].error or "")
    finally:
        fab.hold = False
        prefill.stop()
        decode.stop()


def test_the_io_trace_records_each_iteration_that_called_nixl(tmp_path):
    """io_trace_path: JSON lines per iteration with the calls it made and the handles seen done, written once idle."""
    import json

    path = tmp_path / "io-{pid}.jsonl"
    _fab, prefill, decode, writer, out, *_ = _pair(max_group_writes=1, io_trace_path=str(path))
    try:
        for layer in range(LAYERS):
            writer.submit(_request(decode.agent_name, layer, notify=b"t1" if layer == LAYERS - 1 else None))
        assert out.wait(lambda: out.transfers)
        traced = prefill.io_trace
        assert traced is not None
        deadline = time.monotonic() + BOUND_S
        rows: list = []
        while time.monotonic() < deadline:
            if Path(traced.path).exists():
                rows = [json.loads(line) for line in Path(traced.path).read_text().splitlines()]
                if sum(r.get("done", 0) for r in rows) >= LAYERS and sum(r.get("post", [0])[0] for r in rows) >= LAYERS:
                    break
            time.sleep(0.01)
        assert str(os.getpid()) in traced.path
        assert sum(r.get("post", [0])[0] for r in rows) == LAYERS, rows
        assert sum(r.get("done", 0) for r in rows) == LAYERS, rows
        assert all(r["t"] > 1e9 and r["late_ms"] >= 0 for r in rows)
        for r in rows:
            for kind in ("check", "post", "notif", "event"):
                if kind in r:
                    count, total_ms, longest_ms = r[kind]
                    assert count >= 1 and 0 <= longest_ms <= total_ms + 1e-3
    finally:
        prefill.stop()
        decode.stop()
