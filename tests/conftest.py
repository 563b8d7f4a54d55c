"""Shared session fixtures: the tiny model, an OTLP receiver, the directory, real vLLM engines, the gateway.

Everything heavy is session-scoped and lazy: a test that asks for `kvpush_engines` starts (once) a
prefill and a decode vLLM engine with KVPushConnector registered at the session directory; one that
asks for `colocated_engine` starts a plain reference engine; they start in parallel when both are
requested by the first test that needs them (`pd_stack`). Engines export spans to the session
OTLP receiver, so any test can assert on spans from the directory, engines and gateway.

Fixtures for other suites (e.g. the connector's): `tiny_model_dir`, `otlp_receiver`, `kv_directory`
(DirectoryHandle: `.address`), `colocated_engine`, `kvpush_engines` (a PDEngines: `.prefill`,
`.decode` EngineHandles), `pd_stack` (both, started together), `kvpush_gateway` (GatewayHandle: `.url`).
Logs of every process land in one session folder, printed at the end of the run.
"""

from __future__ import annotations

import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpush.localstack.model import TinyModelSpec, ensure_tiny_model
from kvpush.localstack.processes import (
    DirectoryHandle,
    EngineHandle,
    EngineSpec,
    GatewayHandle,
    free_port,
    launch_engine,
    start_directory,
    start_gateway,
)
from kvpush.localstack.stack import DECODE_ENGINE_ARGS, DIRECTORY_ARGS, kv_transfer_config
from tests.fixtures.otlp import OTLPReceiver

ENGINE_READY_TIMEOUT_S = 480.0

PREFILL_ENGINE_ID = "test-prefill"
DECODE_ENGINE_ID = "test-decode"


@dataclass
class PDEngines:
    """A prefill and a decode engine with KVPushConnector, registered at `directory`."""

    prefill: EngineHandle
    decode: EngineHandle
    directory: DirectoryHandle


@dataclass
class PDStack:
    """P/D engines plus a colocated reference engine."""

    engines: PDEngines
    colocated: EngineHandle


# Suites whose engines live only as long as their folder (localstack's `local_stack`); they run first, before
# session-long engines of other suites are up (the machine holds about seven ~3 GiB engines at most).
_RUN_FIRST = ("tests/integration/localstack/", "tests/integration/reliability/", "tests/integration/tp/",
              "tests/integration/gateway_reliability/", "tests/faults/", "tests/integration/readme_recipe/",
              "tests/integration/images/")


def pytest_configure(config):
    """Turn SIGTERM (CI's or `timeout`'s stop) into KeyboardInterrupt so fixtures tear down and no engine outlives
    pytest."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def pytest_collection_modifyitems(session, config, items):
    """Move the folder-scoped real-engine suites to the front (stable otherwise)."""
    first = [item for item in items if item.nodeid.startswith(_RUN_FIRST)]
    if first:
        chosen = set(map(id, first))
        items[:] = first + [item for item in items if id(item) not in chosen]


@pytest.fixture(scope="session")
def session_log_dir(request) -> Path:
    """One folder for every process log of this session (reported at the end)."""
    folder = Path(tempfile.mkdtemp(prefix="kvpush-tests-"))
    request.config._kvpush_log_dir = folder
    return folder


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Point at the process logs, which explain most engine failures."""
    folder = getattr(config, "_kvpush_log_dir", None)
    if folder is not None:
        terminalreporter.write_line(f"kvpush process logs: {folder}")


@pytest.fixture(scope="session")
def tiny_model_spec() -> TinyModelSpec:
    """The shape of the session's tiny model (2 layers, head_dim 32, vocab 1024)."""
    return TinyModelSpec()


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_spec) -> Path:
    """A tiny random Llama with a local tokenizer and chat template (cached across sessions)."""
    return ensure_tiny_model(tiny_model_spec)


@pytest.fixture(scope="session")
def otlp_receiver():
    """A real OTLP/gRPC trace receiver that session processes export to."""
    receiver = OTLPReceiver().start()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="session")
def kv_directory(session_log_dir, otlp_receiver) -> DirectoryHandle:
    """The session's KV directory (a real `kvpush directory` process on 127.0.0.1)."""
    handle = start_directory(session_log_dir, env=otlp_receiver.env("kvpush-directory"), extra_args=DIRECTORY_ARGS)
    yield handle
    handle.process.stop(grace_s=5.0)


