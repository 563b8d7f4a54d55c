"""Imports between kvpush's packages go one way, read from the source (AST) of src/kvpush:

- kvpush.dataplane imports nothing of the directory's API, the directory, its client, the gateway, the connector,
  the CLI or the local stack: it moves bytes between engines and is told what to move;
- kvpush.client imports nothing of the directory server, the gateway, the connector, the CLI or the local stack;
- kvpush.api imports nothing of kvpush outside itself, not even the generated kvpush.v1: its contracts are read by
  every process (the connector inside vLLM included), so they pull in no other part of kvpush;
- no runtime package (everything but kvpush.localstack) imports kvpush.localstack: it needs the dev extra, so a
  bare install would fail at import. The one exception is `kvpush up`'s import inside the function that runs it.

Every import counts, at module level or inside a function (a lazy import still ties the packages), except the
listed lazy ones. The rules are checked against a planted tree too, so the check itself can fail.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"


@dataclass(frozen=True, slots=True)
class Import:
    """One import statement's target, resolved to an absolute module name."""

    importer: str  # the importing module, e.g. kvpush.cli.main
    imported: str  # e.g. kvpush.localstack.up
    line: int
    function: str | None  # the enclosing function of a lazy import; None at module (or class) level


@dataclass(frozen=True, slots=True)
class Rule:
    """Modules under `importer` import nothing under `forbidden` that is not under `permitted`, but for the `allowed`
    lazy imports."""

    importer: str
    forbidden: tuple[str, ...]
    allowed: frozenset[tuple[str, str, str]] = frozenset()  # (importer module, function, imported)
    exempt: tuple[str, ...] = ()  # packages under `importer` the rule does not cover
    permitted: tuple[str, ...] = ()  # packages under `forbidden` that may be imported all the same

    def forbids(self, imported: str) -> bool:
        return (any(_within(imported, f) for f in self.forbidden)
                and not any(_within(imported, p) for p in self.permitted))

    def covers(self, module: str) -> bool:
        return _within(module, self.importer) and not any(_within(module, e) for e in self.exempt)


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


