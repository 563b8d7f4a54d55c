"""`kvpush up`: the stack comes up, prints its URLs and API key, serves a request with the key (401 without),
`kvpush engines` finds its directory without flags, and Ctrl-C stops every process it started and removes its state
file."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvpush.localstack.client import call
from kvpush.localstack.model import TinyModelSpec, ensure_tiny_model

CLI = [sys.executable, "-c", "import sys; from kvpush.cli.main import main; sys.exit(main())"]

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


def test_up_serves_until_sigint_then_stops_everything(tmp_path):
    """`kvpush up --model PATH` prints the gateway URL, the API key once and examples; a request through it needs the
    key; `kvpush engines` without flags lists its engines (the state file, the user's alone); SIGINT exits 0, removes
    the state file and leaves no process of the stack (engines' EngineCore children included) behind."""
    model_dir = ensure_tiny_model(TinyModelSpec())  # a local model folder, served under its folder's name
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "XDG_RUNTIME_DIR": str(tmp_path)}
    env.pop("KVPUSH_DIRECTORY_ADDRESS", None)
    process = subprocess.Popen([*CLI, "up", "--model", str(model_dir)], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env)
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
    state_file = tmp_path / "kvpush" / "up.json"
    try:
        assert up.wait(600) and process.poll() is None, "stack did not come up:\n" + "".join(output[-40:])
        text = "".join(output)
        gateway = re.search(r"gateway \(OpenAI API\)\s+(http://\S+)/v1", text).group(1)
        sessions = {int(pid) for pid in re.findall(r"\b[a-z]+ (\d+)", re.search(r"processes\s+(.*)", text).group(1))}
        assert len(sessions) == 4, text  # directory, prefill, decode, gateway
        key = re.search(r"export OPENAI_API_KEY=(\S+)", text).group(1)
        assert text.count(key) == 1, "the key is printed once"
        assert f"curl -s {gateway}/v1/completions" in text and "from openai import OpenAI" in text

        state = json.loads(state_file.read_text())
        assert stat.S_IMODE(state_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(state_file.parent.stat().st_mode) == 0o700
        assert (state["api_key"], state["gateway_url"], state["model"]) == (key, gateway, model_dir.name)

        body = {"model": model_dir.name, "prompt": "The capital of France is", "max_tokens": 4}
        refused = call("POST", gateway + "/v1/completions", body, timeout_s=60)
        assert refused.status == 401, refused.text
        answer = call("POST", gateway + "/v1/completions", body, headers={"Authorization": f"Bearer {key}"},
                      timeout_s=120)
        assert answer.status == 200, answer.text
        assert answer.headers["x-kvpush-transfer-id"]

        engines = subprocess.run([*CLI, "engines", "--json"], capture_output=True, text=True, env=env, timeout=60)
        assert engines.returncode == 0, engines.stderr
        listed = json.loads(engines.stdout)
        assert sorted(e["role"] for e in listed) == ["ENGINE_ROLE_DECODE", "ENGINE_ROLE_PREFILL"], listed
        assert {e["model"] for e in listed} == {model_dir.name}
        transfers = subprocess.run([*CLI, "transfers", "--json"], capture_output=True, text=True, env=env, timeout=60)
        assert transfers.returncode == 0, transfers.stderr
        assert answer.headers["x-kvpush-transfer-id"] in {t["transfer_id"] for t in json.loads(transfers.stdout)}

        process.send_signal(signal.SIGINT)
        assert process.wait(120) == 0, "".join(output[-20:])
        reader.join(10)
        assert "stopped." in "".join(output)
        assert not state_file.exists()
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
