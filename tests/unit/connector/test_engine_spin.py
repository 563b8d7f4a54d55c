"""The connector's pacing of vLLM's message-queue busy-wait, on vLLM's real SpinCondition."""

from __future__ import annotations

import os
import time

import pytest

shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")
zmq = pytest.importorskip("zmq")

from kvpush.connector.engine_spin import pace_message_queue_spin


@pytest.fixture
def reader():
    """A real SpinCondition reader with its writer, and vLLM's original wait restored afterwards."""
    original_wait = shm_broadcast.SpinCondition.wait
    context = zmq.Context()
    address = f"ipc:///tmp/kvpush-spin-test-{os.getpid()}"
    writer = shm_broadcast.SpinCondition(is_reader=False, context=context, notify_address=address)
    reader = shm_broadcast.SpinCondition(is_reader=True, context=context, notify_address=address)
    yield reader, writer
    shm_broadcast.SpinCondition.wait = original_wait
    for condition in (reader, writer):
        for sock in ("local_notify_socket", "read_cancel_socket", "write_cancel_socket"):
            if getattr(condition, sock, None) is not None:
                getattr(condition, sock).close(linger=0)
    context.term()


def _count_yields(monkeypatch) -> list[int]:
    calls = [0]
    real = os.sched_yield

    def counting_yield() -> None:
        calls[0] += 1
        real()

    monkeypatch.setattr(os, "sched_yield", counting_yield)
    return calls


def test_unpaced_reader_spins_on_sched_yield(reader, monkeypatch):
    """The behaviour being fixed: inside vLLM's busy window every wait is a sched_yield."""
    spin, _ = reader
    yields = _count_yields(monkeypatch)
    spin.record_read()
    for _ in range(50):
        spin.wait(timeout_ms=1000)
    assert yields[0] == 50


def test_paced_reader_sleeps_instead_of_yielding(reader, monkeypatch):
    """Inside the busy window a paced wait sleeps poll_s (GIL released) and never yields."""
    spin, _ = reader
    yields = _count_yields(monkeypatch)
    assert pace_message_queue_spin(0.002)
    spin.record_read()
    started = time.monotonic()
    for _ in range(10):
        spin.wait(timeout_ms=1000)
    assert time.monotonic() - started >= 10 * 0.002
    assert yields[0] == 0


def test_paced_reader_still_parks_and_wakes_on_notify_after_the_window(reader):
    """Past the busy window vLLM's own wait runs: it parks on the socket and a notify wakes it."""
    spin, writer = reader
    assert pace_message_queue_spin(0.0001)
    spin.last_read = time.monotonic() - 10 * spin.busy_loop_s
    time.sleep(0.2)  # let the SUB socket connect before the notify
    writer.notify()
    started = time.monotonic()
    spin.wait(timeout_ms=5000)
    assert time.monotonic() - started < 2.0  # woken by the notify, not the 5 s timeout


def test_pacing_twice_only_moves_the_pace_and_none_leaves_vllm_alone(reader):
    """A second call (scheduler and worker halves in one process) does not wrap twice; None changes nothing."""
    before = shm_broadcast.SpinCondition.wait
    assert pace_message_queue_spin(None) is False
    assert shm_broadcast.SpinCondition.wait is before
    assert pace_message_queue_spin(0.0001)
    wrapped = shm_broadcast.SpinCondition.wait
    assert pace_message_queue_spin(0.0005)
    assert shm_broadcast.SpinCondition.wait is wrapped
    with pytest.raises(ValueError):
        pace_message_queue_spin(0.5)