RULES = (
    Rule("kvpush.dataplane", tuple(f"kvpush.{p}" for p in (
        "v1", "directory", "client", "gateway", "connector", "cli", "localstack"))),
    Rule("kvpush.client", tuple(f"kvpush.{p}" for p in ("directory", "gateway", "connector", "cli", "localstack"))),
    Rule("kvpush.api", ("kvpush",), permitted=("kvpush.api",)),
    Rule("kvpush", ("kvpush.localstack",), exempt=("kvpush.localstack",),
         allowed=frozenset({("kvpush.cli.main", "_up", "kvpush.localstack.up")})),
)


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base[:len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_in(path: Path, src: Path) -> Iterator[Import]:
    """Every import of one file, with the function it sits in."""
    importer = module_name(path, src)
    is_package = path.name == "__init__.py"

    def visit(node: ast.AST, function: str | None) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield Import(importer, alias.name, child.lineno, function)
            elif isinstance(child, ast.ImportFrom):
                target = _resolve(importer, is_package, child)
                # `from kvpush import localstack` names a package; in `from kvpush.x import y` the module kvpush.x
                # decides (y may be a function or a submodule).
                names = [a.name for a in child.names if a.name != "*"] if target == "kvpush" else []
                for imported in [f"{target}.{name}" for name in names] or [target]:
                    yield Import(importer, imported, child.lineno, function)
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                yield from visit(child, function or child.name)
            else:
                yield from visit(child, function)

    yield from visit(ast.parse(path.read_text(), filename=str(path)), None)


def all_imports(src: Path) -> list[Import]:
    return [i for path in sorted((src / "kvpush").rglob("*.py")) for i in imports_in(path, src)]


def violations(imports: list[Import], rules: tuple[Rule, ...] = RULES) -> list[str]:
    """`importer:line imports imported` for every import a rule forbids."""
    found = []
    for rule in rules:
        for i in imports:
            if not rule.covers(i.importer) or not rule.forbids(i.imported):
                continue
            if i.function is not None and (i.importer, i.function, i.imported) in rule.allowed:
                continue
            where = f" (in {i.function}())" if i.function else ""
            found.append(f"{i.importer}:{i.line} imports {i.imported}{where}")
    return found


def test_imports_go_one_way():
    imports = all_imports(SRC)
    assert len({i.importer for i in imports}) > 50  # the walk saw the tree
    assert violations(imports) == []


def test_the_allowed_lazy_imports_exist():
    """The exceptions name imports that are there: a moved `kvpush up` import updates its entry."""
    imports = all_imports(SRC)
    for rule in RULES:
        for importer, function, imported in rule.allowed:
            assert Import(importer, imported, 0, function) in {
                Import(i.importer, i.imported, 0, i.function) for i in imports}, (importer, function, imported)


def _plant(src: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        path = src / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in [p for p in src.rglob("*") if p.is_dir()]:
        (package / "__init__.py").touch()


def test_planted_violations_are_found(tmp_path):
    """Each kind of import a rule forbids, in a planted tree: absolute, relative, `from kvpush import ...`, lazy in a
    runtime module; the allowed lazy import, the local stack's own imports and allowed directions are not reported."""
    _plant(tmp_path, {
        "kvpush/dataplane/writer.py": "from kvpush.connector.outcome import Outcome\nfrom kvpush.api import shards\n",
        "kvpush/dataplane/layout.py": "def wire():\n    from kvpush.v1 import types_pb2\n",
        "kvpush/client/client.py": "from ..directory.shards import shard_of\nfrom kvpush.v1 import types_pb2\n",
        "kvpush/client/__init__.py": "from . import client\nfrom kvpush import cli\n",
        "kvpush/gateway/app.py": "import kvpush.localstack.stack\n",
        "kvpush/gateway/hosted.py": "class Hosted:\n    async def start(self):\n"
                                    "        from kvpush import localstack\n",
        "kvpush/cli/engine_args.py": "from kvpush.localstack.stack import kv_transfer_config\n",
        "kvpush/cli/main.py": "def _up(args):\n    from kvpush.localstack.up import run\n    return run(args)\n"
                              "def _serve(args):\n    from kvpush.localstack.up import read_state\n",
        "kvpush/localstack/stack.py": "from kvpush.cli.engine_args import kv_transfer_config\n"
                                      "from kvpush.localstack.model import TinyModelSpec\n",
    })
    assert sorted(violations(all_imports(tmp_path))) == [
        "kvpush.cli.engine_args:1 imports kvpush.localstack.stack",
        "kvpush.cli.main:5 imports kvpush.localstack.up (in _serve())",
        "kvpush.client.client:1 imports kvpush.directory.shards",
        "kvpush.client:2 imports kvpush.cli",
        "kvpush.dataplane.layout:2 imports kvpush.v1 (in wire())",
        "kvpush.dataplane.writer:1 imports kvpush.connector.outcome",
        "kvpush.gateway.app:1 imports kvpush.localstack.stack",
        "kvpush.gateway.hosted:3 imports kvpush.localstack (in start())",
    ]


def test_planted_api_imports_of_other_kvpush_packages_are_found(tmp_path):
    """kvpush.api importing the generated API, another package lazily or through `from kvpush import ...` is
    reported; its imports of itself (absolute or relative) and of other distributions are not."""
    _plant(tmp_path, {
        "kvpush/api/params.py": "import re\nfrom kvpush.v1 import types_pb2\nfrom kvpush.api.shards import shard_of\n"
                                "from . import outcome\n",
        "kvpush/api/shards.py": "import grpc\ndef redirect():\n    from kvpush.directory.state import Limits\n",
        "kvpush/api/outcome.py": "from kvpush import connector\nimport kvpush.api.params\n",
        "kvpush/gateway/app.py": "from kvpush.api.params import TransferParams\n",
    })
    assert sorted(violations(all_imports(tmp_path))) == [
        "kvpush.api.outcome:1 imports kvpush.connector",
        "kvpush.api.params:2 imports kvpush.v1",
        "kvpush.api.shards:3 imports kvpush.directory.state (in redirect())",
    ]
