"""The prefill scheduler half tells its worker half when a step's output leaves, where both share one process.

vLLM's UniProcExecutor (one GPU) runs the worker in the engine core's process, on the engine-core thread. There
the scheduler half's `take_events` (the last connector call of `update_from_output`, right before the step's
outputs go to vLLM's output thread) says which step's sampled tokens are leaving, so a launch-bound step's push
can wait for them (`PrefillWorker.output_left`, ConnectorConfig.post_after_output). A worker process of its own
(MultiprocExecutor: TP > 1, vLLM's CPU platform) offers nothing here and never defers.

vLLM builds the worker (register_kv_caches) before the scheduler, so the worker offers itself and the scheduler
claims it. Two workers of one engine id in a process are ambiguous: neither is claimed.
"""

from __future__ import annotations

import threading
from typing import Protocol

_lock = threading.Lock()


class OutputDeferringWorker(Protocol):
    """What the scheduler half asks of its in-process prefill worker half (`PrefillWorker`)."""

    def defers_to_output(self) -> bool:
        """From now on launch-bound steps push after their output left; True if they can."""
        ...

    def output_left(self, step_seq: int) -> None:
        """Step `step_seq`'s sampled tokens are leaving."""
        ...


_offered: dict[str, OutputDeferringWorker] = {}
_ambiguous: set[str] = set()


def offer_prefill_worker(engine_id: str, worker: OutputDeferringWorker) -> None:
    """Caller: a prefill worker half as it is built (register_kv_caches)."""
    with _lock:
        if engine_id in _offered or engine_id in _ambiguous:
            _offered.pop(engine_id, None)
            _ambiguous.add(engine_id)
            return
        _offered[engine_id] = worker


def claim_prefill_worker(engine_id: str) -> OutputDeferringWorker | None:
    """Caller: the prefill scheduler half as it is built. The worker of this engine in this process, once."""
    with _lock:
        return _offered.pop(engine_id, None)
