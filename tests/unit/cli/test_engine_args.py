"""`kvpush engine-args` is the one source of engine flags: what it prints, and every document's engine command.

README.md, docs/gateway.md, the EC2 run-book and the k8s manifests call it (`$(kvpush engine-args ...)`): their engine
commands run here through bash as written, with a stand-in `vllm` on PATH that prints the arguments it got, which
must hold exactly what `kvpush engine-args` prints for the same settings, pass vLLM's own argument parser and name no
`--logits-processors`. The compose file carries the printed list itself, under the command that printed it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvpush.cli.main import main
from kvpush.connector.config import ConnectorConfig
from kvpush.gateway.hosted import hosted_config

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent  # kvpush, python
HOSTED_GATEWAY = "kvpush.gateway.hosted.HostedGateway"
# Values for the documents' shell variables (the k8s ConfigMap adds its own).
SAMPLE_ENV = {"MODEL": "org/model-8b", "HOST_IP": "10.0.0.7", "DIRECTORY": "dir.internal:50051",
              "POD_NAME": "kvpush-prefill-7f9c", "POD_IP": "10.1.2.3", "KVPUSH_DIRECTORY_TOKEN": "t0ken"}
# A `vllm` that prints what it was given (and the hosted gateway's flags), instead of serving.
FAKE_VLLM = """#!/bin/sh
exec "$KVPUSH_TEST_PYTHON" -c 'import json, os, sys; print(json.dumps({"argv": sys.argv[1:],
    "gateway_args": os.environ.get("KVPUSH_GATEWAY_ARGS")}))' "$@"
"""


def engine_args(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(["engine-args", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------- what it prints


@pytest.mark.parametrize("role, kv_role", [("prefill", "kv_producer"), ("decode", "kv_consumer")])
def test_prints_the_connector_config_of_the_role(capsys, role, kv_role):
    """The words are vLLM's --port and a --kv-transfer-config the connector accepts, for that role, registering the
    endpoint the gateway reaches; nothing forces the first token with a logits processor."""
    code, out, _ = engine_args(["--role", role, "--directory", "dir:50051", "--port", "9100", "--advertise-host",
                                "10.0.0.7", "--engine-id", "e-1", "--metrics-port", "9400"], capsys)
    assert code == 0
    words = out.split()
    assert words[:2] == ["--port", "9100"] and words[2] == "--kv-transfer-config" and len(words) == 4
    config = json.loads(words[3])
    assert (config["kv_connector"], config["kv_connector_module_path"], config["kv_role"], config["engine_id"]) == (
        "KVPushConnector", "kvpush.connector", kv_role, "e-1")
    parsed = ConnectorConfig.from_extra_config(config["kv_connector_extra_config"], role=role, engine_id="e-1")
    assert (parsed.directory_address, parsed.engine_endpoint, parsed.metrics_port) == (
        "dir:50051", "http://10.0.0.7:9100", 9400)
    assert "logits" not in out and "directory_token" not in out


def test_formats_are_one_list(capsys):
    """words (for `$(...)`), shell (quoted) and json print the same arguments."""
    flags = ["--role", "prefill", "--block-size", "128", "--nixl-backends", "LIBFABRIC", "--hosted-gateway"]
    _, words, _ = engine_args(flags, capsys)
    _, shell, _ = engine_args([*flags, "--format", "shell"], capsys)
    _, listed, _ = engine_args([*flags, "--format", "json"], capsys)
    assert words.split() == shlex.split(shell) == json.loads(listed)
    assert json.loads(listed)[-2:] == ["--middleware", HOSTED_GATEWAY]
    assert json.loads(json.loads(listed)[5])["kv_connector_extra_config"]["nixl_backends"] == ["LIBFABRIC"]


@pytest.mark.parametrize("flags, reason", [
    (["--role", "decode", "--hosted-gateway"], "--hosted-gateway is for prefill engines"),
    (["--role", "prefill", "--directory", "no-port"], "directory_address must be 'host:port'"),
    (["--role", "prefill", "--extra-config", '{"bogus": 1}'], "unknown key(s) ['bogus']"),
    (["--role", "prefill", "--extra-config", "[1]"], "--extra-config must be a JSON object"),
    (["--role", "prefill", "--nixl-backends", "CARRIER-PIGEON"], "unknown backend 'CARRIER-PIGEON'"),
    (["--role", "prefill", "--advertise-host", "a b"], "would not survive"),
    (["--role", "prefill", "--port", "70000"], "is not a port"),
])
def test_settings_an_engine_would_refuse_exit_2_with_the_reason(capsys, flags, reason):
    """Refused here, with the connector's own reason, rather than at the engine's start; nothing is printed."""
    code, out, err = engine_args(flags, capsys)
    assert (code, out) == (2, "")
    assert reason in err, err


# ---------------------------------------------------------------- the documents


@pytest.fixture(scope="module")
def vllm_parser():
    """vLLM's own `vllm serve` argument parser (the installed release's)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


@pytest.fixture
def shell_env(tmp_path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "vllm").write_text(FAKE_VLLM)
    (bin_dir / "vllm").chmod(0o755)
    return {"PATH": f"{bin_dir}:{BIN}:{os.environ['PATH']}", "KVPUSH_TEST_PYTHON": sys.executable, **SAMPLE_ENV}


