"""examples/custom_gateway.py against the real CPU stack: pushed-KV output equals the colocated engine's; a
failed leg cancels the transfer."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from kvpush.client import SyncDirectoryClient
from kvpush.localstack.client import call
from kvpush.localstack.processes import ManagedProcess, free_port, tcp_open
from kvpush.v1 import types_pb2 as tpb

pytestmark = pytest.mark.engines
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "custom_gateway.py"


@pytest.fixture(scope="module")
def custom_gateway(local_stack, tmp_path_factory):
    """The example gateway as its own process, pointed at the stack's directory."""
    port = free_port()
    # The example reads the directory channel's TLS files from the environment (ChannelConfig.from_env), as the
    # stack's own gateway does: the operator's certificate when the stack runs mutual TLS.
    process = ManagedProcess("custom-gateway", [sys.executable, str(EXAMPLE), "--directory",
                                                local_stack.directory.address, "--port", str(port)],
                             tmp_path_factory.mktemp("custom") / "custom-gateway.log",
                             env=local_stack.pki.client_env("operator") if local_stack.pki else {})
    process.start()
    process.wait_ready(lambda: tcp_open("127.0.0.1", port), 60)
    yield f"http://127.0.0.1:{port}"
    process.stop(grace_s=5.0)


def _transfer(local_stack, transfer_id: str) -> tpb.Transfer:
    client = SyncDirectoryClient(local_stack.directory_channel(timeout_s=5.0, max_attempts=2))
    try:
        return client.get_transfer(transfer_id)
    finally:
        client.close()


def test_custom_gateway_output_equals_colocated(local_stack, custom_gateway):
    """A 200-token prompt through the example gateway decodes the colocated engine's tokens; the push completed."""
    rng = random.Random(7)
    body = {"model": "tiny", "prompt": [rng.randrange(3, 1024) for _ in range(200)], "max_tokens": 8,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    answer = call("POST", custom_gateway + "/v1/completions", body, timeout_s=180)
    reference = call("POST", local_stack.colocated.url + "/v1/completions", body, timeout_s=180)
    assert answer.status == 200, answer.text
    assert answer.body["choices"][0]["token_ids"] == reference.body["choices"][0]["token_ids"]
    transfer = _transfer(local_stack, answer.headers["x-kvpush-transfer-id"])
    assert transfer.state == tpb.TRANSFER_STATE_COMPLETE, transfer.failure_reason
    assert transfer.prompt_token_count == 200 and transfer.bytes_written > 0


def test_custom_gateway_cancels_the_transfer_when_a_leg_fails(local_stack, custom_gateway):
    """A prompt over the engines' context fails both legs: the gateway answers 502 and the transfer is cancelled."""
    body = {"model": "tiny", "prompt": [5] * 5000, "max_tokens": 4}
    answer = call("POST", custom_gateway + "/v1/completions", body, timeout_s=60)
    assert answer.status == 502, answer.text
    client = SyncDirectoryClient(local_stack.directory_channel(timeout_s=5.0))
    try:
        transfers = client.list_transfers(limit=5)
    finally:
        client.close()
    latest = next(t for t in transfers if t.prompt_token_count == 5000)
    # Cancelled at once (by the gateway, or by decode refusing the request first), not left to its deadline.
    assert latest.state == tpb.TRANSFER_STATE_CANCELLED, tpb.TransferState.Name(latest.state)
    assert latest.end_time.ToNanoseconds() - latest.create_time.ToNanoseconds() < 10e9
