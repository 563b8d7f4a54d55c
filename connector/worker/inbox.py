"""The worker halves' inbox: callbacks from the directory loop and the NIXL I/O thread are queued here
and run on the engine's forward thread at the next hook, so worker state has one owner thread."""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any


def run_queued_actions(inbox: "queue.SimpleQueue[Callable[[], None]] | queue.Queue", log: Any, role: str) -> None:
    """Run every queued action now; one that raises is logged and skipped, never stops the engine thread."""
    while True:
        try:
            action = inbox.get_nowait()
        except queue.Empty:
            return
        try:
            action()
        except Exception:  # one bad message must not stop the engine thread
            log.exception(f"{role} connector action failed")
