"""Metrics, traces and logs of real requests through the CPU stack (directory, engines, gateway, OTLP receiver).

- Metrics: every process's /metrics is scraped and parsed before and after a known set of requests; the
  counters moved by exactly what was sent (and the bytes agree with the directory's records).
- Trace: one request with a caller's traceparent yields one trace across the gateway, the directory, the
  prefill engine (a write span per layer, with bytes and descriptors) and the decode engine, parents correct.
- Logs: the JSON lines the gateway and the directory wrote about that request carry its trace id.
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpush.client import SyncDirectoryClient
from kvpush.localstack.client import call
from kvpush.v1 import types_pb2 as tpb

pytestmark = pytest.mark.engines

CLIENT_TRACE_ID = "5bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "10f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
PROMPT_LENGTHS = (20, 150, 300)


def _scrape(url: str, attempts: int = 3) -> dict[tuple[str, tuple], float]:
    """Every sample of an endpoint: (name, sorted labels) -> value.

    A scrape that times out is tried again, as Prometheus scrapes again (`attempts` of 10 s at most): the samples are
    what is checked, not how fast a loaded 2-core machine answers."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    for attempt in range(1, attempts + 1):
        try:
            with opener.open(url, timeout=10) as response:
                text = response.read().decode()
            break
        except (TimeoutError, urllib.error.URLError) as error:
            timed_out = isinstance(error, TimeoutError) or isinstance(getattr(error, "reason", None), TimeoutError)
            if not timed_out:
                raise
            if attempt == attempts:
                raise TimeoutError(f"{url}: no answer within 10 s, {attempts} times") from error
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def _value(samples: dict, name: str, **labels) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= set(ls))


def _greedy(token_count: int, seed: int) -> dict:
    rng = random.Random(seed)
    return {"model": "tiny", "prompt": [rng.randrange(3, 1024) for _ in range(token_count)], "max_tokens": 4,
            "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def traffic(local_stack):
    """Metrics before and after three completions (the first with a caller's traceparent) and one bad request."""
    urls = local_stack.metrics_urls()
    assert set(urls) == {"directory", "prefill", "decode", "gateway"}
    before = {name: _scrape(url) for name, url in urls.items()}
    answers = []
    for index, length in enumerate(PROMPT_LENGTHS):
        headers = {"traceparent": CLIENT_TRACEPARENT, "X-Request-Id": "observed-0"} if index == 0 else None
        answer = call("POST", local_stack.gateway_url + "/v1/completions", _greedy(length, length), headers=headers,
                      timeout_s=180)
        assert answer.status == 200, answer.text
        answers.append(answer)
    bad = call("POST", local_stack.gateway_url + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0})
    assert bad.status == 400
    client = SyncDirectoryClient(local_stack.directory_channel(timeout_s=5.0))
    try:
        transfers = [client.get_transfer(a.headers["x-kvpush-transfer-id"]) for a in answers]
    finally:
        client.close()
    # Settlement reaches each process a moment after the answer (the directory hears DONE after decode's
    # notification; prefill's final timeline leaves with its next step): wait for it, bounded.
    deadline = time.monotonic() + 20
    while True:
        after = {name: _scrape(url) for name, url in urls.items()}
        settled = (_value(after["prefill"], "kvpush_connector_pushes_total", state="done")
                   - _value(before["prefill"], "kvpush_connector_pushes_total", state="done") >= len(answers)
                   and _value(after["directory"], "kvpush_directory_transfers_ended_total", state="complete")
                   - _value(before["directory"], "kvpush_directory_transfers_ended_total", state="complete")
                   >= len(answers))
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return before, after, answers, transfers


def _delta(traffic, process: str, name: str, **labels) -> float:
    before, after, _, _ = traffic
    return _value(after[process], name, **labels) - _value(before[process], name, **labels)


