"""The shipped alert rules and Grafana dashboard against what a real stack exports, through a real Prometheus.

A local stack (directory, prefill and decode vLLM engines with KVPushConnector, gateway) serves streamed and
non-streamed completions; a stand-in decode engine registers for a model no prefill engine serves, so a request for
that model is refused a plan (503), and then lets its lease lapse. Prometheus (Debian's, with the scrape config and
rule file of deploy/prometheus, pointed at the stack's /metrics) scrapes it all. Then: every metric name in every
alert and dashboard expression is exported by the stack, every dashboard expression evaluates (the panels that
traffic feeds show data), every rule evaluates without error, and the lease-lapse, plan-refusal and (last, after a
directory restart) restart alerts go pending or firing on what really happened. A misspelt name is caught.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import shlex
import subprocess
import sys
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpush.client import ChannelConfig, DirectoryClient
from kvpush.localstack.client import call, stream_completion
from kvpush.localstack.model import TinyModelSpec
from kvpush.localstack.stack import DECODE_ENGINE_ID, LocalStack
from tests.fixtures.directory import DECODE, make_layout, register_request
from tests.fixtures.prometheus import (
    ROOT,
    PrometheusServer,
    PromQLError,
    Query,
    alert_queries,
    dashboard_queries,
    metric_names,
    missing_names,
)

pytestmark = pytest.mark.engines

RUNBOOK = ROOT / "docs" / "observability.md"

STANDIN_ENGINE_ID = "lapse-standin"
STANDIN_MODEL = "lapse-standin"
# Families a healthy stack declares but has no series of until their event happens (a labelled counter's series
# appears with its first event); the traffic below makes lease lapses and plan refusals happen, not these.
FAULT_ONLY = {
    "kvpush_gateway_stream_errors_total", "kvpush_gateway_failovers_total", "kvpush_gateway_unreachable_reports_total",
    "kvpush_directory_plan_skipped_engines_total", "kvpush_directory_refusals_total",
}
# Panels the traffic must feed: each of their targets returns at least one number.
PANELS_WITH_DATA = (
    "Request rate by route and status", "Time to first token", "Inter-token latency", "End-to-end latency",
    "Transfers planned and ended", "Active transfers", "Exposed tail", "Bytes pushed", "Leases",
    "Engine KV cache free", "Directory RPC latency p99", "Directory replicas up",
)
# Firing on a healthy stack would be wrong.
NEVER_ON_A_HEALTHY_STACK = ("KvpushDirectoryUnavailable", "KvpushGatewayDown", "KvpushTransfersFailing",
                            "KvpushWritesFailing", "KvpushBrokenStreams", "KvpushFailoversExhausted")
WAIT_S = 120.0


def _host_port(url: str) -> str:
    return urllib.parse.urlsplit(url).netloc


def _wait_for(what: str, check, timeout_s: float = WAIT_S, poll_s: float = 1.0):
    """Poll `check()` until it returns something true; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(poll_s)


@pytest.fixture(scope="module")
def stack(session_log_dir):
    """Directory, prefill and decode engines (no colocated engine) and the gateway, every /metrics on."""
    stack = LocalStack(spec=TinyModelSpec(), log_dir=session_log_dir / "alerts-stack", progress=None,
                       engine_timeout_s=600.0, with_colocated=False)
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def prometheus(stack, tmp_path_factory):
    """Prometheus with the shipped jobs and rules, scraping this stack every 3 s."""
    server = PrometheusServer(targets={
        "kvpush-directory": [f"127.0.0.1:{stack.metrics_ports['directory']}"],
        "kvpush-gateway": [_host_port(stack.gateway_url)],
        "kvpush-connector": [f"127.0.0.1:{stack.metrics_ports[name]}" for name in ("prefill", "decode")],
        "vllm": [_host_port(stack.prefill.url), _host_port(stack.decode.url)],
    }, folder=tmp_path_factory.mktemp("prometheus"))
    server.start()
    yield server
    server.stop()


async def _register_standin(address: str) -> None:
    """A decode worker for a model no prefill engine serves, never renewed: its lease lapses after the TTL."""
    async with DirectoryClient(ChannelConfig(address=address)) as client:
        request = register_request(STANDIN_ENGINE_ID, DECODE, layout=make_layout(compatibility_hash="standin"))
        request.model = STANDIN_MODEL
        await client.register_engine(request)


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(length)]


@dataclass
class Traffic:
    """What was sent, as the gateway answered it."""

    plain_statuses: list[int]
    streamed: list
    refused_statuses: list[int]
    transfer_id: str  # one completion's transfer (X-KVPush-Transfer-Id)


def _refused_request(stack: LocalStack) -> int:
    """A completion for the stand-in's model: 503 once the gateway's engine list has it (404 before)."""
    return call("POST", stack.gateway_url + "/v1/completions",
                {"model": STANDIN_MODEL, "prompt": _prompt(8, 1), "max_tokens": 2}, timeout_s=60).status


