"""Gateway failover and leg timeouts: a real gateway and directory, one prefill and two decode stand-in engines.

An engine that cannot be reached is reported to the directory and the request is planned again on another
engine; leg timeouts are 504s with an OpenAI error body. The same with real vLLM engines, one SIGKILLed:
tests/integration/reliability/test_failover.py.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from kvpush.client import ChannelConfig, SyncDirectoryClient
from kvpush.localstack.client import call, stream_completion
from kvpush.localstack.processes import free_port, start_directory, start_gateway, tail
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb
from tests.unit.services.gateway.standin import StandInEngine
from tests.unit.services.gateway.test_gateway import _layout

PREFILL_ID, DECODE_A, DECODE_B = "standin-prefill", "standin-decode-a", "standin-decode-b"


def _metric(gateway_url: str, name: str, **labels: str) -> float:
    """One sample of the gateway's /metrics (0 when absent)."""
    with urllib.request.urlopen(gateway_url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
        if match and ",".join(sorted((match.group(1) or "").split(","))) == want:
            return float(match.group(2))
    return 0.0


class TwoDecodes:
    """A directory, a stand-in prefill and two stand-in decode engines (a is planned first while both are up)."""

    def __init__(self, log_dir: Path, gateway_args: tuple[str, ...] = ()) -> None:
        self.log_dir = log_dir
        self.directory = start_directory(log_dir)
        self.client = SyncDirectoryClient(ChannelConfig(address=self.directory.address, timeout_s=5.0))
        self.engines: dict[str, StandInEngine] = {}
        self.registrations = {}
        for engine_id, role in ((PREFILL_ID, tpb.ENGINE_ROLE_PREFILL), (DECODE_A, tpb.ENGINE_ROLE_DECODE),
                                (DECODE_B, tpb.ENGINE_ROLE_DECODE)):
            self.start_engine(engine_id, role)
        self.gateway = start_gateway(log_dir, directory_address=self.directory.address, extra_args=[
            "--prefill-timeout", "3", "--decode-timeout", "3", "--no-first-token-from-prefill",
            "--max-failovers", "2", *gateway_args])

    def start_engine(self, engine_id: str, role: int, port: int = 0) -> None:
        """Serve a stand-in (on `port` when given) and register it, keeping its lease alive."""
        engine = StandInEngine(engine_id, port=port).start()
        self.engines[engine_id] = engine
        self.registrations[engine_id] = self.client.start_registration(dpb.RegisterEngineRequest(
            engine_id=engine_id, role=role, tp_rank=0, tp_size=1, agent_name=f"agent-{engine_id}",
            agent_metadata=b"standin-metadata", layout=_layout(), endpoint=engine.url, model="tiny"))

    def kill(self, engine_id: str) -> int:
        """As a SIGKILL would: the port stops answering and the lease is no longer renewed; returns the port."""
        engine = self.engines[engine_id]
        self.client.run(self.registrations[engine_id].stop(deregister=False))
        engine.stop()
        return engine.port

    def reset(self) -> None:
        for engine in self.engines.values():
            engine.legs.clear()
            engine.behaviour = None

    def engine(self, engine_id: str) -> tpb.EngineWorker:
        return self.client.get_engine(engine_id)[0]

    def stop(self) -> None:
        self.gateway.process.stop(grace_s=5.0)
        for engine_id, registration in self.registrations.items():
            self.client.run(registration.stop(deregister=False))
            self.engines[engine_id].stop()
        self.client.close()
        self.directory.process.stop(grace_s=5.0)


@pytest.fixture
def stack(tmp_path):
    """A fresh two-decode deployment per test (a killed engine stays killed)."""
    deployment = TwoDecodes(tmp_path)
    yield deployment
    deployment.stop()


def _complete(stack, body: dict, stream: bool = False):
    """One request through the gateway; its transfer is then cancelled (stand-ins never end one), so both
    decode engines keep equal transfer counts and a stays the directory's first choice while reachable."""
    url = stack.gateway.url + "/v1/completions"
    result = stream_completion(url, body, timeout_s=30) if stream else call("POST", url, body, timeout_s=30)
    transfer_id = result.headers.get("x-kvpush-transfer-id")
    if transfer_id:
        stack.client.cancel_transfer(transfer_id, "test done")
    return result


def test_a_dead_decode_engine_is_reported_and_requests_fail_over(stack):
    """With decode a refusing connections, every request succeeds on b: the first one fails over once (a is
    reported and listed unreachable), later ones are planned on b at once; once a renews, it is planned again."""
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4}
    assert _complete(stack, body).status == 200
    assert len(stack.engines[DECODE_A].legs) == 1 and not stack.engines[DECODE_B].legs
    port = stack.kill(DECODE_A)
    first = _complete(stack, body)
    assert first.status == 200, first.text
    assert first.body["choices"][0]["text"] == "max_tokens=4"
    assert len(stack.engines[DECODE_B].legs) == 1
    transfer = stack.client.get_transfer(first.headers["x-kvpush-transfer-id"])
    assert transfer.decode_engine_id == DECODE_B
    assert _metric(stack.gateway.url, "kvpush_gateway_failovers_total", leg="decode") == 1
    assert _metric(stack.gateway.url, "kvpush_gateway_unreachable_reports_total", leg="decode", result="marked") == 1
    dead = stack.engine(DECODE_A)
    assert dead.HasField("unreachable_time") and "unreachable" in dead.unreachable_reason
    # The cancelled first attempt: the transfer planned on a was cancelled, naming the unreachable engine.
    cancelled = [t for t in stack.client.list_transfers(engine_id=DECODE_A)
                 if t.state == tpb.TRANSFER_STATE_CANCELLED]
    assert any("unreachable" in t.failure_reason for t in cancelled)
    for _ in range(5):
        result = _complete(stack, body)
        assert result.status == 200, result.text
    assert len(stack.engines[DECODE_B].legs) == 6
    assert _metric(stack.gateway.url, "kvpush_gateway_failovers_total", leg="decode") == 1
    # a comes back on its port and renews (registers again): the report is cleared, a is planned again.
    stack.start_engine(DECODE_A, tpb.ENGINE_ROLE_DECODE, port=port)
    assert not stack.engine(DECODE_A).HasField("unreachable_time")
    assert _complete(stack, body).status == 200
    assert len(stack.engines[DECODE_A].legs) == 1


