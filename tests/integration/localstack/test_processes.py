"""Process launchers: readiness waits are bounded and explain failures; stop leaves no process behind."""

from __future__ import annotations

import os
import sys
import time

import pytest

from kvpush.localstack.processes import ManagedProcess, ProcessStartError, ReadinessTimeout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purpose.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"


def test_stop_kills_the_whole_process_group(tmp_path):
    """Children forked by the process (like vLLM's EngineCore) die with it, even if they ignore SIGTERM."""
    script = ("import os, signal, subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
              "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)'])\n"
              "print(child.pid, flush=True)\n"
              "time.sleep(300)\n")
    proc = ManagedProcess("parent", [sys.executable, "-c", script], tmp_path / "parent.log").start()
    proc.wait_ready(lambda: (tmp_path / "parent.log").read_text().strip().splitlines()[-1].isdigit(), 10,
                    poll_s=0.1)
    child_pid = int((tmp_path / "parent.log").read_text().strip().splitlines()[-1])
    assert _alive(child_pid)
    proc.stop(grace_s=1.0)
    deadline = time.monotonic() + 5
    while _alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child_pid)
    assert not proc.alive()


def test_early_exit_is_reported_with_the_log_tail(tmp_path):
    """A process that dies before it is ready raises ProcessStartError quoting its log."""
    proc = ManagedProcess("crasher", [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"],
                          tmp_path / "crasher.log").start()
    with pytest.raises(ProcessStartError, match="exited with code 3") as caught:
        proc.wait_ready(lambda: False, 10, poll_s=0.05)
    assert "no model here" in str(caught.value)


def test_readiness_timeout_is_bounded_and_reports_progress(tmp_path):
    """A process that never becomes ready raises ReadinessTimeout after the bound, reporting progress meanwhile."""
    proc = ManagedProcess("sleeper", [sys.executable, "-c", "print('loading...', flush=True); import time; "
                                      "time.sleep(60)"], tmp_path / "sleeper.log").start()
    reports: list[str] = []
    started = time.monotonic()
    try:
        with pytest.raises(ReadinessTimeout, match="not ready after 1 s"):
            proc.wait_ready(lambda: False, 1.0, poll_s=0.1, progress=reports.append, progress_every_s=0.3)
    finally:
        proc.stop(grace_s=1.0)
    assert time.monotonic() - started < 5
    assert reports and "sleeper: waiting" in reports[0]


def test_namespace_and_cpu_wrappers_compose(tmp_path):
    """A process placed in a namespace and on CPUs runs as `ip netns exec NS taskset -c CPUS cmd`."""
    proc = ManagedProcess("placed", ["cmd", "arg"], tmp_path / "placed.log", netns="ns1", cpus="0")
    assert proc.full_argv() == ["ip", "netns", "exec", "ns1", "taskset", "-c", "0", "cmd", "arg"]
