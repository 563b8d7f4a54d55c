#!/usr/bin/env python3
"""Snapshot the connector-facing API of one vLLM release from its wheel (or an unpacked tree), by AST.

    scripts/vllm_api_snapshot.py vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl -o tests/fixtures/vllm_api/0.34.json
    scripts/vllm_api_snapshot.py /path/to/site-packages -o tests/fixtures/vllm_api/0.32.json

Nothing of vLLM is imported, so any release's wheel can be read on any machine (no GPU, no torch). The snapshot
holds what KVPushConnector and its first-token logits processor override, call or read: each class's methods
(parameters with kinds and defaults; classmethod / staticmethod / property / abstract), its fields (dataclass,
pydantic, msgspec and enum members) and the attributes its methods assign on `self`; a few module-level
functions and aliases; and how the factory builds a connector. tests/unit/connector/test_vllm_api.py checks the
connector against every committed snapshot (src/kvpush/connector/compat.py names the supported releases).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import zipfile
from pathlib import Path
from typing import Any

_BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
_OUTPUTS = "vllm/v1/outputs.py"
# Class name -> the modules it has lived in across releases (the first that defines it wins).
CLASSES: dict[str, tuple[str, ...]] = {
    "KVConnectorBase_V1": (_BASE,),
    "KVConnectorMetadata": (_BASE,),
    "KVConnectorWorkerMetadata": (_BASE,),
    "KVConnectorHandshakeMetadata": (_BASE,),
    "KVConnectorRole": (_BASE,),
    "SupportsHMA": (_BASE,),
    "KVConnectorTransferResults": (_BASE, _OUTPUTS),
    "KVConnectorOutput": (_OUTPUTS,),
    "ModelRunnerOutput": (_OUTPUTS,),
    "AsyncModelRunnerOutput": (_OUTPUTS,),
    "KVConnectorFactory": ("vllm/distributed/kv_transfer/kv_connector/factory.py",),
    "KVTransferConfig": ("vllm/config/kv_transfer.py",),
    "KVCacheAccess": ("vllm/config/kv_transfer.py", _BASE),
    "VllmConfig": ("vllm/config/vllm.py",),
    "ModelConfig": ("vllm/config/model.py",),
    "CacheConfig": ("vllm/config/cache.py",),
    "SchedulerConfig": ("vllm/config/scheduler.py",),
    "SamplingParams": ("vllm/sampling_params.py",),
    "SchedulerOutput": ("vllm/v1/core/sched/output.py",),
    "NewRequestData": ("vllm/v1/core/sched/output.py",),
    "CachedRequestData": ("vllm/v1/core/sched/output.py",),
    "Request": ("vllm/v1/request.py",),
    "KVCacheBlocks": ("vllm/v1/core/kv_cache_manager.py",),
    "KVCacheConfig": ("vllm/v1/kv_cache_interface.py",),
    "BlockPool": ("vllm/v1/core/block_pool.py",),
    "SpinCondition": ("vllm/distributed/device_communicators/shm_broadcast.py",),
    # The V1 model runner's logits-processor interface (src/kvpush/connector/first_token.py), gone in 0.34 ...
    "LogitsProcessor": ("vllm/v1/sample/logits_processor/interface.py",),
    "BatchUpdate": ("vllm/v1/sample/logits_processor/interface.py",),
    "MoveDirectionality": ("vllm/v1/sample/logits_processor/interface.py",),
    # ... and the V2 model runner's, which replaced it.
    "LogitsProcessorV2": ("vllm/v1/worker/gpu/sample/logits_processor/interface.py",),
}
# Snapshot key -> class name in the source, where they differ.
_SOURCE_NAME = {"LogitsProcessorV2": "LogitsProcessor"}
# Module-level names (functions and aliases): key -> (module, name).
NAMES: dict[str, tuple[str, str]] = {
    "yield_req_data": ("vllm/distributed/kv_transfer/kv_connector/utils.py", "yield_req_data"),
    "get_tensor_model_parallel_rank": ("vllm/distributed/parallel_state.py", "get_tensor_model_parallel_rank"),
    "get_tensor_model_parallel_world_size": ("vllm/distributed/parallel_state.py",
                                             "get_tensor_model_parallel_world_size"),
    "AddedRequest": ("vllm/v1/sample/logits_processor/interface.py", "AddedRequest"),
    "MovedRequest": ("vllm/v1/sample/logits_processor/interface.py", "MovedRequest"),
    "RemovedRequest": ("vllm/v1/sample/logits_processor/interface.py", "RemovedRequest"),
    "KVConnectorBaseType": ("vllm/distributed/kv_transfer/kv_connector/base.py", "KVConnectorBaseType"),
}
# Large classes of which the connector reads a few members: their fields and attributes are kept by name only,
# and their private methods are left out.
NAMES_ONLY = frozenset({"VllmConfig", "ModelConfig", "CacheConfig", "SchedulerConfig", "SamplingParams", "Request",
                        "BlockPool", "SpinCondition", "KVCacheConfig", "ModelRunnerOutput", "KVConnectorFactory"})
_FACTORY = "vllm/distributed/kv_transfer/kv_connector/factory.py"
_VLLM_CONFIG = "vllm/config/vllm.py"
_DECORATOR_FLAGS = {"classmethod": "classmethod", "staticmethod": "staticmethod", "property": "property",
                    "abstractmethod": "abstract", "cached_property": "property"}


class Source:
    """The release's Python files, from a wheel or from a directory that holds `vllm/`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._zip = zipfile.ZipFile(path) if path.is_file() else None
        if self._zip is None and not (path / "vllm").is_dir():
            raise SystemExit(f"{path} is neither a wheel nor a directory holding vllm/")

    def read(self, member: str) -> str | None:
        if self._zip is not None:
            try:
                return self._zip.read(member).decode()
            except KeyError:
                return None
        file = self.path / member
        return file.read_text() if file.is_file() else None

    def version(self) -> str:
        if self._zip is not None:
            for name in self._zip.namelist():
                if name.endswith(".dist-info/METADATA"):
                    found = re.search(r"^Version: (\S+)", self._zip.read(name).decode(), re.MULTILINE)
                    if found:
                        return found.group(1)
        for metadata in sorted(self.path.glob("vllm-*.dist-info/METADATA")) if self._zip is None else ():
            found = re.search(r"^Version: (\S+)", metadata.read_text(), re.MULTILINE)
            if found:
                return found.group(1)
        text = self.read("vllm/_version.py") or ""
        found = re.search(r"""(?:__version__|version)\s*(?::\s*str\s*)?=\s*['"]([^'"]+)""", text)
        if found:
            return found.group(1)
        raise SystemExit(f"cannot tell the vLLM version of {self.path}; pass --version")