def test_a_connection_dropped_before_any_response_fails_over_streamed(stack):
    """A decode engine that drops the connection before answering (killed mid-request) is unreachable: the
    streamed request is planned again on b and the client gets b's whole stream."""
    stack.engines[DECODE_A].behaviour = lambda leg: (200, {"drop_connection": True}, 0.0)
    result = _complete(stack, {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2, "stream": True}, stream=True)
    assert result.status == 200 and not result.error, result.error
    assert result.text == "ab"
    assert len(stack.engines[DECODE_A].legs) == 1 and len(stack.engines[DECODE_B].legs) == 1
    assert stack.engine(DECODE_A).HasField("unreachable_time")
    assert _metric(stack.gateway.url, "kvpush_gateway_failovers_total", leg="decode") == 1


def test_failover_is_bounded_and_ends_in_a_503(stack):
    """With both decode engines dead, the request is planned 1 + max_failovers (2) times and ends 503 with an
    OpenAI error body; the exhausted counter says so."""
    stack.kill(DECODE_A)
    stack.kill(DECODE_B)
    started = time.monotonic()
    result = _complete(stack, {"model": "tiny", "prompt": [1, 2], "max_tokens": 2})
    assert result.status == 503, result.text
    assert set(result.body["error"]) == {"message", "type", "param", "code"}
    assert "decode engine" in result.body["error"]["message"] and "unreachable" in result.body["error"]["message"]
    assert time.monotonic() - started < 10
    assert len(stack.engines[PREFILL_ID].legs) == 3  # each attempt sent its prefill leg
    assert _metric(stack.gateway.url, "kvpush_gateway_failovers_total", leg="decode") == 2
    assert _metric(stack.gateway.url, "kvpush_gateway_failovers_exhausted_total") == 1


