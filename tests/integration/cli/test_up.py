"""`kvpush up`: the stack comes up, prints its URLs, serves a request, and Ctrl-C stops every process it started."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvpush.localstack.client import call

pytestmark = pytest.mark.engines


def _sessions_alive(session_ids: set[int]) -> list[str]:
    """Processes (pid: command) whose session is one of `session_ids` (every launched child leads its own)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z" and int(fields[3]) in session_ids:  # state, ppid, pgrp, session
            alive.append(f"{entry.name}: {stat[:stat.rindex(')') + 1]}")
    return alive


def test_up_serves_until_sigint_then_stops_everything():
    """`kvpush up` prints the gateway URL and examples; a request through it works; SIGINT exits 0 and leaves
    no process of the stack (engines' EngineCore children included) behind."""
    process = subprocess.Popen([sys.executable, "-c", "import sys; from kvpush.services.cli.main import main; "
                                "sys.exit(main())", "up"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    output: list[str] = []
    up = threading.Event()

    def read() -> None:
        for line in process.stdout:
            output.append(line)
            if "Ctrl-C stops everything." in line:
                up.set()
        up.set()  # the process ended: stop waiting (the assertion below says why)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    sessions: set[int] = set()
    try:
        assert up.wait(600) and process.poll() is None, "stack did not come up:\n" + "".join(output[-40:])
        text = "".join(output)
        gateway = re.search(r"gateway \(OpenAI API\)\s+(http://\S+)/v1", text).group(1)
        sessions = {int(pid) for pid in re.findall(r"\b[a-z]+ (\d+)", re.search(r"processes\s+(.*)", text).group(1))}
        assert len(sessions) == 4, text  # directory, prefill, decode, gateway
        assert f"curl -s {gateway}/v1/completions" in text and "from openai import OpenAI" in text
        answer = call("POST", gateway + "/v1/completions",
                      {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 4}, timeout_s=120)
        assert answer.status == 200, answer.text
        assert answer.headers["x-kvpush-transfer-id"]
        process.send_signal(signal.SIGINT)
        assert process.wait(120) == 0, "".join(output[-20:])
        reader.join(10)
        assert "stopped." in "".join(output)
        deadline = time.monotonic() + 10
        while _sessions_alive(sessions) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _sessions_alive(sessions), _sessions_alive(sessions)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
        for sid in sessions:
            try:
                os.killpg(sid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
