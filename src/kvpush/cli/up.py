"""What the runtime knows of `kvpush up`: its flags, its state file and what it needs installed.

The stack itself is kvpush.localstack (`kvpush.localstack.up`), which builds a tiny model with transformers and
tokenizers, packages of kvpush's dev extra. The runtime never imports it at module level: `kvpush --help` and the
inspection commands (which read the state file to find a running `kvpush up`'s directory) work on an install
without those packages, and `kvpush up` there fails with one line that names what to install.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
from pathlib import Path

# What the local stack imports beyond kvpush's own dependencies, and the extra that brings it.
LOCAL_STACK_MODULES = ("transformers", "tokenizers")
LOCAL_STACK_INSTALL = "pip install 'kvpush[dev]'"


class LocalStackUnavailable(RuntimeError):
    """The local stack cannot run here; the message is one line naming what to install."""


def require_local_stack() -> None:
    """Raise LocalStackUnavailable unless the packages the local stack imports are installed."""
    for name in LOCAL_STACK_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            raise LocalStackUnavailable(
                f"the local stack needs {name}, which is not installed: {LOCAL_STACK_INSTALL}") from None


def state_path() -> Path:
    """Where a running `kvpush up` keeps its addresses: $XDG_RUNTIME_DIR/kvpush/up.json (a per-user, memory-backed
    folder on most Linux systems), else ~/.cache/kvpush/up.json."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    root = Path(runtime) if runtime else Path.home() / ".cache"
    return root / "kvpush" / "up.json"


@dataclasses.dataclass(frozen=True)
class UpState:
    """What a running `kvpush up` tells the inspection commands and the user's tools."""

    pid: int
    directory_address: str
    gateway_url: str
    model: str
    api_key: str  # empty with --no-api-key
    log_dir: str
    engines: dict[str, str]  # name -> URL

    def write(self, path: Path) -> None:
        """Write atomically, readable and writable by the user alone (it holds the API key)."""
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.{self.pid}")
        descriptor = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(descriptor, 0o600)  # a file left from an earlier run keeps its mode through O_CREAT
        with os.fdopen(descriptor, "w") as handle:
            json.dump(dataclasses.asdict(self), handle, indent=2)
        os.replace(staging, path)


def read_state(path: Path | None = None) -> UpState | None:
    """The state of the `kvpush up` that runs now, or None (no file, unreadable, or its process is gone)."""
    path = path or state_path()
    try:
        state = UpState(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    try:
        os.kill(state.pid, 0)
    except ProcessLookupError:
        return None  # left behind by a `kvpush up` that was killed
    except PermissionError:
        pass  # alive, another user's
    return state


def remove_state(path: Path) -> None:
    """Remove the state file if it is this process's (a later `kvpush up` may have replaced it)."""
    with contextlib.suppress(OSError, ValueError, TypeError):
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `kvpush up`."""
    parser.add_argument("--model", type=Path, metavar="PATH",
                        help="serve this local Hugging Face model folder (config.json, weights, tokenizer) instead of "
                             "the generated tiny model; it must be one kvpush supports (README.md)")
    parser.add_argument("--served-model-name", default="",
                        help="the name clients put in \"model\" (default: tiny, or the --model folder's name)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: engines run eager with a 1 GiB KV cache each (vLLM's CPU build); cuda: engines "
                             "capture CUDA graphs (a CUDA build of vLLM; give every engine a "
                             "--gpu-memory-utilization share when they share a card) (default %(default)s)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="vLLM's --tensor-parallel-size for every engine; prefill and decode use the same "
                             "(default %(default)s)")
    parser.add_argument("--gpu-memory-utilization", type=float,
                        help="vLLM's --gpu-memory-utilization for every engine (e.g. 0.3 when prefill, decode and "
                             "the colocated engine share one GPU)")
    parser.add_argument("--max-model-len", type=int, default=4096,
                        help="vLLM's --max-model-len for every engine (default %(default)s)")
    parser.add_argument("--colocated", action="store_true", help="also start a reference engine without a connector")
    parser.add_argument("--gateway-port", type=int, default=0, help="gateway port (default: a free one)")
    parser.add_argument("--hosted-gateway", action="store_true",
                        help="also serve a gateway from the prefill engine's API server (docs/gateway.md)")
    parser.add_argument("--no-api-key", action="store_true",
                        help="serve the gateway without an API key (by default one is generated, printed once and "
                             "kept in the state file)")
    parser.add_argument("--engine-timeout", type=float, default=600.0, help="seconds for the engines to load")
    parser.add_argument("--no-metrics", action="store_true", help="do not serve /metrics on the directory and engines")
