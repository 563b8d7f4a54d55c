"""The connector against every supported vLLM release's connector-facing API (tests/fixtures/vllm_api/*.json).

The snapshots are read from each release's wheel by scripts/vllm_api_snapshot.py; the connector's side is read from
its source by the same code, so nothing here imports vLLM. Checked per release: every hook KVPushConnector overrides
exists there with a signature vLLM's calls fit (or is declared release-specific in src/kvpush/connector/compat.py),
every abstract method is implemented, the factory's constructor call fits, every vLLM member the connector reads
exists (compat.VLLM_READS, and every read of an annotated vLLM parameter in connector/ is declared there), and the
first-token logits processor fits each model-runner interface it claims. Each check is shown to fail on a snapshot
mutated in a temporary copy.
"""

from __future__ import annotations

import ast
import copy
import functools
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest

from kvpush.connector import compat

ROOT = Path(__file__).resolve().parents[3]
SNAPSHOTS = ROOT / "tests" / "fixtures" / "vllm_api"
CONNECTOR = ROOT / "src" / "kvpush" / "connector"


def _load_snapshot_script() -> Any:
    spec = importlib.util.spec_from_file_location("vllm_api_snapshot", ROOT / "scripts" / "vllm_api_snapshot.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


snapshot_script = _load_snapshot_script()


def supported_releases() -> list[tuple[int, int]]:
    (low_major, low_minor), (high_major, high_minor) = compat.SUPPORTED_MIN, compat.SUPPORTED_MAX
    assert low_major == high_major == 0, "extend supported_releases for a new major version"
    return [(0, minor) for minor in range(low_minor, high_minor + 1)]


@functools.cache
def load_snapshot(release: tuple[int, int]) -> dict[str, Any]:
    """The committed snapshot (shared between tests: read it, never change it; _mutated makes changed copies)."""
    return json.loads((SNAPSHOTS / f"{release[0]}.{release[1]}.json").read_text())


def _class_of(path: Path, name: str) -> dict[str, Any]:
    tree = ast.parse(path.read_text())
    node = next(item for item in tree.body if isinstance(item, ast.ClassDef) and item.name == name)
    return snapshot_script.describe_class(node)


@functools.cache
def connector_class() -> dict[str, Any]:
    return _class_of(CONNECTOR / "connector.py", "KVPushConnector")


# ---------------------------------------------------------------- the checks (each returns its findings)


def signature_mismatch(ours: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """Why vLLM's calls of `theirs` (the base-class method) would not fit our override `ours`, or None."""
    for flag in ("classmethod", "staticmethod", "property"):
        if bool(ours.get(flag)) != bool(theirs.get(flag)):
            return f"vLLM's is {'a ' + flag if theirs.get(flag) else 'not a ' + flag}, ours is the opposite"
    if theirs.get("property"):
        return None
    skip = 0 if theirs.get("staticmethod") else 1  # self / cls
    their_params, our_params = theirs["params"][skip:], ours["params"][skip:]
    our_positional = [p for p in our_params if p["kind"] in ("positional_only", "positional_or_keyword")]
    our_names = {p["name"]: p for p in our_params}
    our_var_positional = any(p["kind"] == "var_positional" for p in our_params)
    our_var_keyword = any(p["kind"] == "var_keyword" for p in our_params)
    matched: set[str] = set()
    position = 0
    for param in their_params:
        kind, name = param["kind"], param["name"]
        if kind in ("positional_only", "positional_or_keyword"):
            if position < len(our_positional):
                mine = our_positional[position]
                if kind == "positional_or_keyword" and mine["name"] != name and not our_var_keyword:
                    return f"parameter {position + 1} is {name!r} in vLLM, {mine['name']!r} here"
                if param["default"] is not None and mine["default"] is None:
                    return f"vLLM's {name!r} has a default (callers may leave it out), ours does not"
                matched.add(mine["name"])
            elif not our_var_positional:
                return f"vLLM passes {name!r} (positional {position + 1}); ours takes no such argument"
            position += 1
        elif kind == "keyword_only":
            mine = our_names.get(name)
            if mine is None or mine["kind"] not in ("keyword_only", "positional_or_keyword"):
                if not our_var_keyword:
                    return f"vLLM may pass keyword {name!r}; ours does not accept it"
            else:
                if param["default"] is not None and mine["default"] is None:
                    return f"vLLM's {name!r} has a default (callers may leave it out), ours does not"
                matched.add(name)
        elif kind == "var_positional" and not our_var_positional:
            return f"vLLM's takes *{name}; ours does not"
        elif kind == "var_keyword" and not our_var_keyword:
            return f"vLLM's takes **{name}; ours does not"
    for param in our_params:
        if (param["name"] not in matched and param["kind"] in ("positional_or_keyword", "positional_only",
                                                                "keyword_only") and param["default"] is None):
            return f"ours requires {param['name']!r}, which vLLM never passes"
    return None


def hook_findings(ours: dict[str, Any], snapshot: dict[str, Any], release: tuple[int, int],
                  release_specific: dict[str, tuple[int, int]]) -> list[str]:
    """Overrides that release would not call as written, and abstract methods it requires that we lack."""
    # The connector also declares SupportsHMA: its hooks (request_finished_all_groups) count as vLLM's.
    base = {**snapshot["classes"].get("SupportsHMA", {}).get("methods", {}),
            **snapshot["classes"]["KVConnectorBase_V1"]["methods"]}
    findings = []
    for name, method in ours["methods"].items():
        if name.startswith("_") and name != "__init__":
            continue
        theirs = base.get(name)
        if theirs is None:
            since = release_specific.get(name)
            if since is None or since <= release:
                findings.append(f"{name}: overridden, but vLLM {release} has no such hook (it would never run there)")
            continue
        mismatch = signature_mismatch(method, theirs)
        if mismatch:
            findings.append(f"{name}: {mismatch}")
    for name, method in base.items():
        if method.get("abstract") and name not in ours["methods"]:
            findings.append(f"{name}: abstract in vLLM {release}, not implemented")
    for call in snapshot["factory"]["constructs"]:
        arguments = ast.parse(call, mode="eval").body
        fake = {"params": [{"name": "self", "kind": "positional_or_keyword", "default": None}]
                + [{"name": ast.unparse(arg), "kind": "positional_or_keyword", "default": None}
                   for arg in arguments.args]
                + [{"name": kw.arg, "kind": "keyword_only", "default": None} for kw in arguments.keywords]}
        mismatch = signature_mismatch(ours["methods"]["__init__"], _renamed_like(fake, ours["methods"]["__init__"]))
        if mismatch:
            findings.append(f"__init__: the factory calls {call}: {mismatch}")
    return findings


def _renamed_like(call: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    """The factory passes positional arguments; their local variable names are not parameter names."""
    renamed = copy.deepcopy(call)
    ours_positional = [p["name"] for p in ours["params"] if p["kind"] == "positional_or_keyword"]
    for index, param in enumerate(renamed["params"]):
        if param["kind"] == "positional_or_keyword" and index < len(ours_positional):
            param["name"] = ours_positional[index]
    return renamed


def _members(described: dict[str, Any]) -> set[str]:
    return set(described["fields"]) | set(described["attributes"]) | set(described["methods"])


def read_findings(snapshot: dict[str, Any], release: tuple[int, int],
                  reads: tuple[compat.VLLMRead, ...]) -> list[str]:
    """vLLM members the connector reads that this release lacks."""
    findings = []
    for read in reads:
        if read.guarded or not read.since <= release <= read.until:
            continue
        described = snapshot["classes"].get(read.cls)
        if described is None:
            findings.append(f"{read.cls}: the connector reads {read.cls}.{read.member}, vLLM {release} has no "
                            f"{read.cls}")
        elif read.member not in _members(described):
            findings.append(f"{read.cls}.{read.member}: read by the connector, absent from vLLM {release}")
    return findings


# The first-token processor's interfaces: snapshot class -> the module a claim imports it from.
LOGITS_INTERFACES = {"LogitsProcessor": "vllm.v1.sample.logits_processor",
                     "LogitsProcessorV2": "vllm.v1.worker.gpu.sample.logits_processor"}


def first_token_findings(ours: dict[str, Any], claimed: set[str], snapshot: dict[str, Any],
                         release: tuple[int, int]) -> list[str]:
    """The logits processor against each interface it claims that the release has; one of them must exist."""
    present = [name for name in claimed if name in snapshot["classes"]]
    if not present:
        return [f"ForcePrefillFirstToken implements {sorted(claimed)}; vLLM {release} has none of them"]
    findings = []
    for name in present:
        interface = snapshot["classes"][name]["methods"]
        for method_name, theirs in interface.items():
            mine = ours["methods"].get(method_name)
            if mine is None:
                if theirs.get("abstract"):
                    findings.append(f"{name}.{method_name}: abstract in vLLM {release}, not implemented")
                continue
            mismatch = signature_mismatch(mine, theirs)
            if mismatch:
                findings.append(f"{name}.{method_name}: {mismatch}")
    return findings


def claimed_logits_interfaces() -> set[str]:
    source = (CONNECTOR / "first_token.py").read_text()
    return {name for name, module in LOGITS_INTERFACES.items()
            if re.search(rf"from {re.escape(module)} import [^\n]*LogitsProcessor\b", source)}


# ---------------------------------------------------------------- the connector against every release

RELEASES = supported_releases()


def test_a_snapshot_for_every_supported_release_made_from_its_wheel():
    committed = sorted(path.stem for path in SNAPSHOTS.glob("*.json"))
    assert committed == [f"{major}.{minor}" for major, minor in RELEASES]
    for release in RELEASES:
        snapshot = load_snapshot(release)
        assert compat.parse_release(snapshot["vllm_version"]) == release
        assert snapshot["source"].startswith(f"vllm-{snapshot['vllm_version']}-") and snapshot["source"].endswith(
            ".whl"), snapshot["source"]
        assert snapshot["classes"]["KVConnectorBase_V1"]["methods"], "no hooks read"


@pytest.mark.parametrize("release", RELEASES, ids=lambda r: f"{r[0]}.{r[1]}")
def test_every_override_fits_the_release_and_every_abstract_hook_is_implemented(release):
    assert hook_findings(connector_class(), load_snapshot(release), release, compat.RELEASE_SPECIFIC_HOOKS) == []


@pytest.mark.parametrize("release", RELEASES, ids=lambda r: f"{r[0]}.{r[1]}")
def test_every_vllm_member_the_connector_reads_exists(release):
    assert read_findings(load_snapshot(release), release, compat.VLLM_READS) == []


@pytest.mark.parametrize("release", RELEASES, ids=lambda r: f"{r[0]}.{r[1]}")
def test_the_first_token_processor_fits_the_releases_model_runner(release):
    ours = _class_of(CONNECTOR / "first_token.py", "ForcePrefillFirstToken")
    assert first_token_findings(ours, claimed_logits_interfaces(), load_snapshot(release), release) == []


def test_release_specific_hooks_are_overridden_and_new_where_declared():
    ours = connector_class()["methods"]
    for hook, since in compat.RELEASE_SPECIFIC_HOOKS.items():
        assert hook in ours, f"{hook} is declared release-specific but not overridden"
        assert compat.SUPPORTED_MIN < since <= compat.SUPPORTED_MAX
        for release in RELEASES:
            has = hook in load_snapshot(release)["classes"]["KVConnectorBase_V1"]["methods"]
            assert has == (release >= since), f"{hook}: vLLM {release} {'has' if has else 'lacks'} it"


def test_guarded_reads_are_read_with_a_fallback_and_exist_somewhere():
    source = "\n".join(path.read_text() for path in CONNECTOR.rglob("*.py"))
    for read in compat.VLLM_READS:
        if read.guarded:
            assert re.search(rf"getattr\([^)]*[\"']{read.member}[\"']", source), f"{read} is not read with getattr"
            assert any(read.member in _members(load_snapshot(r)["classes"].get(read.cls, {
                "fields": {}, "attributes": [], "methods": {}})) for r in RELEASES), f"{read} exists nowhere"


# Annotations in connector/ that name a vLLM class -> the snapshot class.
ANNOTATED = {"SchedulerOutput": "SchedulerOutput", "Request": "Request", "KVConnectorOutput": "KVConnectorOutput",
             "KVCacheBlocks": "KVCacheBlocks", "KVCacheConfig": "KVCacheConfig", "VllmConfig": "VllmConfig",
             "SamplingParams": "SamplingParams", "BatchUpdate": "BatchUpdate"}


def annotated_reads() -> set[tuple[str, str, str]]:
    """(class, member, file:line) for each `param.member` or getattr(param, "member") on a parameter annotated
    with a vLLM class, in every function of connector/."""
    found = set()
    for path in CONNECTOR.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            typed = {}
            for arg in [*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs]:
                annotation = ast.unparse(arg.annotation).strip("'\"") if arg.annotation is not None else ""
                head = re.split(r"[\s|\[]", annotation)[0]
                if head in ANNOTATED:
                    typed[arg.arg] = ANNOTATED[head]
            for node in ast.walk(function):
                where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in typed:
                    found.add((typed[node.value.id], node.attr, where))
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                        and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id in typed
                        and isinstance(node.args[1], ast.Constant)):
                    found.add((typed[node.args[0].id], node.args[1].value, where))
    return found


def test_every_read_of_an_annotated_vllm_parameter_is_declared():
    declared = {(read.cls, read.member) for read in compat.VLLM_READS}
    reads = annotated_reads()
    assert reads, "found no reads: the scan is broken"
    assert sorted(r for r in reads if r[:2] not in declared) == []


def test_no_use_of_members_whose_meaning_or_existence_changed():
    """`yield_req_data`'s third element meant `preempted` up to 0.32 and `is_full_table` from 0.33;
    `ModelRunnerOutput.req_id_to_index` is gone in 0.34."""
    used = set()
    for path in CONNECTOR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name):
                used.add(node.id)
            elif isinstance(node, ast.Attribute):
                used.add(node.attr)
            elif isinstance(node, ast.alias):
                used.add(node.name.rsplit(".", 1)[-1])
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                used.add(node.value)  # getattr(x, "name")
    assert {"yield_req_data", "req_id_to_index"} & used == set()
    yields = {r: load_snapshot(r)["names"]["yield_req_data"]["function"]["yields"] for r in ((0, 32), (0, 33))}
    assert yields[(0, 32)] != yields[(0, 33)], "the snapshots no longer show the change this test guards"


@pytest.mark.parametrize("release", RELEASES, ids=lambda r: f"{r[0]}.{r[1]}")
def test_the_connector_overwrites_no_state_of_the_base_class(release):
    """An attribute the connector assigns that vLLM's base class also uses would replace vLLM's state."""
    base = load_snapshot(release)["classes"]["KVConnectorBase_V1"]
    assert set(connector_class()["attributes"]) & _members(base) == set()


def test_oldest_release_hooks_derive_from_its_snapshot():
    """The connector's overrides that are not release-specific are all hooks of the oldest supported release."""
    classes = load_snapshot(compat.SUPPORTED_MIN)["classes"]
    oldest = set(classes["KVConnectorBase_V1"]["methods"]) | set(classes["SupportsHMA"]["methods"])
    overrides = {name for name in connector_class()["methods"] if not name.startswith("_")}
    assert overrides - set(compat.RELEASE_SPECIFIC_HOOKS) <= oldest


# ---------------------------------------------------------------- each check fails when a release changes


def _mutated(release: tuple[int, int], tmp_path: Path, mutate) -> dict[str, Any]:
    """A temporary copy of the release's snapshot with one change applied (the committed file is untouched)."""
    copy_path = tmp_path / f"{release[0]}.{release[1]}.json"
    copy_path.write_text((SNAPSHOTS / copy_path.name).read_text())
    snapshot = json.loads(copy_path.read_text())
    mutate(snapshot)
    copy_path.write_text(json.dumps(snapshot))
    return json.loads(copy_path.read_text())


def _base(snapshot: dict[str, Any]) -> dict[str, Any]:
    return snapshot["classes"]["KVConnectorBase_V1"]["methods"]


def _add_param(hook: str, name: str, default: str | None = None):
    def mutate(snapshot):
        _base(snapshot)[hook]["params"].append({"name": name, "kind": "positional_or_keyword", "default": default})
    return mutate


def _rename_param(hook: str, index: int, name: str):
    def mutate(snapshot):
        _base(snapshot)[hook]["params"][index]["name"] = name
    return mutate


def _drop_hook(hook: str):
    def mutate(snapshot):
        del _base(snapshot)[hook]
    return mutate


def _flag(hook: str, flag: str):
    def mutate(snapshot):
        _base(snapshot)[hook][flag] = True
    return mutate


def _new_abstract(snapshot):
    _base(snapshot)["get_push_plan"] = {"abstract": True, "params": [
        {"name": "self", "kind": "positional_or_keyword", "default": None}]}


def _factory_passes(call: str):
    def mutate(snapshot):
        snapshot["factory"]["constructs"] = [call]
    return mutate


HOOK_MUTATIONS = {
    "a new required parameter": ((0, 25), _add_param("get_finished", "step_id"), "get_finished"),
    "a renamed parameter": ((0, 30), _rename_param("request_finished", 2, "block_id_groups"), "request_finished"),
    "a release-specific hook's new parameter": ((0, 34), _add_param("may_load_async", "now"), "may_load_async"),
    "a hook removed from an older release": ((0, 28), _drop_hook("get_block_ids_with_load_errors"),
                                             "get_block_ids_with_load_errors"),
    "a hook that became a classmethod": ((0, 33), _flag("get_finished", "classmethod"), "get_finished"),
    "a release-specific hook not yet a classmethod": ((0, 34), lambda s: _base(s)["kv_cache_access"].pop(
        "classmethod"), "kv_cache_access"),
    "a new abstract hook": ((0, 32), _new_abstract, "get_push_plan"),
    "a fourth constructor argument": ((0, 31), _factory_passes("connector_cls(config, role, kv_cache_config, x)"),
                                      "__init__"),
}


@pytest.mark.parametrize("case", sorted(HOOK_MUTATIONS))
def test_a_hook_change_under_the_connector_fails_the_check(case, tmp_path):
    release, mutate, hook = HOOK_MUTATIONS[case]
    assert hook_findings(connector_class(), load_snapshot(release), release, compat.RELEASE_SPECIFIC_HOOKS) == []
    findings = hook_findings(connector_class(), _mutated(release, tmp_path, mutate), release,
                             compat.RELEASE_SPECIFIC_HOOKS)
    assert len(findings) == 1 and findings[0].startswith(f"{hook}:"), findings


def test_an_undeclared_release_specific_hook_fails_in_older_releases():
    undeclared = {hook: since for hook, since in compat.RELEASE_SPECIFIC_HOOKS.items() if hook != "may_load_async"}
    findings = hook_findings(connector_class(), load_snapshot((0, 33)), (0, 33), undeclared)
    assert findings == ["may_load_async: overridden, but vLLM (0, 33) has no such hook (it would never run there)"]


READ_MUTATIONS = {
    "a dataclass field": ((0, 29), "SchedulerOutput", "preempted_req_ids"),
    "an attribute set in __init__": ((0, 34), "Request", "num_prompt_tokens"),
    "a method": ((0, 26), "KVCacheBlocks", "get_block_ids"),
    "a whole class": ((0, 30), "KVConnectorOutput", None),
}


@pytest.mark.parametrize("case", sorted(READ_MUTATIONS))
def test_a_member_removed_under_the_connector_fails_the_check(case, tmp_path):
    release, cls, member = READ_MUTATIONS[case]

    def mutate(snapshot):
        if member is None:
            del snapshot["classes"][cls]
            return
        described = snapshot["classes"][cls]
        described["fields"].pop(member, None)
        described["methods"].pop(member, None)
        described["attributes"] = [a for a in described["attributes"] if a != member]

    assert read_findings(load_snapshot(release), release, compat.VLLM_READS) == []
    findings = read_findings(_mutated(release, tmp_path, mutate), release, compat.VLLM_READS)
    assert findings and all(f.startswith(cls) for f in findings), findings


def test_a_logits_interface_change_fails_the_first_token_check(tmp_path):
    ours = _class_of(CONNECTOR / "first_token.py", "ForcePrefillFirstToken")
    claimed = claimed_logits_interfaces()

    def mutate(snapshot):
        for name in LOGITS_INTERFACES:
            if name in snapshot["classes"]:
                snapshot["classes"][name]["methods"]["apply"]["params"].insert(
                    1, {"name": "step", "kind": "positional_or_keyword", "default": None})

    release = (0, 33)
    findings = first_token_findings(ours, claimed, _mutated(release, tmp_path, mutate), release)
    assert findings and all(".apply:" in f for f in findings), findings
    assert first_token_findings(ours, set(), load_snapshot(release), release)


@pytest.mark.parametrize("ours, theirs, fits", [
    ("(self, a, b)", "(self, a, b)", True),
    ("(self, a, b=1)", "(self, a)", True),
    ("(self, a)", "(self, a, b=1)", False),
    ("(self, a, *args)", "(self, a, b, c)", True),
    ("(self, a, **kw)", "(self, a, *, k=1)", True),
    ("(self, a)", "(self, a, **kw)", False),
    ("(self, x)", "(self, a)", False),
    ("(self, a, b)", "(self, a)", False),
])
def test_signature_fit(ours, theirs, fits):
    def described(signature):
        return snapshot_script.describe_function(ast.parse(f"def f{signature}: pass").body[0])

    assert (signature_mismatch(described(ours), described(theirs)) is None) is fits
