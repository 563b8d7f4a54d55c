"""NIXL's binding hands the GIL back while it makes and posts a WRITE: the I/O thread's posts leave the engine's other
threads free to run Python (the post policies of docs/connector.md rest on what a post costs the forward thread).

Real UCX agents built by `create_nixl_agent`, in this process. No timing: with a switch interval longer than the
test, the eval loop never takes the GIL from the poster, so a counter thread can run only while the poster released
it. The counter ran inside a call exactly when its count moved across the call.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from kvpush.dataplane.config import NixlConfig, create_nixl_agent
from kvpush.dataplane.nixl_api import DlistHandle, NixlAgentApi

pytestmark = pytest.mark.nixl

_BLOCK = 4096
_DESCRIPTORS = 1000
_BLOCKS = 2 * _DESCRIPTORS
_NOTIF_WAIT_S = 30.0
# Bounds on tries, not on durations: a loaded machine may take many calls before the counter gets a core in one.
_TRY_FOR_S = 20.0


class _Counter:
    """A thread that counts, handing the GIL back after each count (time.sleep releases it)."""

    def __init__(self) -> None:
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gil-test-counter", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.count += 1
            time.sleep(0)

    def ran_inside(self, call: Callable[[], Any]) -> tuple[bool, Any]:
        """(whether the counter ran while `call` ran, its value)."""
        before = self.count
        value = call()
        return self.count != before, value


@contextmanager
def _voluntary_counter() -> Iterator[_Counter]:
    previous = sys.getswitchinterval()
    # Longer than any call here takes, so never a forced hand-over inside one; short enough that a waiting thread the
    # counter keeps beating to the GIL (hand-overs are not fair) gets it within that.
    sys.setswitchinterval(10.0)
    counter = _Counter()
    counter.start()
    try:
        yield counter
    finally:
        counter.stop()
        sys.setswitchinterval(previous)


@dataclass
class _Pair:
    source: NixlAgentApi
    target: NixlAgentApi
    src: np.ndarray
    dst: np.ndarray
    local: DlistHandle
    remote: DlistHandle


@pytest.fixture(scope="module")
def pair() -> Iterator[_Pair]:
    source = create_nixl_agent("gil-test-src", NixlConfig())
    target = create_nixl_agent("gil-test-dst", NixlConfig())
    src = np.random.default_rng(7).integers(0, 256, _BLOCKS * _BLOCK, dtype=np.uint8)
    dst = np.zeros(_BLOCKS * _BLOCK, dtype=np.uint8)
    source.register_memory(np.array([[src.ctypes.data, src.nbytes, 0]], dtype=np.uint64), "DRAM")
    target.register_memory(np.array([[dst.ctypes.data, dst.nbytes, 0]], dtype=np.uint64), "DRAM")
    source.add_remote_agent(target.get_agent_metadata())

    def rows(base: int) -> np.ndarray:
        return np.array([[base + i * _BLOCK, _BLOCK, 0] for i in range(_BLOCKS)], dtype=np.uint64)

    local = source.prep_xfer_dlist("NIXL_INIT_AGENT", rows(src.ctypes.data), "DRAM")
    remote = source.prep_xfer_dlist("gil-test-dst", rows(dst.ctypes.data), "DRAM")
    yield _Pair(source, target, src, dst, local, remote)
    source.release_dlist_handle(local)
    source.release_dlist_handle(remote)
    source.remove_remote_agent("gil-test-dst")


def _blocks(buffer: np.ndarray, indices: np.ndarray) -> np.ndarray:
    return buffer.reshape(_BLOCKS, _BLOCK)[indices]


def test_a_python_loop_never_lets_the_counter_in():
    """The method's control: with no forced switching, a call that keeps the GIL shows no count, however long."""
    with _voluntary_counter() as counter:
        time.sleep(0.05)  # the counter is running
        assert [counter.ran_inside(lambda: sum(range(200_000)))[0] for _ in range(10)] == [False] * 10


@pytest.mark.parametrize("notification", [b"", b"gil-test-notif"], ids=["plain", "with-notif"])
def test_the_counter_runs_inside_a_post(pair: _Pair, notification: bytes):
    pair.dst[:] = 0
    indices = np.arange(0, _BLOCKS, 2, dtype=np.int32)  # every other block: 1,000 descriptors, none merged
    posts = 0
    ran = False
    received: list[bytes] = []

    def progress_target() -> None:  # no progress thread: the target's worker moves when polled, as the I/O thread does
        received.extend(pair.target.get_new_notifs().get("gil-test-src", []))

    with _voluntary_counter() as counter:
        deadline = time.monotonic() + _TRY_FOR_S
        while not ran and time.monotonic() < deadline:
            handle = pair.source.make_prepped_xfer("WRITE", pair.local, indices, pair.remote, indices)
            ran, state = counter.ran_inside(lambda handle=handle: pair.source.transfer(handle, notification))
            posts += 1
            while state == "PROC":
                time.sleep(0.0005)
                progress_target()
                state = pair.source.check_xfer_state(handle)
            assert state == "DONE"
            pair.source.release_xfer_handle(handle)
    assert ran, f"no post of {posts} let another thread run"
    assert np.array_equal(_blocks(pair.dst, indices), _blocks(pair.src, indices))
    assert not _blocks(pair.dst, indices + 1).any()
    deadline = time.monotonic() + _NOTIF_WAIT_S
    while notification and len(received) < posts and time.monotonic() < deadline:
        progress_target()
        time.sleep(0.001)
    assert received == [notification] * (posts if notification else 0)


def test_the_counter_runs_inside_a_make_prepped_xfer(pair: _Pair):
    indices = np.arange(0, _BLOCKS, 2, dtype=np.int32)
    makes = 0
    ran = False
    with _voluntary_counter() as counter:
        deadline = time.monotonic() + _TRY_FOR_S
        while not ran and time.monotonic() < deadline:
            ran, handle = counter.ran_inside(
                lambda: pair.source.make_prepped_xfer("WRITE", pair.local, indices, pair.remote, indices))
            makes += 1
            pair.source.release_xfer_handle(handle)
            time.sleep(0.0002)  # the counter waits for the GIL again, not for a core
    assert ran, f"no make_prepped_xfer of {makes} let another thread run"