def test_a_dead_prefill_engine_fails_over_to_nothing_and_says_so(stack):
    """The only prefill engine dead: reported, planned again (the directory still plans it, there is no
    other), and after the bound a 503 naming the prefill leg."""
    stack.kill(PREFILL_ID)
    result = _complete(stack, {"model": "tiny", "prompt": [1, 2], "max_tokens": 2})
    assert result.status == 503, result.text
    assert "prefill engine" in result.body["error"]["message"]
    assert _metric(stack.gateway.url, "kvpush_gateway_failovers_total", leg="prefill") == 2
    assert stack.engine(PREFILL_ID).HasField("unreachable_time")


def test_leg_timeouts_are_504s_with_an_openai_body(stack):
    """A prefill leg over its bound, a non-streamed decode leg over its bound, and a streamed decode leg whose
    first event comes too late: each is a 504 naming the leg, counted, and nothing is an unhandled error."""
    stack.engines[PREFILL_ID].behaviour = lambda leg: (200, {"choices": []}, 6.0)
    slow_prefill = _complete(stack, {"model": "tiny", "prompt": [1], "max_tokens": 2})
    stack.reset()
    stack.engines[DECODE_A].behaviour = lambda leg: (200, {"choices": []}, 6.0)
    slow_decode = _complete(stack, {"model": "tiny", "prompt": [1], "max_tokens": 2})
    stack.reset()
    stack.engines[DECODE_A].behaviour = lambda leg: (200, {"first_event_delay_s": 6.0}, 0.0)
    slow_stream = call("POST", stack.gateway.url + "/v1/completions",
                       {"model": "tiny", "prompt": [1], "max_tokens": 2, "stream": True}, timeout_s=30)
    for result, leg in ((slow_prefill, "prefill"), (slow_decode, "decode"), (slow_stream, "decode")):
        assert result.status == 504, result.text
        assert set(result.body["error"]) == {"message", "type", "param", "code"}
        assert result.body["error"]["type"] == "gateway_timeout" and leg in result.body["error"]["message"]
        assert result.elapsed_s < 6.0
    assert _metric(stack.gateway.url, "kvpush_gateway_leg_timeouts_total", leg="prefill") == 1
    assert _metric(stack.gateway.url, "kvpush_gateway_leg_timeouts_total", leg="decode") == 2
    assert "unhandled error" not in tail(stack.gateway.process.log_path, 400)


def test_push_mode_decode_leg_timeout_is_a_504(tmp_path):
    """nixl-push (vLLM's push connector): a streamed decode leg that never sends its first event within the
    bound is a 504 with an OpenAI body, not an unhandled TimeoutError."""
    prefill, decode = StandInEngine("p").start(), StandInEngine("d").start()
    decode.behaviour = lambda leg: (200, {"first_event_delay_s": 6.0}, 0.0)
    gateway = start_gateway(tmp_path, directory_address="", extra_args=[
        "--mode", "nixl-push", "--prefill-url", prefill.url, "--decode-url", decode.url, "--decode-timeout", "2",
        "--prefill-engine-id", "P1", "--prefill-side-channel", f"127.0.0.1:{free_port()}"])
    try:
        result = call("POST", gateway.url + "/v1/completions",
                      {"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": True}, timeout_s=30)
        assert result.status == 504, result.text
        assert result.body["error"]["code"] == 504 and "decode" in result.body["error"]["message"]
        assert "unhandled error" not in tail(gateway.process.log_path, 400)
    finally:
        gateway.process.stop(grace_s=5.0)
        prefill.stop()
        decode.stop()