def _kvpush_engine_spec(role: str, model_dir: Path, directory: DirectoryHandle, otlp: OTLPReceiver) -> EngineSpec:
    port = free_port()
    engine_id = PREFILL_ENGINE_ID if role == "prefill" else DECODE_ENGINE_ID
    return EngineSpec(name=f"kvpush-{role}", model_dir=model_dir, port=port, env=otlp.env(f"kvpush-{role}"),
                      kv_transfer_config=kv_transfer_config("kvpush", role, engine_id=engine_id,
                                                            directory_address=directory.address,
                                                            engine_endpoint=f"http://127.0.0.1:{port}"),
                      extra_args=DECODE_ENGINE_ARGS if role == "decode" else ())


class _EngineCache:
    """Engines started once per session, launched together when first needed."""

    def __init__(self) -> None:
        self.pd: PDEngines | None = None
        self.colocated: EngineHandle | None = None
        self.failure: BaseException | None = None
        self.all: list[EngineHandle] = []

    def ensure(self, want_pd: bool, want_colocated: bool, model_dir: Path, directory: DirectoryHandle,
               otlp: OTLPReceiver, log_dir: Path) -> None:
        if self.failure is not None:
            pytest.fail(f"session engines failed to start earlier: {self.failure}", pytrace=False)
        launched: list[EngineHandle] = []
        try:
            if want_pd and self.pd is None:
                prefill = launch_engine(_kvpush_engine_spec("prefill", model_dir, directory, otlp), log_dir)
                decode = launch_engine(_kvpush_engine_spec("decode", model_dir, directory, otlp), log_dir)
                launched += [prefill, decode]
            if want_colocated and self.colocated is None:
                colocated = launch_engine(EngineSpec(name="colocated", model_dir=model_dir), log_dir)
                launched.append(colocated)
            self.all += launched
            for handle in launched:
                handle.wait_ready(ENGINE_READY_TIMEOUT_S)
        except BaseException as error:
            self.failure = error
            for handle in launched:
                handle.stop(grace_s=5.0)
            raise
        for handle in launched:
            if handle.spec.name == "colocated":
                self.colocated = handle
        if want_pd and self.pd is None:
            self.pd = PDEngines(prefill=launched[0], decode=launched[1], directory=directory)

    def stop(self) -> None:
        # SIGTERM all first, then wait: engines shut down in parallel.
        for handle in self.all:
            if handle.process.alive():
                handle.process.terminate()
        for handle in self.all:
            handle.stop(grace_s=20.0)


@pytest.fixture(scope="session")
def _engine_cache():
    cache = _EngineCache()
    yield cache
    cache.stop()


@pytest.fixture(scope="session")
def pd_stack(_engine_cache, tiny_model_dir, kv_directory, otlp_receiver, session_log_dir) -> PDStack:
    """Prefill + decode (KVPushConnector) and a colocated engine, started together once per session."""
    _engine_cache.ensure(True, True, tiny_model_dir, kv_directory, otlp_receiver, session_log_dir)
    return PDStack(engines=_engine_cache.pd, colocated=_engine_cache.colocated)


@pytest.fixture(scope="session")
def kvpush_engines(_engine_cache, tiny_model_dir, kv_directory, otlp_receiver, session_log_dir) -> PDEngines:
    """Prefill + decode vLLM engines with KVPushConnector, registered at the session directory."""
    _engine_cache.ensure(True, False, tiny_model_dir, kv_directory, otlp_receiver, session_log_dir)
    return _engine_cache.pd


@pytest.fixture(scope="session")
def colocated_engine(_engine_cache, tiny_model_dir, kv_directory, otlp_receiver, session_log_dir) -> EngineHandle:
    """A plain vLLM engine (no connector) serving the tiny model: the reference for outputs."""
    _engine_cache.ensure(False, True, tiny_model_dir, kv_directory, otlp_receiver, session_log_dir)
    return _engine_cache.colocated


@pytest.fixture(scope="session")
def kvpush_gateway(kv_directory, otlp_receiver, session_log_dir) -> GatewayHandle:
    """The reference gateway in kvpush mode on the session directory (exports spans to the receiver)."""
    handle = start_gateway(session_log_dir, directory_address=kv_directory.address,
                           env=otlp_receiver.env("kvpush-gateway"))
    yield handle
    handle.process.stop(grace_s=5.0)