def test_gateway_metrics_count_what_was_sent(traffic):
    """The gateway counted three 200s and one 400 on /v1/completions, and timed three plans and prefill legs."""
    assert _delta(traffic, "gateway", "kvpush_gateway_requests_total", route="/v1/completions", status="200") == 3
    assert _delta(traffic, "gateway", "kvpush_gateway_requests_total", route="/v1/completions", status="400") == 1
    assert _delta(traffic, "gateway", "kvpush_gateway_plan_duration_seconds_count") == 3
    assert _delta(traffic, "gateway", "kvpush_gateway_prefill_leg_duration_seconds_count") == 3
    assert _delta(traffic, "gateway", "kvpush_gateway_requests_in_flight") == 0


def test_directory_metrics_count_the_transfers(traffic):
    """Three planned and three COMPLETE transfers, their bytes as the records say, RPCs timed by method and code."""
    _, _, _, transfers = traffic
    assert all(t.state == tpb.TRANSFER_STATE_COMPLETE for t in transfers)
    assert _delta(traffic, "directory", "kvpush_directory_transfers_planned_total") == 3
    assert _delta(traffic, "directory", "kvpush_directory_transfers_ended_total", state="complete", cause="none") == 3
    assert _delta(traffic, "directory", "kvpush_directory_transfer_written_bytes_total") == sum(
        t.bytes_written for t in transfers)
    assert _delta(traffic, "directory", "kvpush_directory_transfer_written_layers_total") == 3 * 2
    assert _delta(traffic, "directory", "kvpush_directory_transfer_duration_seconds_count", state="complete") == 3
    assert _delta(traffic, "directory", "kvpush_directory_exposed_tail_seconds_count") == 3
    assert _delta(traffic, "directory", "kvpush_directory_rpc_duration_seconds_count", method="PlanTransfer",
                  code="OK") == 3
    assert _delta(traffic, "directory", "kvpush_directory_rpc_duration_seconds_count", method="ReportAllocation",
                  code="OK") == 3
    _, after, _, _ = traffic
    assert _value(after["directory"], "kvpush_directory_workers", role="prefill") == 1
    assert _value(after["directory"], "kvpush_directory_open_streams", kind="stream_prefill") == 1


def test_connector_metrics_count_writes_and_receives(traffic):
    """Prefill's connector wrote every byte the directory recorded, in one WRITE per layer at least; decode
    finished three receives."""
    _, _, _, transfers = traffic
    written = sum(t.bytes_written for t in transfers)
    assert _delta(traffic, "prefill", "kvpush_connector_written_bytes_total") == written
    assert _delta(traffic, "prefill", "kvpush_connector_pushes_total", state="done") == 3
    assert _delta(traffic, "prefill", "kvpush_connector_writes_total", outcome="failed") == 0
    assert _delta(traffic, "prefill", "kvpush_connector_writes_total", outcome="ok") >= 3 * 2
    assert _delta(traffic, "prefill", "kvpush_connector_write_post_seconds_count") >= 3 * 2
    assert _delta(traffic, "prefill", "kvpush_connector_exposed_tail_seconds_count") == 3
    assert _delta(traffic, "decode", "kvpush_connector_receives_total", outcome="complete") == 3
    assert _delta(traffic, "decode", "kvpush_connector_receive_wait_seconds_count") == 3
    _, after, _, _ = traffic
    assert _value(after["decode"], "kvpush_connector_receives_in_flight") == 0
    assert _value(after["prefill"], "kvpush_connector_pushes_in_flight") == 0