def test_a_decode_engine_that_sends_no_headers_is_failed_over_within_its_bound(tmp_path):
    """Decode a takes the streamed leg's connection and sends nothing for 5 s (frozen): past the 1 s first-byte bound
    a is reported (its reason says why) and the request planned again on b, whose whole stream the client gets; the
    first attempt's transfer is cancelled."""
    stack = TwoDecodes(tmp_path, ("--decode-first-byte-timeout", "1"))
    try:
        stack.engines[DECODE_A].behaviour = lambda leg: (200, {}, 5.0)
        result = _complete(stack, {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2, "stream": True},
                           stream=True)
        assert result.status == 200 and not result.error, result.error
        assert result.text == "ab"
        assert result.total_s < 5.0  # b answered before a would have
        _assert_decode_a_failed_over(stack, "no response headers within 1 s")
    finally:
        stack.stop()


def _assert_decode_a_failed_over(stack, reason: str) -> None:
    """Decode a had one leg and b the other; a was reported (with `reason`), counted over its bound and failed over
    once, and its attempt's transfer cancelled."""
    assert len(stack.engines[DECODE_A].legs) == 1 and len(stack.engines[DECODE_B].legs) == 1
    frozen = stack.engine(DECODE_A)
    assert frozen.HasField("unreachable_time") and reason in frozen.unreachable_reason
    assert _metric(stack.gateway.url, "kvpush_gateway_first_byte_timeouts_total", leg="decode") == 1
    assert _metric(stack.gateway.url, "kvpush_gateway_failovers_total", leg="decode") == 1
    assert [t.state for t in stack.client.list_transfers(engine_id=DECODE_A)] == [tpb.TRANSFER_STATE_CANCELLED]


def test_a_decode_engine_frozen_under_a_non_streamed_leg_is_failed_over_once_its_health_is_silent(tmp_path):
    """Decode a takes a non-streamed leg and answers nothing, its /health neither (frozen): past the 1 s bound the
    gateway probes it, and once the probe went unanswered for 1 s more a is reported and the request planned again on
    b, whose answer the client gets; the first attempt's transfer is cancelled."""
    stack = TwoDecodes(tmp_path, ("--decode-first-byte-timeout", "1"))
    try:
        frozen = stack.engines[DECODE_A]
        frozen.behaviour = lambda leg: (200, {"choices": [{"index": 0, "text": "from a"}]}, 5.0)
        frozen.health_delay_s = 5.0
        result = _complete(stack, {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2})
        assert result.status == 200, result.text
        assert result.body["choices"][0]["text"] == "max_tokens=2"  # b's answer
        assert frozen.health_probes == 1
        _assert_decode_a_failed_over(stack, "sent no answer within 1 s and its health endpoint none within 1 s more")
    finally:
        stack.stop()


def test_a_slow_decode_engine_whose_health_answers_keeps_its_non_streamed_leg(tmp_path):
    """Decode a answers a non-streamed leg only after 2.5 s but its /health at once: the gateway probes it past the
    1 s bound, finds it alive and waits for its answer; nothing is reported or failed over."""
    stack = TwoDecodes(tmp_path, ("--decode-first-byte-timeout", "1"))
    try:
        slow = stack.engines[DECODE_A]
        slow.behaviour = lambda leg: (200, {"choices": [{"index": 0, "text": "from a"}]}, 2.5)
        result = _complete(stack, {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2})
        assert result.status == 200, result.text
        assert result.body["choices"][0]["text"] == "from a"
        assert len(slow.legs) == 1 and stack.engines[DECODE_B].legs == [] and slow.health_probes >= 1
        assert not stack.engine(DECODE_A).HasField("unreachable_time")
        assert _metric(stack.gateway.url, "kvpush_gateway_first_byte_timeouts_total", leg="decode") == 0
        assert _metric(stack.gateway.url, "kvpush_gateway_failovers_total", leg="decode") == 0
    finally:
        stack.stop()


