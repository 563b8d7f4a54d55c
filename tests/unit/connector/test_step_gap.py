"""The step-gap report: when an engine makes no step while pushes wait on it, the owner logs every thread's stack
once, naming the frame the engine thread is stuck in; a step ends the gap."""

from __future__ import annotations

import threading
import time

from kvpush.connector.metadata import KVPushMetadata
from kvpush.connector.worker.step_gap import StepGapWatch, thread_stacks
from tests.unit.connector.test_prefill_worker import LAYERS, _step, _worker


class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def warning(self, event: str, **fields) -> None:
        self.lines.append((event, fields))


def _stuck_in_a_hook(release: threading.Event) -> None:
    release.wait(10)


def test_a_step_gap_while_pushes_wait_logs_each_threads_stack_once_and_a_step_ends_it():
    release = threading.Event()
    stuck = threading.Thread(target=_stuck_in_a_hook, args=(release,), name="engine-forward")
    stuck.start()
    try:
        log = _Log()
        watch = StepGapWatch(log, report_after_s=10.0)
        watch.stepped(100.0)
        assert not watch.check(109.9, waiting_transfer_count=1)
        assert not watch.check(200.0, waiting_transfer_count=0)  # nothing waits on the engine: an idle engine
        assert watch.check(110.5, waiting_transfer_count=2)
        assert not watch.check(130.0, waiting_transfer_count=2)  # once per gap
        ((event, fields),) = log.lines
        assert "no step" in event and fields["step_gap_s"] == 10.5 and fields["waiting_transfer_count"] == 2
        (frames,) = [frames for name, frames in fields["stacks"].items() if name.startswith("engine-forward")]
        assert any("_stuck_in_a_hook" in frame for frame in frames)
        watch.stepped(131.0)
        assert log.lines[-1] == ("engine stepping again", {"step_gap_s": 31.0})
        assert watch.check(141.5, waiting_transfer_count=1)  # a new gap is reported again
    finally:
        release.set()
        stuck.join(5)


def test_thread_stacks_name_every_thread_innermost_frame_last():
    stacks = thread_stacks(frames_per_thread=3)
    (mine,) = [frames for name, frames in stacks.items() if name.startswith(threading.current_thread().name)]
    assert len(mine) == 3 and "thread_stacks" in mine[-1]


def test_the_prefill_owner_reports_a_step_gap_while_a_push_waits_for_its_hold():
    """Every layer saved, the push waits for the hold that a later step brings; no step comes for 10 s."""
    worker, _transport, _directory, loop = _worker()
    log = _Log()
    worker.owner._step_gap._log = log
    worker.begin_step(_step(40))
    for layer in LAYERS:
        worker.save_kv_layer(layer)
    worker.wait_for_save()
    loop.run()
    started = time.monotonic()
    loop.run(now=started + 5)
    assert log.lines == []
    loop.run(now=started + 11)
    assert [event for event, _ in log.lines] == ["engine made no step while transfers wait on it; every thread's "
                                                 "stack follows"]
    worker.begin_step(KVPushMetadata(held_prefills=["r1"]))
    loop.run()
    assert [event for event, _ in log.lines][1:] == ["engine stepping again"]
