"""Pace vLLM's message-queue busy-wait in the processes that host the connector.

Why: vLLM's shared-memory `MessageQueue` readers (`SpinCondition` in `shm_broadcast`) spin on
`os.sched_yield()` for `busy_loop_s` (1 s) after every message before they park on a notify socket.
While an engine steps, a message arrives every step, so the worker (waiting for the next step) and the
EngineCore (waiting for the worker's output) spin from the first token to the last. Each spin releases
the GIL for about a microsecond; a thread woken for the GIL finds it taken again, and because the holder
keeps changing CPython never forces a switch to it. On a loaded machine every other Python thread of the
process starves: on the 2-core CPU machine a prefill worker's lease went 66 s without a renewal while two
engines stepped, its readiness events and NIXL posts stood still, and transfers failed "lease expired".

Parking at once instead (busy_loop_s = 0) is no cure: vLLM's notify socket drops wake-ups under load,
and each lost one costs a 5 s recheck (measured: 12-token requests took 30-40 s).

So the connector keeps vLLM's spin window and only changes what one spin does: it sleeps instead of
yielding, which leaves the GIL free almost all the time. The sleep starts at `message_queue_poll_s`
(default 100 µs) after each message and doubles up to 1 ms while none comes: a reader waiting out a long
forward pass (the EngineCore during a 1 s prefill) then wakes ~1,000 times a second instead of 10,000,
which matters when it shares a core with that forward. `None` leaves vLLM's behaviour untouched.
vLLM 0.32 / 0.33 have no setting for this, so `SpinCondition.wait` is wrapped once per process; when a
vLLM version lacks the attributes used here the original wait runs unchanged.
"""

from __future__ import annotations

import time
from typing import Protocol

from kvpush.observability import get_logger

_log = get_logger("connector.engine_spin")
_PACE_ATTRIBUTE = "_kvpush_poll_s"
_MAX_SLEEP_S = 0.001


class _PacedSpin(Protocol):
    """The pacing state kept on a vLLM `SpinCondition` (vLLM's own attributes are read with getattr and a default:
    its internals are not a typed API)."""

    _kvpush_last_read: object
    _kvpush_sleep_s: float


def pace_message_queue_spin(poll_s: float | None) -> bool:
    """Make this process's vLLM message-queue readers sleep `poll_s` per spin; True when in force."""
    if poll_s is None:
        return False
    if not 0 < poll_s <= 0.01:
        raise ValueError(f"poll_s must be in (0, 0.01] seconds, got {poll_s}")
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:
        return False
    spin_condition = getattr(shm_broadcast, "SpinCondition", None)
    wait = getattr(spin_condition, "wait", None)
    if spin_condition is None or wait is None:
        _log.warning("vLLM has no SpinCondition.wait; its message-queue spin is left as is "
                     "(the connector's threads may be starved of the GIL while the engine steps)")
        return False
    if hasattr(wait, _PACE_ATTRIBUTE):  # already wrapped in this process: only change the pace
        setattr(wait, _PACE_ATTRIBUTE, poll_s)
        return True

    def paced_wait(self: _PacedSpin, *args: object, **kwargs: object) -> object:
        last_read = getattr(self, "last_read", None)
        busy_loop_s = getattr(self, "busy_loop_s", None)
        if (getattr(self, "is_reader", False) and last_read is not None and busy_loop_s is not None
                and time.monotonic() <= last_read + busy_loop_s):
            base: float = getattr(paced_wait, _PACE_ATTRIBUTE)
            if getattr(self, "_kvpush_last_read", None) != last_read:  # a message came: short sleeps again
                self._kvpush_last_read = last_read
                self._kvpush_sleep_s = base
            pause = self._kvpush_sleep_s
            self._kvpush_sleep_s = min(pause * 2, max(_MAX_SLEEP_S, base))
            time.sleep(pause)  # releases the GIL for the whole pause
            return None
        return wait(self, *args, **kwargs)

    setattr(paced_wait, _PACE_ATTRIBUTE, poll_s)
    paced_wait.__doc__ = wait.__doc__
    spin_condition.wait = paced_wait
    _log.info("vLLM message-queue spin paced", poll_s=poll_s)
    return True