@contextlib.contextmanager
def _cancel_meets_a_stopped_directory(tmp_path, stopped_s: float):
    """A two-decode deployment (0.5 s directory deadlines) and one request whose prefill leg fails after SIGSTOPping
    the directory for `stopped_s`, so the gateway's CancelTransfer meets a directory that does not answer; yields
    the deployment and the request's transfer id once its 502 came."""
    # The prefill leg after the plan: the leg stops the directory, which must have answered the plan by then.
    stack, timers = TwoDecodes(tmp_path, ("--plan-timeout", "0.5", "--no-prefill-before-plan")), []
    group = stack.directory.process.pid

    def behaviour(leg):
        os.killpg(group, signal.SIGSTOP)
        timers.append(threading.Timer(stopped_s, os.killpg, (group, signal.SIGCONT)))
        timers[-1].start()
        return 500, {"error": {"message": "prefill broke"}}, 0.0

    try:
        stack.engines[PREFILL_ID].behaviour = behaviour
        result = call("POST", stack.gateway.url + "/v1/completions", {"model": "tiny", "prompt": [1, 2],
                                                                      "max_tokens": 2}, timeout_s=30)
        assert result.status == 502, result.text
        yield stack, result.headers["x-kvpush-transfer-id"]
    finally:
        for timer in timers:
            timer.cancel()
        os.killpg(group, signal.SIGCONT)
        stack.stop()


def test_a_cancel_the_directory_missed_is_retried_until_it_lands(tmp_path):
    """The directory is stopped for 1.5 s when the gateway cancels a failed request's transfer: the client has its
    502 already, the gateway tries again in the background, and the transfer ends CANCELLED, not PLANNED; nothing
    is counted as a failed cancellation."""
    with _cancel_meets_a_stopped_directory(tmp_path, 1.5) as (stack, transfer_id):
        state = None
        for _ in range(100):  # the retries end within about 3 s of the directory's return
            state = stack.client.get_transfer(transfer_id).state
            if state == tpb.TRANSFER_STATE_CANCELLED:
                break
            time.sleep(0.1)
        assert state == tpb.TRANSFER_STATE_CANCELLED, tpb.TransferState.Name(state)
        assert _metric(stack.gateway.url, "kvpush_gateway_cancel_failures_total") == 0


def test_a_cancel_that_never_lands_is_counted_and_logged(tmp_path):
    """The directory stopped for longer than every retry (8 s): the cancellation is counted and logged once, by
    transfer id."""
    with _cancel_meets_a_stopped_directory(tmp_path, 8.0) as (stack, transfer_id):
        for _ in range(150):
            if _metric(stack.gateway.url, "kvpush_gateway_cancel_failures_total"):
                break
            time.sleep(0.1)
        assert _metric(stack.gateway.url, "kvpush_gateway_cancel_failures_total") == 1
        lines = [line for line in tail(stack.gateway.process.log_path, 400).splitlines()
                 if "transfer not cancelled" in line]
        assert len(lines) == 1 and transfer_id in lines[0]


def test_first_byte_bounds_are_validated():
    """A negative first-byte bound is refused at start-up; 0 turns it off."""
    from kvpush.gateway.config import GatewayConfig

    with pytest.raises(ValueError, match="decode_first_byte_timeout_s"):
        GatewayConfig(directory_address="x:1", decode_first_byte_timeout_s=-1).validate()
    GatewayConfig(directory_address="x:1", prefill_first_byte_timeout_s=0, decode_first_byte_timeout_s=0).validate()


def test_max_failovers_is_validated():
    """--max-failovers outside [0, 16] is refused at start-up."""
    from kvpush.gateway.config import GatewayConfig

    with pytest.raises(ValueError, match="max_failovers"):
        GatewayConfig(directory_address="x:1", max_failovers=17).validate()
    GatewayConfig(directory_address="x:1", max_failovers=0).validate()