def _unparse(node: ast.AST | None) -> str | None:
    return None if node is None else ast.unparse(node)


def describe_function(node: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, Any]:
    """Parameters (name, kind, default) and decorator flags of one function or method."""
    args = node.args
    params: list[dict[str, Any]] = []
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for index, (arg, default) in enumerate(zip(positional, defaults)):
        kind = "positional_only" if index < len(args.posonlyargs) else "positional_or_keyword"
        params.append({"name": arg.arg, "kind": kind, "default": _unparse(default)})
    if args.vararg is not None:
        params.append({"name": args.vararg.arg, "kind": "var_positional", "default": None})
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        params.append({"name": arg.arg, "kind": "keyword_only", "default": _unparse(default)})
    if args.kwarg is not None:
        params.append({"name": args.kwarg.arg, "kind": "var_keyword", "default": None})
    described: dict[str, Any] = {"params": params}
    for decorator in node.decorator_list:
        name = decorator.attr if isinstance(decorator, ast.Attribute) else getattr(decorator, "id", None)
        if isinstance(decorator, ast.Attribute) and decorator.attr in ("setter", "deleter"):
            described["property"] = True
        elif name in _DECORATOR_FLAGS:
            described[_DECORATOR_FLAGS[name]] = True
    if isinstance(node, ast.AsyncFunctionDef):
        described["async"] = True
    return described


