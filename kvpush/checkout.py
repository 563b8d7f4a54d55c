"""Import kvpush from a source checkout that is not installed (e.g. a GPU machine given only the tree).

pyproject.toml's `[tool.setuptools] package-dir` maps `kvpush.services` to services/ and `kvpush.connector` to
connector/; an editable install applies it. `use_checkout(repo)` applies the same mapping, read from that
file, to this interpreter: one definition of the package layout, not a copy.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import tomllib
from pathlib import Path


def use_checkout(repo: Path) -> None:
    """Make `kvpush.*` importable from `repo` as pyproject.toml maps it (subpackages already importable stay)."""
    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    import kvpush

    package_dir = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name, folder in package_dir.items():
        if name == "kvpush" or name in sys.modules:
            continue
        try:
            importlib.import_module(name)
            continue
        except ModuleNotFoundError:
            pass
        spec = importlib.util.spec_from_file_location(name, repo / folder / "__init__.py",
                                                      submodule_search_locations=[str(repo / folder)])
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        setattr(kvpush, name.rsplit(".", 1)[1], module)
