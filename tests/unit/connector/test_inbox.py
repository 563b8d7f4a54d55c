"""The worker halves' inbox: actions run on the engine thread, in order; an idle step's wait is bounded."""

from __future__ import annotations

import queue
import threading
import time

from kvpush.connector.worker.inbox import run_queued_actions, wait_for_actions
from kvpush.observability import get_logger

_log = get_logger("test.inbox")


def test_actions_run_in_order_and_a_failing_one_is_skipped():
    """Every queued action runs once, FIFO; one that raises does not stop the others."""
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    ran: list[int] = []
    inbox.put(lambda: ran.append(1))
    inbox.put(lambda: 1 / 0)
    inbox.put(lambda: ran.append(3))
    run_queued_actions(inbox, _log, "test")
    assert ran == [1, 3]
    assert inbox.empty()


def test_wait_returns_false_after_the_bound_when_nothing_arrives():
    """With an empty inbox the wait ends at its bound and reports that nothing came."""
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    assert wait_for_actions(inbox, 0.01, _log, "test") is False


def test_wait_ends_when_an_action_arrives_and_runs_everything_in_order():
    """An action queued by another thread ends the wait; it and the ones behind it run, first one first."""
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    ran: list[str] = []

    def producer() -> None:
        time.sleep(0.05)
        inbox.put(lambda: ran.append("first"))
        inbox.put(lambda: ran.append("second"))

    thread = threading.Thread(target=producer)
    thread.start()
    assert wait_for_actions(inbox, 30.0, _log, "test") is True
    thread.join()
    run_queued_actions(inbox, _log, "test")
    assert ran == ["first", "second"]


def test_a_zero_bound_never_blocks_but_still_runs_what_is_queued():
    """idle_step_wait_s = 0 turns the wait into a plain drain."""
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    assert wait_for_actions(inbox, 0, _log, "test") is False
    ran: list[int] = []
    inbox.put(lambda: ran.append(1))
    assert wait_for_actions(inbox, 0, _log, "test") is True
    assert ran == [1]