def _has_series(prometheus: PrometheusServer, expr: str) -> bool:
    return bool(prometheus.query(expr))


def _completions(stack: LocalStack, seed: int) -> tuple[list, list]:
    """Plain and streamed completions and chat completions: the plain answers, the streamed results."""
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    chat = {**body, "messages": [{"role": "user", "content": f"hello there, number {seed}"}]}
    plain = [call("POST", stack.gateway_url + "/v1/completions", {**body, "prompt": _prompt(n, seed + n)},
                  timeout_s=180) for n in (20, 150)]
    plain.append(call("POST", stack.gateway_url + "/v1/chat/completions", chat, timeout_s=180))
    streamed = [stream_completion(stack.gateway_url + "/v1/completions", {**body, "prompt": _prompt(n, seed + n + 1)},
                                  timeout_s=180) for n in (30, 200)]
    streamed.append(stream_completion(stack.gateway_url + "/v1/chat/completions", chat, timeout_s=180))
    return plain, streamed


@pytest.fixture(scope="module")
def traffic(stack, prometheus) -> Traffic:
    """Plan refusals, two rounds of completions, a lapsed lease; waits until Prometheus has scraped what they did.

    A labelled series appears with its first event, and rate() cannot count a series' first sample: each kind of
    traffic comes again once Prometheus has its series, as steady traffic would."""
    asyncio.run(_register_standin(stack.directory.address))
    _wait_for("a 503 for the stand-in's model", lambda: _refused_request(stack) == 503, 30.0)
    refused = [503]
    _wait_for("the 503 series scraped", lambda: _has_series(
        prometheus, 'kvpush_gateway_requests_total{status="503"}'))
    refused.append(_refused_request(stack))
    plain, streamed = _completions(stack, seed=0)
    _wait_for("the latency series scraped", lambda: _has_series(
        prometheus, "sum(kvpush_gateway_time_to_first_token_seconds_count) >= 3"))
    more_plain, more_streamed = _completions(stack, seed=1000)
    plain, streamed = plain + more_plain, streamed + more_streamed
    # The stand-in's lease lapses 30 s after it registered; the pushes settle a moment after their answers.
    _wait_for("the stand-in's lease lapse scraped", lambda: _has_series(
        prometheus, 'kvpush_directory_lease_expiries_total{role="decode"} >= 1'))
    _wait_for("every transfer's end scraped", lambda: _has_series(
        prometheus, f'sum(kvpush_directory_transfers_ended_total{{state="complete"}}) >= {len(plain) + len(streamed)}'))
    for name in ("time_to_first_token", "inter_token_latency", "request_duration"):
        _wait_for(f"the second round's {name} scraped", lambda name=name: _has_series(
            prometheus, f"sum(rate(kvpush_gateway_{name}_seconds_count[5m])) > 0"))
    return Traffic(plain_statuses=[a.status for a in plain], streamed=streamed, refused_statuses=refused,
                   transfer_id=plain[0].headers.get("x-kvpush-transfer-id", ""))


def _names_by_query(queries: list[Query]) -> dict[str, set[str]]:
    return {f"{q.where}: {q.expr}": metric_names(q.expr) for q in queries}


def test_the_traffic_was_answered(traffic):
    """Plain and streamed completions answered 200 with tokens and no error event; the stand-in's model was refused
    a plan twice (503)."""
    assert traffic.plain_statuses == [200] * 6
    for stream in traffic.streamed:
        assert stream.status == 200 and not stream.error and stream.text, stream
    assert traffic.refused_statuses == [503, 503]


def test_every_metric_name_in_the_alerts_and_the_dashboard_is_exported(traffic, prometheus):
    """Every metric name of every alert, panel and variable is a series Prometheus scraped from the stack, or (only
    for the families in FAULT_ONLY) a family the stack declares whose series appears with its first event."""
    wanted = _names_by_query(alert_queries() + dashboard_queries())
    all_names = set().union(*wanted.values())
    missing = missing_names(all_names, prometheus)
    assert not missing, "\n".join(f"{where} uses {sorted(names & missing)}"
                                  for where, names in wanted.items() if names & missing)
    declared_only = all_names - prometheus.series_names()
    assert declared_only <= FAULT_ONLY, f"no series of {sorted(declared_only - FAULT_ONLY)}"
    # The events this traffic caused are real series, not declarations.
    assert {"kvpush_directory_lease_expiries_total", "kvpush_gateway_time_to_first_token_seconds_bucket",
            "kvpush_gateway_inter_token_latency_seconds_bucket", "kvpush_gateway_request_duration_seconds_bucket",
            "kvpush_connector_exposed_tail_seconds_bucket", "kvpush_directory_transfers_planned_created",
            "vllm:kv_cache_usage_perc"} <= prometheus.series_names()


