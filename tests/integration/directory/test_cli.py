"""The `kvpush` CLI against a real `kvpush directory` process, with spans sent to a real OTLP receiver."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from kvpush.client import ChannelConfig, DirectoryClient, EngineRegistration, PrefillSession
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb
from tests.fixtures.directory import DECODE, PREFILL, ready, register_request, result
from tests.fixtures.otlp import OTLPReceiver
from tests.integration.directory.helpers import run

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"


class DirectoryProcess:
    """`python -m kvpush.cli.main directory` on a free port; stderr collected by a thread."""

    def __init__(self, env: dict[str, str], *flags: str) -> None:
        self.lines: list[str] = []
        self._serving = threading.Event()
        self.port = 0
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvpush.cli.main", "directory", "--port", "0", *flags],
            env={**os.environ, **env, "KVPUSH_LOG_FORMAT": "json"}, stderr=subprocess.PIPE, text=True)
        threading.Thread(target=self._collect, daemon=True).start()
        if not self._serving.wait(30):
            self.process.kill()
            raise TimeoutError(f"directory did not start: {self.lines}")

    def _collect(self) -> None:
        for line in self.process.stderr:
            self.lines.append(line)
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("event") == "directory serving":
                self.port = entry["port"]
                self._serving.set()

    @property
    def address(self) -> str:
        """host:port of the process."""
        return f"127.0.0.1:{self.port}"

    def stop(self) -> int:
        """SIGTERM, then wait (bounded) for the exit code."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(20)


def cli(*args: str) -> subprocess.CompletedProcess:
    """Run the kvpush CLI, bounded."""
    return subprocess.run([sys.executable, "-m", "kvpush.cli.main", *args], capture_output=True,
                          text=True, timeout=60)


@pytest.fixture
def receiver():
    """A real OTLP/gRPC trace receiver."""
    otlp = OTLPReceiver().start()
    yield otlp
    otlp.stop()


async def _one_transfer(address: str, complete: bool) -> str:
    """Drive one transfer through the directory with the client library; returns its id."""
    async with DirectoryClient(ChannelConfig(address=address)) as client:
        p_reg = EngineRegistration(client, register_request("p1", PREFILL, endpoint="http://p1:8000"))
        await p_reg.start()
        await client.register_engine(register_request("d1", DECODE))
        instructions: asyncio.Queue = asyncio.Queue()
        session = PrefillSession(client, p_reg, on_instruction=instructions.put_nowait)
        await session.start()
        tid = (await client.plan_transfer(request_id="req-1", traceparent=TRACEPARENT)).transfer.transfer_id
        await client.report_allocation(tid, "d1", [4, 5, 6], 40)
        session.send_ready([ready(tid, 0, 4)])
        await asyncio.wait_for(instructions.get(), 10)
        status = dpb.WRITE_RESULT_STATUS_DONE if complete else dpb.WRITE_RESULT_STATUS_FAILED
        session.send_result(result(tid, status, layers=4, bytes_written=2048, error="" if complete else "boom"))
        for _ in range(100):
            if (await client.get_transfer(tid)).state != tpb.TRANSFER_STATE_STREAMING:
                break
            await asyncio.sleep(0.05)
        await session.stop()
        await p_reg.stop(deregister=False)
        return tid