def _engine_args_invocations(command: str) -> list[str]:
    """The text inside each `$(kvpush engine-args ...)` of a shell command (nested `$(...)` kept)."""
    found = []
    for match in re.finditer(r"\$\(kvpush engine-args ", command):
        depth, index = 1, match.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(command[index], 0)
            index += 1
        found.append(command[match.start() + 2:index - 1])
    return found


def _logical_lines(text: str) -> list[str]:
    return [line.strip() for line in text.replace("\\\n", " ").splitlines()]


def _doc_engine_commands() -> list[tuple[str, str, str]]:
    """(file, shell, command) for every engine command of the documents that call `kvpush engine-args` (the k8s
    containers' scripts run under /bin/sh, as their `command` says)."""
    commands = []
    for name in ("README.md", "docs/gateway.md", "deploy/ec2-efa/README.md"):
        for line in _logical_lines((ROOT / name).read_text()):
            if "$(kvpush engine-args " in line and not line.startswith("#"):
                commands.append((name, "bash", line.removesuffix("&").strip()))
    for doc in yaml.safe_load_all((ROOT / "deploy/k8s/engines.yaml").read_text()):
        for container in doc["spec"]["template"]["spec"]["containers"]:
            assert container["command"] == ["/bin/sh", "-c"]
            commands.append(("deploy/k8s/engines.yaml", "sh", container["args"][0]))
    return commands


def _k8s_env() -> dict[str, str]:
    config = next(d for d in yaml.safe_load_all((ROOT / "deploy/k8s/config.yaml").read_text()) if d)
    return dict(config["data"])


def test_every_document_has_its_engine_commands():
    """Each document starts both roles' engines through `kvpush engine-args` (the hosted gateway's: prefill)."""
    roles: dict[str, set[str]] = {}
    for name, _, command in _doc_engine_commands():
        for invocation in _engine_args_invocations(command):
            roles.setdefault(name, set()).add(re.search(r"--role (\w+)", invocation).group(1))
    assert roles == {"README.md": {"prefill", "decode"}, "docs/gateway.md": {"prefill"},
                     "deploy/ec2-efa/README.md": {"prefill"}, "deploy/k8s/engines.yaml": {"prefill", "decode"}}


@pytest.mark.parametrize("name", ["README.md", "deploy/ec2-efa/README.md", "deploy/k8s/engines.yaml",
                                  "deploy/compose/docker-compose.yaml"])
def test_no_document_loads_a_logits_processor(name):
    """The decode engine forces prefill's first token by itself: no engine document passes --logits-processors
    (docs/gateway.md's engine command is checked below, with every other)."""
    assert "--logits-processors" not in (ROOT / name).read_text()


@pytest.mark.parametrize("name, shell, command", [pytest.param(*c, id=f"{c[0]}-{i}")
                                                  for i, c in enumerate(_doc_engine_commands())])
def test_document_engine_command_runs_with_exactly_the_printed_flags(vllm_parser, shell_env, name, shell, command):
    """The command, run by the shell as written, hands `vllm serve` the model and exactly what `kvpush engine-args`
    prints for its settings, and vLLM's parser accepts every flag; a hosted gateway's flags parse too."""
    env = {**shell_env, **(_k8s_env() if name.endswith(".yaml") else {})}
    done = subprocess.run([shell, "-c", command], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    given = json.loads(done.stdout)
    argv = given["argv"]
    assert argv[:2] == ["serve", env["MODEL"]], argv
    assert "--logits-processors" not in argv
    [invocation] = _engine_args_invocations(command)
    printed = subprocess.run([shell, "-c", f"{invocation} --format json"], capture_output=True, text=True, env=env,
                             timeout=120)
    assert printed.returncode == 0, printed.stderr
    flags = json.loads(printed.stdout)
    at = argv.index(flags[0])
    assert argv[at:at + len(flags)] == flags, (argv, flags)
    assert "--kv-transfer-config" not in argv[:at] + argv[at + len(flags):]  # one connector config: the printed one
    parsed = vllm_parser.parse_args(argv[1:])
    assert parsed.model_tag == env["MODEL"]
    if "--middleware" in flags:
        assert HOSTED_GATEWAY in parsed.middleware
        assert hosted_config({"KVPUSH_GATEWAY_ARGS": given["gateway_args"]}).local_prefill_engine_id == "prefill-0"


def test_compose_engines_carry_exactly_the_printed_flags(vllm_parser):
    """Each compose engine's flags after --model are the list its comment's `kvpush engine-args` command prints."""
    text = (ROOT / "deploy/compose/docker-compose.yaml").read_text()
    services = yaml.safe_load(text)["services"]
    for role in ("prefill", "decode"):
        block = text[text.index(f"\n  {role}:\n") + 1:]
        block = block[:re.search(r"\n  [a-z]", block).start()]  # up to the next service
        [comment] = re.findall(r"#\s+(kvpush engine-args [^\n]+)", block)
        printed = subprocess.run(["bash", "-c", comment], capture_output=True, text=True, timeout=120,
                                 env={"PATH": f"{BIN}:{os.environ['PATH']}"})
        assert printed.returncode == 0, printed.stderr
        command = services[role]["command"]
        assert command[0].startswith("--model=${MODEL:?") and f"--role {role}" in comment
        assert command[1:] == json.loads(printed.stdout)
        assert services[role]["environment"]["KVPUSH_DIRECTORY_TOKEN"]  # the connector reads it from there
        assert vllm_parser.parse_args(["--model=org/model", *command[1:]]).block_size == 128
