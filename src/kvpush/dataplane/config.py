"""NIXL data-plane settings and the construction of a NIXL agent from them.

`NixlConfig` is plain data (from `kv_connector_extra_config` or tests). `create_nixl_agent` builds the
agent: with the progress thread off (default, the right choice on small machines: our own I/O thread
drives UCX progress while it polls), or on with a *sleeping* loop. The stock `nixl_agent_config`
hard-codes `pthrDelay = 0`, a progress thread that busy-spins a core (REFERENCE §6); the NIXL 1.5.1
bindings do expose `nixlAgentConfig.pthrDelay` (microseconds), so `_PacedNixlAgent` repeats
`nixl_agent.__init__` with a configurable delay (`progress_thread_delay_us`).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from kvpush.dataplane.nixl_api import NixlAgentApi

BACKEND_UCX = "UCX"
BACKEND_LIBFABRIC = "LIBFABRIC"
# The in-memory stand-in for tests (dataplane/inmemory.py): every agent in this process, bytes moved with memmove.
BACKEND_INMEMORY = "INMEMORY"


@dataclass(frozen=True)
class NixlConfig:
    """How a TransferAgent builds and drives its NIXL agent.

    backends: NIXL backends to create, "UCX" by default, "LIBFABRIC" for AWS EFA.
    enable_prog_thread: NIXL's own progress thread; off by default (on 2 cores it halves
        throughput and, with the stock delay of 0, spins a core). When off, every NIXL call stays on
        the agent's one I/O thread, which also drives progress.
    progress_thread_delay_us: sleep of the progress thread between loops when it is on.
    num_threads: UCX/LIBFABRIC worker threads (0 = backend default); UCX splits transfers of at
        least `split_batch_size` descriptors across them.
    capture_telemetry: ask NIXL for per-transfer telemetry (`get_xfer_telemetry`).
    poll_min_s / poll_max_s: sleep between completion polls while handles are in flight; it starts
        at poll_min_s and doubles up to poll_max_s. Never zero: the thread never spins.
    notif_poll_s: how often an otherwise idle I/O thread polls notifications (and UCX progress).
    post_timeout_s: longest a write may wait for its ready event before it fails.
    transfer_timeout_s: longest a posted handle may stay in progress before it fails.
    max_group_writes: how many queued writes of one transfer that are ready together may share one
        handle (1 = one handle per write).
    backend_params: extra init parameters per backend name, e.g. {"UCX": {"split_batch_size": "64"}}.
    check_in_post_order: check a transfer's in-flight handles oldest first and stop at the first still in
        progress. Its writes go to one peer and complete in order, and each NIXL call hands the GIL back and must
        take it again (up to Python's switch interval, 5 ms, while the forward thread runs Python), so checking
        every handle every round delays seeing any of them done.
    io_trace_path: when set, the I/O thread writes per-iteration timings there as JSON lines (`io_trace.py`;
        `{pid}` and `{agent}` are filled in). A profiling aid; off by default.
    """

    backends: tuple[str, ...] = (BACKEND_UCX,)
    enable_prog_thread: bool = False
    progress_thread_delay_us: int = 100
    num_threads: int = 0
    capture_telemetry: bool = False
    poll_min_s: float = 50e-6
    poll_max_s: float = 1e-3
    notif_poll_s: float = 1e-3
    post_timeout_s: float = 30.0
    transfer_timeout_s: float = 30.0
    # TESTING ONLY: hold each posted write after a transfer's first `fault_hold_after_writes` this long before
    # its bytes move (a WRITE stuck in the network: in flight, not cancellable, lands late). 0: off.
    # fault_hold_from_token > 0 holds only writes reaching past that token, so that a test can pick the
    # transfer by its prompt length (how many writes a prompt makes depends on timing: ready layers merge).
    fault_hold_posted_s: float = 0.0
    fault_hold_after_writes: int = 0
    fault_hold_from_token: int = 0
    max_group_writes: int = 64
    backend_params: dict[str, dict[str, str]] = field(default_factory=dict)
    check_in_post_order: bool = True
    io_trace_path: str = ""

    def validate(self) -> NixlConfig:
        """Raise ValueError on a setting that cannot work; return self."""
        if not self.backends:
            raise ValueError("NixlConfig.backends is empty")
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {self.num_threads}")
        if self.progress_thread_delay_us < 0:
            raise ValueError("progress_thread_delay_us must be >= 0")
        if not 0 < self.poll_min_s <= self.poll_max_s:
            raise ValueError(f"need 0 < poll_min_s <= poll_max_s, got {self.poll_min_s}, {self.poll_max_s}")
        if self.max_group_writes < 1:
            raise ValueError("max_group_writes must be >= 1")
        if self.notif_poll_s <= 0:
            raise ValueError("notif_poll_s must be positive")
        if self.post_timeout_s <= 0 or self.transfer_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        return self

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> NixlConfig:  # Any: JSON-shaped settings, one type per field
        """Build from a plain dict (e.g. `kv_connector_extra_config["nixl"]`); unknown keys are refused."""
        known = set(cls.__dataclass_fields__)
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"unknown NixlConfig keys: {sorted(unknown)}")
        values = dict(raw)
        if "backends" in values:
            values["backends"] = tuple(values["backends"])
        return cls(**values).validate()


def _backend_init(config: NixlConfig, backend: str) -> dict[str, str]:
    init: dict[str, str] = {}
    if config.num_threads > 0 and backend in (BACKEND_UCX, BACKEND_LIBFABRIC):
        init["num_threads"] = str(config.num_threads)
    init.update(config.backend_params.get(backend, {}))
    return init


def _nixl_modules() -> tuple[ModuleType, ModuleType]:
    """(nixl._api, nixl._bindings), without importing torch when torch is not loaded yet.

    The `nixl` meta package picks its CUDA wheel by importing torch when torch has no CUDA build
    (6 s on the CPU machine, in every spawned process). A process that has not imported torch yet
    (tests, benchmarks, the directory) loads the installed backend wheel directly; an engine has
    torch loaded already and goes through the meta package as NIXL intends.
    """
    if "torch" not in sys.modules and "nixl._api" not in sys.modules:
        for backend in ("nixl_cu13", "nixl_cu12"):
            try:
                api = importlib.import_module(f"{backend}._api")
            except ModuleNotFoundError as exc:
                if exc.name is not None and exc.name.startswith(backend):
                    continue
                raise
            return api, importlib.import_module(f"{backend}._bindings")
    from nixl import _api, _bindings

    return _api, _bindings


def create_nixl_agent(name: str, config: NixlConfig) -> NixlAgentApi:
    """Create a NIXL agent named `name` as `config` says (imports NIXL here, not at module load)."""
    if config.backends == (BACKEND_INMEMORY,):
        from kvpush.dataplane.inmemory import InMemoryNixlAgent, fabric

        return InMemoryNixlAgent(name, fabric(config.backend_params.get(BACKEND_INMEMORY, {}).get("fabric", "default")))
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")  # vLLM sets it too: a UCX leak
    api, bind = _nixl_modules()
    nixl_agent = api.nixl_agent

    class _PacedNixlAgent(nixl_agent):  # type: ignore[misc, valid-type]
        """nixl_agent whose progress thread sleeps `progress_thread_delay_us` between loops.

        Mirrors nixl 1.5.1 `nixl_agent.__init__` (pinned in pyproject) except pthrDelay; sync mode
        NONE: every call on one agent must come from one thread.
        """

        def __init__(self, agent_name: str, cfg: NixlConfig) -> None:
            agent_config = bind.nixlAgentConfig()
            agent_config.useProgThread = cfg.enable_prog_thread
            agent_config.useListenThread = False
            agent_config.listenPort = bind.DEFAULT_COMM_PORT
            agent_config.syncMode = bind.NIXL_THREAD_SYNC_NONE
            agent_config.pthrDelay = cfg.progress_thread_delay_us
            agent_config.lthrDelay = 100000
            agent_config.captureTelemetry = cfg.capture_telemetry
            self.agent = bind.nixlAgent(agent_name, agent_config)
            self.name = agent_name
            self._leaked_xfer_handles: list[int] = []
            self.notifs: dict[str, list[bytes]] = {}
            self.backends: dict[str, object] = {}
            self.backend_mems: dict[str, list[str]] = {}
            self.backend_options: dict[str, dict[str, str]] = {}
            self.plugin_list = self.agent.getAvailPlugins()
            if not self.plugin_list:
                raise RuntimeError("no NIXL plugins available")
            self.plugin_b_options: dict[str, dict[str, str]] = {}
            self.plugin_mem_types: dict[str, list[str]] = {}
            self.nixl_mems = {
                "DRAM": bind.DRAM_SEG,
                "VRAM": bind.VRAM_SEG,
                "FILE": bind.FILE_SEG,
                "BLOCK": bind.BLK_SEG,
                "OBJ": bind.OBJ_SEG,
                "cpu": bind.DRAM_SEG,
                "cuda": bind.VRAM_SEG,
            }
            self.nixl_ops = {"WRITE": bind.NIXL_WRITE, "READ": bind.NIXL_READ}
            for backend in cfg.backends:
                if backend not in self.plugin_list:
                    raise RuntimeError(f"NIXL backend {backend!r} is not available (have {self.plugin_list})")
                self.create_backend(backend, _backend_init(cfg, backend))

    if config.enable_prog_thread:
        return _PacedNixlAgent(name, config)
    stock = api.nixl_agent_config(
        enable_prog_thread=False,
        capture_telemetry=config.capture_telemetry,
        num_threads=0,
        backends=[],
    )
    stock_agent = nixl_agent(name, stock)
    for backend in config.backends:
        if backend not in stock_agent.get_plugin_list():
            raise RuntimeError(f"NIXL backend {backend!r} is not available (have {stock_agent.get_plugin_list()})")
        stock_agent.create_backend(backend, _backend_init(config, backend))
    agent: NixlAgentApi = stock_agent  # NIXL's class is untyped here: the Protocol names what kvpush calls
    return agent