def describe_class(node: ast.ClassDef) -> dict[str, Any]:
    """Bases, methods, class-level fields and the attributes its methods assign on `self`."""
    methods: dict[str, Any] = {}
    fields: dict[str, Any] = {}
    attributes: set[str] = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            described = describe_function(item)
            if item.name in methods and described.get("property"):  # a property's setter keeps the getter's entry
                continue
            methods[item.name] = described
            for sub in ast.walk(item):
                targets = sub.targets if isinstance(sub, ast.Assign) else (
                    [sub.target] if isinstance(sub, (ast.AnnAssign, ast.AugAssign)) else [])
                for target in targets:
                    for leaf in ast.walk(target):
                        if (isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name)
                                and leaf.value.id == "self"):
                            attributes.add(leaf.attr)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            fields[item.target.id] = {"annotation": _unparse(item.annotation), "default": _unparse(item.value)}
        elif isinstance(item, ast.Assign):
            for target in item.targets:
                if isinstance(target, ast.Name):
                    fields[target.id] = {"annotation": None, "default": _unparse(item.value)}
    return {"bases": [ast.unparse(base) for base in node.bases], "methods": dict(sorted(methods.items())),
            "fields": fields, "attributes": sorted(attributes - set(fields))}


def _top_level(tree: ast.Module, name: str) -> ast.AST | None:
    for item in tree.body:
        if isinstance(item, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == name:
            return item
        if isinstance(item, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in item.targets):
            return item
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.target.id == name:
            return item
        type_alias = getattr(ast, "TypeAlias", None)  # `type X = ...` (Python 3.12+)
        if type_alias is not None and isinstance(item, type_alias) and item.name.id == name:
            return item
    return None


def _factory(source: Source) -> dict[str, Any]:
    """How the factory builds a connector, and what vLLM does with a connector that is not SupportsHMA."""
    text = source.read(_FACTORY)
    if text is None:
        return {}
    tree = ast.parse(text)
    constructs: list[str] = []
    registered: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id == "connector_cls":
                constructs.append(ast.unparse(node))
            if (isinstance(node.func, ast.Attribute) and node.func.attr == "register_connector" and node.args
                    and isinstance(node.args[0], ast.Constant)):
                registered.append(str(node.args[0].value))
    config = source.read(_VLLM_CONFIG) or ""
    return {
        "constructs": sorted(set(constructs)),
        "registered": sorted(registered),
        # The engine turns the hybrid KV-cache manager off for a connector that is not SupportsHMA (with a
        # warning) unless the user asked for it explicitly, in which case create_connector refuses the connector.
        "non_hma_connector_turns_hma_off": bool(re.search(
            r"if not KVConnectorFactory\.supports_hma_config\(self\.kv_transfer_config\):\s*\n\s*"
            r"need_disable_hybrid_kv_cache_manager = True", config)),
        "nixl_transfer_mode_push": "transfer_mode" in text and "NixlPushConnector" in text,
    }


def snapshot(source: Source, version: str | None = None) -> dict[str, Any]:
    trees: dict[str, ast.Module | None] = {}

    def tree_of(module: str) -> ast.Module | None:
        if module not in trees:
            text = source.read(module)
            trees[module] = None if text is None else ast.parse(text)
        return trees[module]

    classes: dict[str, Any] = {}
    for key, modules in CLASSES.items():
        for module in modules:
            tree = tree_of(module)
            node = None if tree is None else _top_level(tree, _SOURCE_NAME.get(key, key))
            if isinstance(node, ast.ClassDef):
                described = describe_class(node)
                if key in NAMES_ONLY:
                    described["fields"] = {name: {} for name in described["fields"]}
                    described["methods"] = {name: method for name, method in described["methods"].items()
                                            if not name.startswith("_") or name == "__init__"}
                classes[key] = {"module": module, **described}
                break
    names: dict[str, Any] = {}
    for key, (module, name) in NAMES.items():
        tree = tree_of(module)
        node = None if tree is None else _top_level(tree, name)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            described = describe_function(node)
            described["yields"] = sorted({ast.unparse(sub.value) for sub in ast.walk(node)
                                          if isinstance(sub, (ast.Yield, ast.YieldFrom)) and sub.value is not None})
            names[key] = {"module": module, "function": described}
        elif node is not None:
            value = getattr(node, "value", None)
            names[key] = {"module": module, "alias": _unparse(value)}
    return {"vllm_version": version or source.version(), "source": source.path.name, "classes": classes,
            "names": names, "factory": _factory(source)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="a vLLM wheel, or a directory that holds vllm/")
    parser.add_argument("-o", "--output", type=Path, help="where to write the JSON (default: stdout)")
    parser.add_argument("--version", help="the release's version, when the source does not say it")
    args = parser.parse_args(argv)
    text = json.dumps(snapshot(Source(args.source), args.version), indent=1, sort_keys=True) + "\n"
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