def test_cli_serves_inspects_and_exports_a_span_per_transfer(receiver):
    """`kvpush directory` serves; engines/transfers/health inspect it; each transfer is one span with its events."""
    directory = DirectoryProcess(receiver.env("kvpush-directory"), "--lease-ttl-s", "30")
    try:
        completed = run(_one_transfer(directory.address, complete=True))
        failed = run(_one_transfer(directory.address, complete=False))
        address = ("--address", directory.address)

        engines = cli("engines", "--json", *address)
        assert engines.returncode == 0, engines.stderr
        assert {(e["engine_id"], e["role"], e["tp_size"], e["layout"]["block_size_tokens"], e["layout"]["layer_count"],
                 e["layout"]["dtype"]) for e in json.loads(engines.stdout)} == {
            ("p1", "ENGINE_ROLE_PREFILL", 1, 16, 4, "bfloat16"), ("d1", "ENGINE_ROLE_DECODE", 1, 16, 4, "bfloat16")}
        table = cli("engines", *address)
        header, *rows = table.stdout.splitlines()
        assert header.split()[:3] == ["ENGINE", "ROLE", "RANK"]
        assert "http://p1:8000" in table.stdout
        # The layout columns planning pairs engines by: TP, layers, block size (tokens), dtype, hash ("-": none).
        columns = header.split()
        by_engine = {row.split()[0]: dict(zip(columns, row.split(), strict=False)) for row in rows}
        assert {engine: (c["TP"], c["LAYERS"], c["BLOCK_TOKENS"], c["DTYPE"], c["HASH"])
                for engine, c in by_engine.items()} == {"p1": ("1", "4", "16", "bfloat16", "-"),
                                                        "d1": ("1", "4", "16", "bfloat16", "-")}

        listed = json.loads(cli("transfers", "--json", *address).stdout)
        assert [t["transfer_id"] for t in listed] == [failed, completed]
        only = json.loads(cli("transfers", "--json", "--state", "complete", *address).stdout)
        assert [(t["transfer_id"], t["bytes_written"]) for t in only] == [(completed, "2048")]
        one = cli("transfers", failed, *address)
        assert one.returncode == 0 and "failed" in one.stdout and "boom" in one.stdout
        missing = cli("transfers", "ghost", *address)
        assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr
        assert cli("transfers", "--state", "nonsense", *address).returncode == 2
        health = cli("health", "--json", *address)
        assert health.returncode == 0 and json.loads(health.stdout) == {"status": "SERVING"}
    finally:
        code = directory.stop()
    assert code == 0 and any('"directory stopped"' in line for line in directory.lines)

    spans = receiver.wait_for(lambda got: len([s for s in got if s.name == "kvpush.directory.transfer"]) >= 2)
    by_id = {s.attributes["kvpush.transfer_id"]: s for s in spans if s.name == "kvpush.directory.transfer"}
    good, bad = by_id[completed], by_id[failed]
    assert good.service_name == "kvpush-directory"
    assert good.trace_id == TRACE_ID and good.parent_span_id == PARENT_SPAN_ID
    assert good.event_names == ["allocation", "first_readiness", "instruction", "completion"]
    assert good.attributes["kvpush.state"] == "TRANSFER_STATE_COMPLETE"
    assert good.attributes["kvpush.bytes_written"] == 2048
    assert good.attributes["kvpush.decode_engine_id"] == "d1" and good.status_code == 1  # STATUS_CODE_OK
    assert bad.status_code == 2 and "boom" in bad.attributes["kvpush.failure_reason"]  # STATUS_CODE_ERROR


def test_cli_refuses_bad_settings():
    """Invalid limits or env values exit with code 2 and a message, without serving."""
    bad = cli("directory", "--port", "0", "--lease-ttl-s", "0")
    assert bad.returncode == 2 and "lease_ttl_s" in bad.stderr
    env_bad = subprocess.run([sys.executable, "-m", "kvpush.cli.main", "directory"], capture_output=True,
                             text=True, timeout=60, env={**os.environ, "KVPUSH_DIRECTORY_PORT": "abc"})
    assert env_bad.returncode != 0 and "KVPUSH_DIRECTORY_PORT" in env_bad.stderr


def test_cli_with_a_tokens_file_serves_the_operator_and_refuses_engines(tmp_path):
    """`kvpush directory --tokens-file`: the operator's token lists engines; an engine's token may not."""
    tokens = tmp_path / "tokens"
    tokens.write_text("operator operator-token-0123456789\nengine/p1 p1-token-0123456789abcdef\n")
    process = DirectoryProcess({"OTEL_SDK_DISABLED": "true"}, "--tokens-file", str(tokens))
    try:
        assert any("per-engine identities from tokens file" in line for line in process.lines)
        listed = cli("engines", "--address", process.address, "--token", "operator-token-0123456789", "--json")
        assert listed.returncode == 0, listed.stderr
        refused = cli("engines", "--address", process.address, "--token", "p1-token-0123456789abcdef")
        assert refused.returncode == 1 and "PERMISSION_DENIED" in refused.stderr
        unknown = cli("engines", "--address", process.address, "--token", "not-a-token")
        assert unknown.returncode == 1 and "UNAUTHENTICATED" in unknown.stderr
    finally:
        assert process.stop() == 0
    bad = tmp_path / "bad"
    bad.write_text("root sometoken-0123456789\n")
    result = cli("directory", "--port", "0", "--tokens-file", str(bad))
    assert result.returncode == 1 and "neither 'operator'" in result.stderr
