"""The committed locks are complete, hashed and consistent with the metadata and the generated code.

A fresh clone installs exactly requirements/dev.lock (scripts/setup.sh); these checks fail when a lock
entry lacks a pin or a hash, when pyproject.toml names a package the lock does not carry, or when the
generated kvpush.v1 code needs a newer grpcio/protobuf than the wheel's metadata promises.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
DEV_LOCK = ROOT / "requirements" / "dev.lock"
RUNTIME_LOCK = ROOT / "requirements" / "runtime.lock"


def _lock_entries(path: Path) -> dict[str, tuple[str, list[str]]]:
    """{canonical name: (version, [sha256, ...])} of a `uv pip compile --generate-hashes` file."""
    entries: dict[str, tuple[str, list[str]]] = {}
    current = ""
    for line in path.read_text().splitlines():
        pin = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s\\]+)", line)
        if pin:
            current = canonicalize_name(pin.group(1))
            entries[current] = (pin.group(2), [])
        elif line.strip().startswith("--hash=sha256:"):
            entries[current][1].append(line.strip().removeprefix("--hash=sha256:").rstrip(" \\"))
        elif line and not line.startswith((" ", "#")):
            raise AssertionError(f"{path.name}: unexpected line {line!r} (every entry is name==version)")
    return entries


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_lock_entry_is_pinned_and_hashed() -> None:
    for path in (DEV_LOCK, RUNTIME_LOCK):
        entries = _lock_entries(path)
        assert len(entries) > 10, path
        for name, (version, hashes) in entries.items():
            assert hashes and all(re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes), (path.name, name)
            Version(version)  # a plain release, not a range


def test_locks_cover_the_metadata_at_one_version_each() -> None:
    dev, runtime = _lock_entries(DEV_LOCK), _lock_entries(RUNTIME_LOCK)
    project = _pyproject()["project"]
    for spec in project["dependencies"]:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        for lock_name, lock in (("runtime.lock", runtime), ("dev.lock", dev)):
            assert name in lock, f"{lock_name} lacks {req.name} (run make lock)"
            assert req.specifier.contains(lock[name][0], prereleases=True), (lock_name, spec, lock[name][0])
    for spec in project["optional-dependencies"]["dev"]:
        req = Requirement(spec)
        assert canonicalize_name(req.name) in dev, f"dev.lock lacks {req.name} (run make lock)"
    # The images install runtime.lock and CI installs dev.lock: one version of each shared package.
    for name, (version, _) in runtime.items():
        assert dev[name][0] == version, (name, version, dev[name][0])


def test_generated_code_runs_on_the_metadata_floors() -> None:
    """pip install kvpush must never pick a grpcio/protobuf that the generated modules refuse at import."""
    floors = {canonicalize_name(Requirement(s).name): Requirement(s).specifier
              for s in _pyproject()["project"]["dependencies"]}
    generated = ROOT / "src" / "kvpush" / "v1"
    grpc_versions = {m for f in generated.glob("*_pb2_grpc.py")
                     for m in re.findall(r"GRPC_GENERATED_VERSION = '([^']+)'", f.read_text())}
    proto_versions = {".".join(m) for f in generated.glob("*_pb2.py")
                      for m in re.findall(r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", f.read_text())}
    assert grpc_versions and proto_versions
    for name, needed in (("grpcio", max(grpc_versions, key=Version)), ("protobuf", max(proto_versions, key=Version))):
        floor = _floor(floors[name])
        assert floor >= Version(needed), f"pyproject.toml allows {name} {floor}, the generated code needs {needed}"


def _floor(spec: SpecifierSet) -> Version:
    lows = [Version(s.version) for s in spec if s.operator in (">=", "==", "~=")]
    assert lows, f"no lower bound in {spec}"
    return max(lows)


def test_setup_installs_exactly_the_lock() -> None:
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "--require-hashes --no-deps" in setup and "requirements/dev.lock" in setup
    assert "npm ci" in setup and "npm install" not in setup
    package_lock = json.loads((ROOT / "package-lock.json").read_text())
    buf = package_lock["packages"]["node_modules/@bufbuild/buf"]
    assert buf["version"] and buf["integrity"].startswith("sha512-")