def test_one_trace_links_gateway_directory_prefill_and_decode(traffic, otlp_receiver):
    """The traced request is one trace under the caller's span: gateway -> plan / directory transfer / legs ->
    prefill push (a write span per layer, bytes and descriptors) and decode receive."""
    _, _, answers, _ = traffic
    transfer_id = answers[0].headers["x-kvpush-transfer-id"]

    def complete(spans) -> bool:
        names = {s.name for s in spans if s.trace_id == CLIENT_TRACE_ID}
        writes = [s for s in spans if s.name == "kvpush.dataplane.write" and s.trace_id == CLIENT_TRACE_ID]
        return {"gateway.request", "kvpush.directory.transfer", "kvpush.push", "kvpush.receive"} <= names \
            and len(writes) >= 2
    spans = [s for s in otlp_receiver.wait_for(complete, 30) if s.trace_id == CLIENT_TRACE_ID]
    by_name: dict[str, list] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    (request,) = by_name["gateway.request"]
    assert request.parent_span_id == CLIENT_SPAN_ID and request.service_name == "kvpush-gateway"
    (plan,) = by_name["gateway.plan"]
    (prefill_leg,) = by_name["gateway.prefill_leg"]
    (decode_leg,) = by_name["gateway.decode_leg"]
    assert plan.parent_span_id == prefill_leg.parent_span_id == decode_leg.parent_span_id == request.span_id
    (directory,) = by_name["kvpush.directory.transfer"]
    assert directory.parent_span_id == request.span_id and directory.service_name == "kvpush-directory"
    assert directory.attributes["kvpush.transfer_id"] == transfer_id
    assert {"allocation", "instruction", "completion"} <= set(directory.event_names)
    (push,) = by_name["kvpush.push"]
    assert push.parent_span_id == prefill_leg.span_id and push.service_name == "kvpush-prefill"
    (receive,) = by_name["kvpush.receive"]
    assert receive.parent_span_id == decode_leg.span_id and receive.service_name == "kvpush-decode"
    writes = by_name["kvpush.dataplane.write"]
    assert {w.parent_span_id for w in writes} == {push.span_id}
    assert sorted(w.attributes["kvpush.layer_first"] for w in writes) == [0, 1]
    assert all(w.attributes["kvpush.bytes"] > 0 and w.attributes["kvpush.descriptor_count"] > 0 for w in writes)
    assert sum(w.attributes["kvpush.bytes"] for w in writes) == traffic[3][0].bytes_written


def test_log_lines_of_the_request_carry_its_trace_id(traffic, local_stack):
    """The gateway's and the directory's JSON lines about the traced request carry its trace id and ids."""
    _, _, answers, _ = traffic
    transfer_id = answers[0].headers["x-kvpush-transfer-id"]
    for name in ("gateway", "directory"):
        lines = [json.loads(line) for line in (local_stack.log_dir / f"{name}.log").read_text().splitlines()
                 if line.startswith("{") and transfer_id in line]
        assert lines, f"{name} logged nothing about {transfer_id}"
        for line in lines:
            assert line["trace_id"] == CLIENT_TRACE_ID, line
            assert line["span_id"] and line["request_id"] == "observed-0", line


def test_engines_report_load_model_and_one_compatibility_hash(traffic, local_stack):
    """Each engine registered its served model and the same non-empty compatibility hash; after steps ran, its
    renewals carry a free-block count within its cache."""
    client = SyncDirectoryClient(local_stack.directory_channel(timeout_s=5.0))
    try:
        deadline = time.monotonic() + 30  # renewals come every lease ttl / 3 (10 s here)
        while True:
            engines = client.list_engines()
            if all(e.HasField("load") for e in engines) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        client.close()
    assert {e.model for e in engines} == {"tiny"}
    hashes = {e.layout.compatibility_hash for e in engines}
    assert len(hashes) == 1 and len(next(iter(hashes))) == 16
    for engine in engines:
        assert engine.HasField("load"), engine.engine_id
        assert 0 < engine.load.free_block_count <= engine.layout.block_count


def test_gateway_counts_chat_prompt_tokens_with_the_engine(local_stack):
    """A chat request is tokenized by the prefill engine before planning: the gateway's histogram grows by the
    engine's own count for those messages."""
    messages = [{"role": "user", "content": "Count the tokens of this sentence, please."}]
    expected = call("POST", local_stack.prefill.url + "/tokenize", {"model": "tiny", "messages": messages,
                                                                     "add_generation_prompt": True})
    assert expected.status == 200, expected.text
    url = local_stack.metrics_urls()["gateway"]
    before = _scrape(url)
    answer = call("POST", local_stack.gateway_url + "/v1/chat/completions",
                  {"model": "tiny", "messages": messages, "max_tokens": 2, "add_generation_prompt": True},
                  timeout_s=120)
    assert answer.status == 200, answer.text
    after = _scrape(url)
    assert _value(after, "kvpush_gateway_prompt_tokens_sum") - _value(before, "kvpush_gateway_prompt_tokens_sum") \
        == expected.body["count"]