def test_a_misspelt_metric_name_is_caught(traffic, prometheus):
    """The same check names a misspelt metric in an alert and in a dashboard target (one letter off, in each)."""
    alert = next(q for q in alert_queries() if "kvpush_directory_lease_expiries_total" in q.expr)
    panel = next(q for q in dashboard_queries() if "kvpush_connector_written_bytes_total" in q.expr)
    wrong_alert = alert.expr.replace("kvpush_directory_lease_expiries_total", "kvpush_directory_lease_expiry_total")
    wrong_panel = panel.expr.replace("kvpush_connector_written_bytes_total", "kvpush_connector_write_bytes_total")
    assert missing_names(metric_names(wrong_alert), prometheus) == {"kvpush_directory_lease_expiry_total"}
    assert missing_names(metric_names(wrong_panel), prometheus) == {"kvpush_connector_write_bytes_total"}
    assert prometheus.query(wrong_panel) == []  # what a wrong name does on a dashboard: an empty panel, no error


def test_every_dashboard_expression_evaluates(traffic, prometheus):
    """Every panel target and variable selector evaluates without error, and the panels this traffic feeds show a
    number (not an empty result, not only NaN)."""
    errors, empty = [], []
    for query in dashboard_queries():
        try:
            result = prometheus.query(query.expr)
        except PromQLError as error:
            errors.append(f"{query.where}: {error}")
            continue
        title = query.where.split("'")[1] if query.where.startswith("panel") else ""
        numbers = [float(sample["value"][1]) for sample in result]
        fed = title in PANELS_WITH_DATA and not metric_names(query.expr) & FAULT_ONLY
        if fed and not any(not math.isnan(n) for n in numbers):
            empty.append(f"{query.where}: {query.expr}")
    assert not errors, "\n".join(errors)
    assert not empty, "no data:\n" + "\n".join(empty)


def test_every_rule_evaluates_without_error(traffic, prometheus):
    """Prometheus loaded every shipped alert and evaluated each one without error."""
    def evaluated():
        rules = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
        return rules if all(not r["lastEvaluation"].startswith("0001") for r in rules) else None

    rules = _wait_for("every rule evaluated once", evaluated, 30.0)
    assert {r["name"] for r in rules} == {q.where.removeprefix("alert ") for q in alert_queries()}
    assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []


def _active_alerts(prometheus: PrometheusServer) -> list[dict]:
    return prometheus.api("alerts")["alerts"]


def test_alerts_follow_what_happened(traffic, prometheus):
    """The stand-in's lapsed lease and the refused plans put KvpushLeaseLapsed (role decode) and KvpushPlanRefusals
    (/v1/completions) in pending or firing; no alert about a failure that did not happen is active."""
    def wanted_alerts():
        alerts = _active_alerts(prometheus)
        keys = {(a["labels"]["alertname"], a["labels"].get("role") or a["labels"].get("route")) for a in alerts}
        return alerts if {("KvpushLeaseLapsed", "decode"), ("KvpushPlanRefusals", "/v1/completions")} <= keys else None

    alerts = _wait_for("the lease-lapse and plan-refusal alerts", wanted_alerts, 30.0)
    for alert in alerts:
        assert alert["state"] in ("pending", "firing")
        assert alert["labels"]["alertname"] not in NEVER_ON_A_HEALTHY_STACK, alert


def test_the_runbook_commands_run(traffic, stack):
    """Each `kvpush ...` command of the runbook (docs/observability.md) runs as written against this stack's directory
    (DIR:50051: its address; TRANSFER_ID: a transfer of the traffic) and exits 0; `engines` lists the decode engine
    and `trace` shows the transfer COMPLETE."""
    commands = sorted(set(re.findall(r"`(kvpush [^`]+)`", RUNBOOK.read_text())))
    assert {c.split()[1] for c in commands} >= {"health", "engines", "transfers", "trace"}, commands
    assert traffic.transfer_id
    kvpush = Path(sys.executable).with_name("kvpush")
    for command in commands:
        argv = shlex.split(command.replace("DIR:50051", stack.directory.address)
                           .replace("TRANSFER_ID", traffic.transfer_id))
        done = subprocess.run([str(kvpush), *argv[1:]], capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, f"{command}: {done.returncode}\n{done.stdout}\n{done.stderr}"
        if argv[1] == "engines":
            assert DECODE_ENGINE_ID in done.stdout, done.stdout
        if argv[1] == "trace":
            assert traffic.transfer_id in done.stdout and "COMPLETE" in done.stdout, done.stdout


def test_a_directory_restart_is_alerted(traffic, prometheus, stack):
    """After a directory restart (SIGKILL, a new process on the same port), KvpushDirectoryRestarted is pending or
    firing. Runs last in this module: the stack's directory is a new one afterwards."""
    stack.restart_directory()
    _wait_for("KvpushDirectoryRestarted", lambda: any(
        a["labels"]["alertname"] == "KvpushDirectoryRestarted" for a in _active_alerts(prometheus)), 60.0)
