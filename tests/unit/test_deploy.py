"""The deployment files are valid against their schemas, define every setting they use, and the gateway
image's entry command starts (run here outside Docker) and answers SageMaker's /ping and /invocations."""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvpush.cli.main import build_parser
from kvpush.client import ChannelConfig, SyncDirectoryClient
from kvpush.connector.compat import SUPPORTED_MAX, SUPPORTED_MIN, parse_release
from kvpush.gateway.config import parse_args as parse_gateway_args
from kvpush.localstack.client import call
from kvpush.localstack.processes import ManagedProcess, free_port, http_ok, start_directory
from kvpush.v1 import directory_pb2 as dpb
from kvpush.v1 import types_pb2 as tpb
from tests.unit.services.gateway.standin import StandInEngine

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_SCHEMA = ROOT / "tests" / "fixtures" / "schemas" / "compose-spec.json"
# The oldest Kubernetes the manifests promise to run on (gRPC probes are GA since 1.27).
KUBERNETES_VERSION = "1.29.0"


def _compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose" / "docker-compose.yaml").read_text())


def _k8s_docs() -> list[dict]:
    return [d for f in sorted((DEPLOY / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]


# ---------------------------------------------------------------- compose


def test_compose_file_is_valid_against_the_compose_spec():
    """The compose file validates against the (vendored) compose-spec JSON schema."""
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    jsonschema.validate(_compose(), schema)


def test_compose_schema_check_can_fail():
    """The same check refuses a service with a misspelt key (so the test above means something)."""
    broken = _compose()
    broken["services"]["gateway"]["enviroment"] = {"X": "1"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, json.loads(COMPOSE_SCHEMA.read_text()))


def test_compose_ships_jaeger_with_otlp_and_requires_a_model():
    """Jaeger's OTLP port is open, every kvpush service exports to it, and MODEL must be set (no silent blank)."""
    services = _compose()["services"]
    assert {"jaeger", "directory", "prefill", "decode", "gateway"} <= set(services)
    assert "4317:4317" in services["jaeger"]["ports"]
    for name in ("directory", "prefill", "decode", "gateway"):
        assert services[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
    for name in ("prefill", "decode"):
        model = next(a for a in services[name]["command"] if a.startswith("--model="))
        assert model.startswith("--model=${MODEL:?"), model


# Engine flags (the connector's config): tests/unit/cli/test_engine_args.py runs each engine command as written and
# compares it with what `kvpush engine-args` prints.


# ---------------------------------------------------------------- kubernetes


def test_k8s_manifests_are_valid_kubernetes_objects():
    """Every k8s document validates (strictly: no unknown fields) against the Kubernetes OpenAPI schemas."""
    docs = _k8s_docs()
    assert {d["kind"] for d in docs} == {"ConfigMap", "Secret", "Deployment", "Service", "StatefulSet"}
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_k8s_schema_check_can_fail():
    """The same check refuses a container with a misspelt field."""
    gateway = next(d for d in _k8s_docs() if d["kind"] == "Deployment" and d["metadata"]["name"] == "kvpush-gateway")
    gateway["spec"]["template"]["spec"]["containers"][0]["enviroment"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(gateway, KUBERNETES_VERSION, strict=True)


def _container_env_names(container: dict, config_maps: dict[str, dict], secrets: dict[str, dict]) -> set[str]:
    names = {e["name"] for e in container.get("env", [])}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            names |= set(config_maps[source["configMapRef"]["name"]]["data"])
        if "secretRef" in source:
            names |= set(secrets[source["secretRef"]["name"]].get("stringData", {}))
    return names


def test_k8s_containers_define_every_variable_they_use():
    """Each $VAR in a container's command is defined by its env or envFrom, and every reference resolves."""
    docs = _k8s_docs()
    config_maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    assert {d["metadata"]["name"] for d in deployments} == {"kvpush-directory", "kvpush-prefill", "kvpush-decode",
                                                             "kvpush-gateway"}
    for deployment in deployments:
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            defined = _container_env_names(container, config_maps, secrets)
            text = " ".join(container.get("command", []) + container.get("args", []))
            assigned = set(re.findall(r"(?:^|[\s;&])([A-Za-z_][A-Za-z0-9_]*)=", text))  # the script's own variables
            used = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", text)) - assigned
            assert used <= defined, f"{deployment['metadata']['name']}: {sorted(used - defined)} undefined"
            for entry in container.get("env", []):
                ref = entry.get("valueFrom", {})
                if "configMapKeyRef" in ref:
                    assert ref["configMapKeyRef"]["key"] in config_maps[ref["configMapKeyRef"]["name"]]["data"]
                if "secretKeyRef" in ref:
                    assert ref["secretKeyRef"]["key"] in secrets[ref["secretKeyRef"]["name"]]["stringData"]
            for source in container.get("envFrom", []):
                assert source.get("configMapRef", source.get("secretRef"))["name"] in {**config_maps, **secrets}
    assert config_maps["kvpush-config"]["data"]["MODEL"]


def test_k8s_services_select_deployments_and_name_their_ports():
    """Each Service selects a Deployment's (or StatefulSet's) pods and targets a port that container declares."""
    docs = _k8s_docs()
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Deployment", "StatefulSet")}
    for service in (d for d in docs if d["kind"] == "Service"):
        matching = [d for d in deployments.values()
                    if service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert matching, f"service {service['metadata']['name']} selects no deployment"
        ports = {p["name"] for c in matching[0]["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports


def test_k8s_commands_pass_flags_their_programs_accept():
    """The directory and gateway containers start with flags their parsers accept; probes use real routes."""
    deployments = {d["metadata"]["name"]: d for d in _k8s_docs() if d["kind"] == "Deployment"}
    directory = deployments["kvpush-directory"]["spec"]["template"]["spec"]["containers"][0]
    assert directory["readinessProbe"]["grpc"]["port"] == 50051
    build_parser().parse_args(["directory", *directory["args"]])
    gateway = deployments["kvpush-gateway"]["spec"]["template"]["spec"]["containers"][0]
    assert parse_gateway_args([*gateway["args"], "--directory", "d:50051"]).port == 8080
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/ping"


def test_k8s_directory_replicas_share_the_manifests_etcd():
    """N directory replicas point at the etcd members the manifests run; each advertises its own pod address."""
    docs = _k8s_docs()
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    directory = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kvpush-directory")
    etcd = next(d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "kvpush-etcd")
    etcd_service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "kvpush-etcd")
    assert directory["spec"]["replicas"] >= 2 and directory["spec"]["strategy"]["type"] == "RollingUpdate"
    host, port = config["KVPUSH_DIRECTORY_ETCD_ENDPOINTS"].split(":")
    assert host == etcd_service["metadata"]["name"] and etcd_service["spec"]["clusterIP"] == "None"
    assert int(port) in {p["port"] for p in etcd_service["spec"]["ports"]}
    command = etcd["spec"]["template"]["spec"]["containers"][0]["command"]
    cluster = next(a for a in command if a.startswith("--initial-cluster="))
    members = [m.split("=")[0] for m in cluster.split("=", 1)[1].split(",")]
    assert members == [f"kvpush-etcd-{i}" for i in range(etcd["spec"]["replicas"])]
    args = build_parser().parse_args(["directory", *directory["spec"]["template"]["spec"]["containers"][0]["args"]])
    assert args.advertise_address == "$(POD_IP):50051" and args.replica_id == "$(POD_NAME)"
    env = {e["name"] for e in directory["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert {"POD_IP", "POD_NAME"} <= env


def test_compose_runs_directory_replicas_on_an_etcd_service():
    """compose: an etcd service, two directory replicas on it, and clients that list both."""
    services = _compose()["services"]
    assert "etcd" in services
    replicas = [n for n in services if n.startswith("directory")]
    assert len(replicas) >= 2
    for name in replicas:
        args = build_parser().parse_args(["directory", *services[name]["command"]])
        assert args.etcd_endpoints == "etcd:2379" and args.advertise_address == f"{name}:50051"
        assert services[name]["depends_on"]["etcd"]["condition"] == "service_healthy"
    assert services["gateway"]["environment"]["KVPUSH_DIRECTORY_ADDRESS"] == ",".join(f"{n}:50051" for n in replicas)


# ---------------------------------------------------------------- images


# Each image's Dockerfile: the services' in services/<name>/, the engine's beside the connector.
DOCKERFILES = {
    "directory": ROOT / "services" / "directory" / "Dockerfile",
    "gateway": ROOT / "services" / "gateway" / "Dockerfile",
    "engine": ROOT / "connector" / "Dockerfile",
    "engine-cpu": ROOT / "connector" / "Dockerfile.cpu",
}


def _dockerfile(name: str) -> str:
    return DOCKERFILES[name].read_text()


def _json_instruction(text: str, keyword: str) -> list[str]:
    found = re.search(rf"^{keyword} (\[.*\])$", text, re.M)
    return json.loads(found.group(1)) if found else []


def _copied_files(text: str) -> dict[str, Path]:
    """Image path -> repository file for each single-file COPY of a Dockerfile."""
    copies = {}
    for source, target in re.findall(r"^COPY (\S+) (\S+)$", text, re.M):
        if (ROOT / source).is_file():
            copies[target] = ROOT / source
    return copies


def test_engine_image_builds_on_a_vllm_release_the_connector_loads_in() -> None:
    """The engine image's default base is inside the connector's supported range (it refuses others at load), and
    the image installs the kvpush wheel and its dependencies from the hashed lock only (no package named by hand);
    tests/unit/test_wheel.py runs its install steps in a clean venv."""
    text = _dockerfile("engine")
    tag = re.search(r"^ARG VLLM_IMAGE=vllm/vllm-openai:v(\S+)$", text, re.M)
    assert tag, "connector/Dockerfile names no default vllm-openai image"
    assert SUPPORTED_MIN <= parse_release(tag.group(1)) <= SUPPORTED_MAX, tag.group(1)
    assert re.search(r"^COPY dist/kvpush-\*\.whl ", text, re.M)
    assert "install-kvpush.sh deps /tmp/kvpush/runtime.lock --keep-installed" in text
    assert "pip install" not in _instructions(text)


@pytest.mark.parametrize("name", ["directory", "gateway", "engine-cpu"])
def test_images_install_the_wheel_from_a_lock_on_a_named_base(name: str) -> None:
    """The images `make images` builds take their base from BASE_IMAGE (public python:3.11-slim by default) and
    install the wheel with every dependency from a lock that exists, at dev.lock's versions."""
    text = _dockerfile(name)
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text, re.M) and "FROM ${BASE_IMAGE}" in text
    lock = re.search(r"install-kvpush\.sh deps /tmp/kvpush/(\S+\.lock)$", text, re.M)
    assert lock and (ROOT / "requirements" / lock.group(1)).is_file(), lock
    assert re.search(r"^COPY dist/kvpush-\*\.whl /tmp/kvpush/$", text, re.M)
    assert "install-kvpush.sh wheel /tmp/kvpush/kvpush-*.whl" in text
    assert "pip install" not in _instructions(text)
    dev = _pins(ROOT / "requirements" / "dev.lock")
    assert {n: v for n, v in _pins(ROOT / "requirements" / lock.group(1)).items() if dev.get(n) != v} == {}


def _instructions(dockerfile: str) -> str:
    """A Dockerfile without its comment lines."""
    return re.sub(r"(?m)^#.*$", "", dockerfile)


def _pins(lock: Path) -> dict[str, str]:
    return dict(re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)", lock.read_text(), re.M))


def test_install_docs_build_the_images_the_manifests_run() -> None:
    """docs/install.md's image builds use the Dockerfiles here and tag what deploy/k8s runs."""
    builds = re.findall(r"^docker build -f (\S+) -t (\S+) \.$", (ROOT / "docs" / "install.md").read_text(), re.M)
    assert {ROOT / f for f, _ in builds} == {DOCKERFILES[n] for n in ("directory", "gateway", "engine")}
    assert all((ROOT / f).is_file() for f, _ in builds)
    manifests = {c["image"] for d in _k8s_docs() if d["kind"] == "Deployment"
                 for c in d["spec"]["template"]["spec"]["containers"] if c["image"].startswith("kvpush/")}
    assert manifests == {tag for _, tag in builds}


def test_images_pass_flags_their_entry_points_accept() -> None:
    """The directory and gateway images start with flags their parsers accept, listening on all interfaces."""
    directory_args = build_parser().parse_args(["directory", *_json_instruction(_dockerfile("directory"),
                                                                               "CMD")])
    assert directory_args.host == "0.0.0.0"
    gateway = parse_gateway_args([*_json_instruction(_dockerfile("gateway"), "CMD"), "--directory", "d:1"])
    assert (gateway.host, gateway.port) == ("0.0.0.0", 8080)


def test_gateway_image_ships_its_entry_scripts_executable():
    """The gateway image copies its entry point and SageMaker's `serve` onto PATH, from executable files in git."""
    text = _dockerfile("gateway")
    copies = _copied_files(text)
    entrypoint = _json_instruction(text, "ENTRYPOINT")
    assert entrypoint[0] in copies and "/usr/local/bin/serve" in copies
    for source in (copies[entrypoint[0]], copies["/usr/local/bin/serve"]):
        assert os.access(source, os.X_OK), f"{source} is not executable"


class _Engines:
    """A real directory with a stand-in prefill and decode engine registered (HTTP servers on loopback)."""

    def __init__(self, log_dir: Path) -> None:
        self.prefill = StandInEngine("prefill").start()
        self.decode = StandInEngine("decode").start()
        self.directory = start_directory(log_dir)
        self.client = SyncDirectoryClient(ChannelConfig(address=self.directory.address, timeout_s=5.0))
        region = 4096 * 64
        layout = tpb.KVLayout(layer_count=2, block_size_tokens=16, block_count=64, block_bytes_per_layer=4096,
                              dtype="bfloat16", memory_kind=tpb.MEMORY_KIND_DRAM, layer_region_bytes=region,
                              layer_base_addresses=[region, 2 * region],
                              planes=[tpb.KVPlane(block_stride_bytes=4096, block_bytes=4096, segment_count=1,
                                                  token_stride_bytes=256, segment_bytes_per_token=256)])
        for engine, role in ((self.prefill, tpb.ENGINE_ROLE_PREFILL), (self.decode, tpb.ENGINE_ROLE_DECODE)):
            self.client.start_registration(dpb.RegisterEngineRequest(
                engine_id=f"image-{engine.name}", role=role, tp_rank=0, tp_size=1, agent_name=f"agent-{engine.name}",
                agent_metadata=b"md", layout=layout, endpoint=engine.url, model="tiny"))

    def stop(self) -> None:
        self.client.close()
        self.directory.process.stop(grace_s=5.0)
        self.prefill.stop()
        self.decode.stop()


@pytest.mark.parametrize("argv", [["serve"], []], ids=["sagemaker-serve", "default-cmd"])
def test_gateway_image_entry_command_answers_ping_and_invocations(tmp_path, argv):
    """The image's ENTRYPOINT, run as `docker run IMAGE serve` (and with the default CMD) runs here, outside
    Docker, with the image's files on PATH: /ping is 200 and /invocations returns the decode engine's answer."""
    text = _dockerfile("gateway")
    copies = _copied_files(text)
    bin_dir = tmp_path / "image-bin"  # the image's /usr/local/bin
    bin_dir.mkdir()
    for target, source in copies.items():
        if target.startswith("/usr/local/bin/"):
            (bin_dir / Path(target).name).symlink_to(source)
    entrypoint = [str(bin_dir / Path(p).name) if p in copies else p for p in _json_instruction(text, "ENTRYPOINT")]
    args = argv or _json_instruction(text, "CMD")
    engines = _Engines(tmp_path)
    port = free_port()
    if not argv:  # the default CMD binds 8080, which may be taken on a shared machine: same flags, another port
        args = [*args[:args.index("--port") + 1], str(port)]
    env = {"PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "SAGEMAKER_BIND_TO_PORT": str(port), "KVPUSH_DIRECTORY_ADDRESS": engines.directory.address,
           "KVPUSH_LOG_FORMAT": "json"}
    gateway = ManagedProcess("image-gateway", [*entrypoint, *args], tmp_path / "gateway.log", env=env, cwd=tmp_path)
    try:
        gateway.start()
        url = f"http://127.0.0.1:{port}"
        gateway.wait_ready(lambda: http_ok(url + "/ping"), 30)
        ping = call("GET", url + "/ping")
        assert ping.status == 200, ping.text
        answer = call("POST", url + "/invocations", {"model": "tiny", "prompt": "hello", "max_tokens": 3},
                      timeout_s=30)
        assert answer.status == 200, answer.text
        assert answer.body["choices"][0]["text"] == "max_tokens=3"
        assert engines.decode.legs[-1].body["kv_transfer_params"]["transfer_id"] == answer.headers[
            "x-kvpush-transfer-id"]
        chat = call("POST", url + "/invocations",
                    {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout_s=30)
        assert chat.status == 200 and engines.decode.legs[-1].path == "/v1/chat/completions"
    finally:
        gateway.stop(grace_s=5.0)
        engines.stop()


def test_sagemaker_serve_starts_the_gateway_on_port_8080() -> None:
    """`serve` without SAGEMAKER_BIND_TO_PORT runs the gateway on 0.0.0.0:8080 with flags the gateway accepts."""
    line = next(ln for ln in (DEPLOY / "sagemaker" / "serve").read_text().splitlines() if ln.startswith("exec "))
    argv = shlex.split(line.replace('"${SAGEMAKER_BIND_TO_PORT:-8080}"', "8080"))[4:-1]  # drop exec python -m M, "$@"
    gateway = parse_gateway_args([*argv, "--directory", "d:50051"])
    assert (gateway.host, gateway.port) == ("0.0.0.0", 8080)


def test_ec2_runbook_commands_use_flags_that_exist():
    """The EC2/EFA run-book's directory command parses and the link check's benchmark flags exist (its engine command:
    tests/unit/cli/test_engine_args.py)."""
    text = (DEPLOY / "ec2-efa" / "README.md").read_text()
    joined = text.replace("\\\n", " ")
    directory_line = next(line for line in joined.splitlines() if line.strip().startswith("kvpush directory"))
    argv = shlex.split(directory_line.split("#")[0].replace('"$KVPUSH_DIRECTORY_TOKEN"', "t"))[1:]
    args = build_parser().parse_args(argv)
    assert (args.port, args.metrics_port) == (50051, 9090)
    bench = (ROOT / "bench" / "dataplane_bench.py").read_text()
    for flag in re.findall(r"dataplane_bench\.py ((?:--[a-z-]+ ?\S* ?)+)", text):
        for name in re.findall(r"--[a-z-]+", flag):
            assert f'"{name}"' in bench, f"bench/dataplane_bench.py has no {name}"
