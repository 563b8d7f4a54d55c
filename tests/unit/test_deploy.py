"""The deployment files parse, and every flag and connector setting they pass is one kvpush accepts."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from kvpush.connector.config import ConnectorConfig
from kvpush.services.cli.main import build_parser
from kvpush.services.gateway.config import parse_args as parse_gateway_args

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose" / "docker-compose.yaml").read_text())


def _kv_transfer_configs(text: str) -> list[dict]:
    """Every --kv-transfer-config JSON object in a file, after shell-style unescaping and env substitution."""
    found = []
    for match in re.finditer(r"--kv-transfer-config[= ]\"?(\{.*?\}\})\"?", text, re.S):
        raw = match.group(1).replace('\\"', '"').replace("\n", " ")
        raw = re.sub(r"\$\{?[A-Z_]+(:-[^}]*)?\}?", "x", raw)
        found.append(json.loads(raw))
    return found


def test_compose_parses_and_ships_jaeger_with_otlp() -> None:
    """The compose file is valid YAML with Jaeger's OTLP port and every kvpush service pointed at it."""
    services = _compose()["services"]
    assert {"jaeger", "directory", "prefill", "decode", "gateway"} <= set(services)
    assert "4317:4317" in services["jaeger"]["ports"]
    for name in ("directory", "prefill", "decode", "gateway"):
        assert services[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"


@pytest.mark.parametrize("path", ["compose/docker-compose.yaml", "k8s/engines.yaml"])
def test_engine_kv_transfer_configs_are_accepted_by_the_connector(path: str) -> None:
    """Each engine's kv_transfer_config names our connector and its extra config passes the connector's parser."""
    configs = _kv_transfer_configs((DEPLOY / path).read_text())
    assert len(configs) == 2
    roles = set()
    for config in configs:
        assert config["kv_connector"] == "KVPushConnector"
        assert config["kv_connector_module_path"] == "kvpush.connector"
        role = {"kv_producer": "prefill", "kv_consumer": "decode"}[config["kv_role"]]
        parsed = ConnectorConfig.from_extra_config(config["kv_connector_extra_config"], role=role, engine_id="e")
        assert parsed.directory_address.endswith(":50051")
        roles.add(role)
    assert roles == {"prefill", "decode"}


def test_k8s_manifests_parse_and_probe_the_directory_over_grpc() -> None:
    """The k8s documents parse; the directory is probed with gRPC health (allowed without a token)."""
    docs = [d for f in sorted((DEPLOY / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text())]
    kinds = [d["kind"] for d in docs]
    assert kinds.count("Deployment") == 3 and "Service" in kinds
    directory = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kvpush-directory")
    container = directory["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["grpc"]["port"] == 50051
    build_parser().parse_args(["directory", *container["args"]])


def _dockerfile_command(name: str) -> list[str]:
    text = (DEPLOY / "docker" / name).read_text()
    cmd = re.search(r"^CMD (\[.*\])$", text, re.M)
    return json.loads(cmd.group(1)) if cmd else []


def test_images_pass_flags_their_entry_points_accept() -> None:
    """The directory and gateway images start with flags their parsers accept, listening on all interfaces."""
    directory_args = build_parser().parse_args(["directory", *_dockerfile_command("Dockerfile.directory")])
    assert directory_args.host == "0.0.0.0"
    gateway = parse_gateway_args([*_dockerfile_command("Dockerfile.gateway"), "--directory", "d:50051"])
    assert (gateway.host, gateway.port) == ("0.0.0.0", 8080)


def test_sagemaker_serve_starts_the_gateway_on_port_8080() -> None:
    """SageMaker's `serve` runs the gateway on 0.0.0.0:8080 with flags the gateway accepts."""
    line = [l for l in (DEPLOY / "sagemaker" / "serve").read_text().splitlines() if l.startswith("exec ")][0]
    argv = shlex.split(line)[4:-1]  # drop exec python -m module, and "$@"
    gateway = parse_gateway_args([*argv, "--directory", "d:50051"])
    assert (gateway.host, gateway.port) == ("0.0.0.0", 8080)
