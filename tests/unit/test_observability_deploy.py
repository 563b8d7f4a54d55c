"""The shipped Prometheus rules and Grafana dashboard, checked without a stack: promtool runs the commands
docs/observability.md gives, the dashboard's JSON has the structure Grafana provisions, and the compose services
point at each other (scrape targets, mounts, the datasource). The live check of every expression is
tests/integration/observability/test_alerts_dashboard.py."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvpush.gateway.config import GatewayConfig
from tests.fixtures.prometheus import (
    ALERT_RULES,
    ALERT_TESTS,
    DASHBOARD,
    ROOT,
    SCRAPE_CONFIG,
    alert_rules,
    dashboard_panels,
    dashboard_queries,
    metric_names,
)

DOC = ROOT / "docs" / "observability.md"
GRAFANA = ROOT / "deploy" / "grafana"
COMPOSE = ROOT / "deploy" / "compose" / "docker-compose.yaml"

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="promtool is not installed (scripts/setup.sh installs Debian's prometheus)")


def _doc_commands() -> list[str]:
    """The promtool commands of docs/observability.md's code blocks, as written."""
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.DOTALL)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip().startswith("promtool ")]


def _promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], check=False, cwd=cwd, capture_output=True, text=True, timeout=120)


@needs_promtool
def test_the_documented_promtool_commands_pass():
    """Each promtool command in docs/observability.md (config, rules, rule unit tests) succeeds as written."""
    commands = _doc_commands()
    assert {c.split()[-1] for c in commands} >= {str(p.relative_to(ROOT)) for p in (SCRAPE_CONFIG, ALERT_RULES,
                                                                                    ALERT_TESTS)}, commands
    for command in commands:
        done = subprocess.run(shlex.split(command), check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
        assert "SUCCESS" in done.stdout + done.stderr


@needs_promtool
def test_rule_unit_tests_fail_on_a_misspelt_metric(tmp_path):
    """The rule unit tests catch a misspelt metric name: with one alert's name wrong, the expected alert is missing."""
    (tmp_path / "alerts.yaml").write_text(ALERT_RULES.read_text().replace(
        "kvpush_directory_lease_expiries_total", "kvpush_directory_lease_expiry_total"))
    shutil.copy(ALERT_TESTS, tmp_path / "alerts.test.yaml")
    assert _promtool("check", "rules", "alerts.yaml", cwd=tmp_path).returncode == 0  # still valid PromQL
    failed = _promtool("test", "rules", "alerts.test.yaml", cwd=tmp_path)
    assert failed.returncode != 0 and "KvpushLeaseLapsed" in failed.stdout + failed.stderr


@needs_promtool
def test_rule_check_refuses_bad_promql(tmp_path):
    """promtool check rules refuses an expression that is not PromQL (so its pass above means something)."""
    rules = yaml.safe_load(ALERT_RULES.read_text())
    rules["groups"][0]["rules"][0]["expr"] = "sum by (job (up)"
    (tmp_path / "alerts.yaml").write_text(yaml.safe_dump(rules))
    assert _promtool("check", "rules", "alerts.yaml", cwd=tmp_path).returncode != 0


def test_every_alert_has_for_severity_annotations_and_a_runbook_section():
    """Every alert waits (`for`), has a severity, a summary and a description, and its runbook anchor is a heading
    of docs/observability.md."""
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", DOC.read_text(), re.MULTILINE)}
    rules = alert_rules()
    assert len({r["alert"] for r in rules}) == len(rules)
    for rule in rules:
        assert re.fullmatch(r"\d+[smh]", rule.get("for", "")), rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        assert rule["annotations"]["runbook"] == f"docs/observability.md#{rule['alert'].lower()}"
        assert rule["alert"].lower() in anchors, f"no runbook section for {rule['alert']}"


def test_the_metric_name_reader():
    """metric_names finds selected names only: not functions, keywords, label names, strings or durations."""
    expr = ('histogram_quantile(0.99, sum by (route, le) (rate(a_bucket{route=~"x|y", le!="1"}[5m] offset 1h)))'
            ' / ignoring (cause) group_left sum without (instance) (b_total) > bool 0.5 or on (job) up'
            ' unless {__name__="c:ratio"} and 1 - vllm:kv_cache_usage_perc')
    assert metric_names(expr) == {"a_bucket", "b_total", "up", "c:ratio", "vllm:kv_cache_usage_perc"}


def test_dashboard_structure():
    """The dashboard is Grafana's classic model: a uid, a current schemaVersion, unique panel ids, every query panel
    on the datasource variable with targets that have an expression and unique refIds, laid out inside 24 columns
    without overlaps."""
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 39
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = dashboard_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        area = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not area & cells, f"panel {panel['title']!r} overlaps another"
        cells |= area
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip() and target["datasource"] == panel["datasource"], panel["title"]
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"]["uid"] == "${datasource}"
    assert all(metric_names(q.expr) for q in dashboard_queries()), "an expression selects no metric"


def test_dashboard_covers_what_operators_watch():
    """Panels exist for request rate and status, TTFT / inter-token / end-to-end quantiles by route and mode,
    transfers, exposed tail, bytes pushed, leases, directory RPC latency and engine KV blocks."""
    names = set().union(*(metric_names(q.expr) for q in dashboard_queries()))
    for wanted in ("kvpush_gateway_requests_total", "kvpush_gateway_time_to_first_token_seconds_bucket",
                   "kvpush_gateway_inter_token_latency_seconds_bucket",
                   "kvpush_gateway_request_duration_seconds_bucket",
                   "kvpush_directory_transfers_planned_total", "kvpush_directory_transfers_ended_total",
                   "kvpush_directory_live_transfers", "kvpush_connector_exposed_tail_seconds_bucket",
                   "kvpush_connector_written_bytes_total", "kvpush_directory_lease_expiries_total",
                   "kvpush_directory_rpc_duration_seconds_bucket", "vllm:kv_cache_usage_perc"):
        assert wanted in names, wanted
    for query in dashboard_queries():
        if "_seconds_bucket" in query.expr and "kvpush_gateway_" in query.expr and "route" in query.expr:
            assert "route, mode, le" in query.expr, query


def _compose_services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def _ports_served(service: dict) -> set[int]:
    """Ports a compose service's processes listen on, from its command (flags, metrics_port) and gateway default."""
    text = " ".join(service.get("command", [])) if isinstance(service.get("command"), list) else ""
    ports = {int(p) for p in re.findall(r"--(?:metrics-)?port[= ](\d+)", text)}
    ports |= {int(p) for p in re.findall(r'"metrics_port":\s*(\d+)', text)}
    return ports


def test_compose_scrape_targets_are_compose_services_and_their_ports():
    """Every target in deploy/prometheus/prometheus.yaml is a compose service on a port it serves metrics on."""
    services = _compose_services()
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    for job in config["scrape_configs"]:
        for target in (t for c in job["static_configs"] for t in c["targets"]):
            host, port = target.rsplit(":", 1)
            assert host in services, f"{job['job_name']}: {host} is no compose service"
            served = _ports_served(services[host]) | ({GatewayConfig().port} if host == "gateway" else set())
            assert int(port) in served, f"{job['job_name']}: {host} serves {sorted(served)}, not {port}"


def test_compose_prometheus_and_grafana_mount_the_shipped_files():
    """Prometheus reads deploy/prometheus/prometheus.yaml (its rule file beside it); Grafana's provisioning reads the
    dashboards folder it mounts and its datasource is the prometheus service's port."""
    services = _compose_services()
    compose_dir = COMPOSE.parent
    mounts = {}
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            source, target = volume.split(":")[:2]
            if source.startswith("."):
                mounts[target] = (compose_dir / source).resolve()
    config_flag = next(a for a in services["prometheus"]["command"] if a.startswith("--config.file="))
    config_path = Path(config_flag.split("=", 1)[1])
    assert mounts[str(config_path.parent)] / config_path.name == SCRAPE_CONFIG
    assert mounts["/etc/grafana/provisioning"] == GRAFANA / "provisioning"
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "kvpush.yaml").read_text())["providers"][0]
    assert mounts[provider["options"]["path"]] == DASHBOARD.parent
    datasource = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    source = datasource["datasources"][0]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert any(p.endswith(":9090") for p in services["prometheus"]["ports"])
