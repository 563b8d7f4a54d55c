"""Make NIXL's progress thread sleep in every agent a process creates (the fair vLLM NIXL baselines).

`nixl_agent_config` hard-codes `pthrDelay = 0`, so the progress thread of vLLM's NixlConnector and
NixlPushConnector busy-spins a core (docs/benchmarks.md, REFERENCE §6). bench/serve_bench.py puts this
folder on an engine's PYTHONPATH with KVPUSH_BENCH_NIXL_PTHR_DELAY_US=100: when NIXL's `_api` module is
first imported, its `nixlBind.nixlAgent` is wrapped to set that delay on the config before the agent
is built. Nothing else changes. Imported by Python at start-up (sitecustomize), so it must stay cheap:
it only installs an import hook.
"""

import importlib.abc
import importlib.machinery
import os
import sys

_DELAY_US = int(os.environ.get("KVPUSH_BENCH_NIXL_PTHR_DELAY_US", "0") or 0)
_TARGETS = {"nixl_cu13._api", "nixl_cu12._api", "nixl._api"}


class _Bind:
    """nixlBind with nixlAgent wrapped; everything else delegates."""

    def __init__(self, bind):
        self._bind = bind

    def __getattr__(self, name):
        return getattr(self._bind, name)

    def nixlAgent(self, name, config):
        config.pthrDelay = _DELAY_US
        return self._bind.nixlAgent(name, config)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        if hasattr(module, "nixlBind") and not isinstance(module.nixlBind, _Bind):
            module.nixlBind = _Bind(module.nixlBind)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader)
        return spec


if _DELAY_US > 0:
    sys.meta_path.insert(0, _Finder())
