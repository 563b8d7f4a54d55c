"""The decode worker's inbox: callbacks from the directory loop and the NIXL I/O thread are queued here
and run at the next hook, so decode state is touched by the engine thread only. (The prefill worker has an
owner of its own instead: `worker/prefill.py`'s `PushOwner` on the I/O thread.)

On a step that schedules no tokens (vLLM still runs the connector hooks while requests only wait for
KV or hold blocks for pushes) a worker may wait on its inbox for a few milliseconds instead of
returning at once: vLLM would otherwise loop back into another empty step, and two engines doing so
on a small machine starve the prefill forward, the network and the connector's own threads of CPU.
The wait ends as soon as anything arrives, so it never delays a signal."""

from __future__ import annotations

import queue
from collections.abc import Callable

from structlog.typing import FilteringBoundLogger

# The queues an inbox may be: an action per message, run on the thread that drains it.
Inbox = queue.SimpleQueue[Callable[[], None]] | queue.Queue[Callable[[], None]]


def wait_for_actions(inbox: Inbox, timeout_s: float, log: FilteringBoundLogger, role: str) -> bool:
    """Block up to `timeout_s` (0: not at all) for the first queued action, then run it and every other;
    True if one came."""
    try:
        first = inbox.get(timeout=timeout_s)
    except queue.Empty:
        return False
    _run_action(first, log, role)
    run_queued_actions(inbox, log, role)
    return True


def run_queued_actions(inbox: Inbox, log: FilteringBoundLogger, role: str) -> None:
    """Run every queued action now; one that raises is logged and skipped, never stops the engine thread."""
    while True:
        try:
            action = inbox.get_nowait()
        except queue.Empty:
            return
        _run_action(action, log, role)


def _run_action(action: Callable[[], None], log: FilteringBoundLogger, role: str) -> None:
    try:
        action()
    except Exception:  # one bad message must not stop the engine thread
        log.exception(f"{role} connector action failed")
