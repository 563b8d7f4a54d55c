"""Timestamps of the connector's hooks and of vLLM's step, for `bench/hook_timeline/summarize.py`.

A measuring aid, never loaded by kvpush itself: put this folder first on PYTHONPATH and set
KVPUSH_HOOK_TIMELINE_DIR, and every Python process started with that environment (engine cores, workers, API
servers) records each call of the functions in TARGETS once their module is imported: start and end
(CLOCK_MONOTONIC, shared by the processes of one host), thread, and a few facts of the call (tokens scheduled,
whether the step pushes). Each process appends JSON lines to `<dir>/<pid>.jsonl` once a second.

    KVPUSH_HOOK_TIMELINE_DIR=/tmp/timeline PYTHONPATH=bench/hook_timeline:$PYTHONPATH python bench/hops_bench.py ...
    KVPUSH_GPU_PYTHONPATH_PREFIX=$PWD/bench/hook_timeline KVPUSH_HOOK_TIMELINE_DIR=$OUT/timeline \
        bash bench/gpu_run.sh hops ...

A wrapped call costs about a microsecond (two clock reads and a list append), so the 32 save_kv_layer calls of a
step add ~0.05 ms to what is measured.
"""

from __future__ import annotations

import functools
import importlib.abc
import json
import os
import sys
import threading
import time

_DIR = os.environ.get("KVPUSH_HOOK_TIMELINE_DIR", "")

# module -> (class, methods). Missing classes or methods (another vLLM version) are skipped.
TARGETS: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "kvpush.connector.connector": [("KVPushConnector", (
        "bind_connector_metadata", "start_load_kv", "save_kv_layer", "wait_for_save", "get_finished",
        "build_connector_worker_meta", "get_num_new_matched_tokens", "update_state_after_alloc",
        "build_connector_meta", "update_connector_output", "request_finished"))],
    # The prefill worker's other threads: the push owner's commands on the data plane's I/O thread, and its writes.
    "kvpush.dataplane.agent": [("TransferAgent", ("_run_command",))],
    "kvpush.dataplane.writer": [("PushWriter", ("_post",))],
    "vllm.v1.engine.core": [("EngineCore", ("step", "step_with_batch_queue")),
                            ("EngineCoreProc", ("_process_engine_step",))],
    "vllm.v1.core.sched.scheduler": [("Scheduler", ("schedule", "update_from_output"))],
    "vllm.v1.worker.gpu_model_runner": [("GPUModelRunner", ("execute_model", "sample_tokens"))],
    "vllm.v1.worker.gpu.model_runner": [("GPUModelRunner", ("execute_model", "sample_tokens"))],
    "vllm.v1.engine.output_processor": [("OutputProcessor", ("process_outputs",))],
}

_events: list[list] = []
_lock = threading.Lock()


def _facts(name: str, args: tuple, result: object) -> dict | None:
    """A few facts of one call; never raises."""
    try:
        self = args[0]
        if name in ("execute_model", "schedule", "update_from_output", "build_connector_meta"):
            output = args[1] if name != "schedule" else result
            facts = {"tokens": int(getattr(output, "total_num_scheduled_tokens", -1)),
                     "new": len(getattr(output, "scheduled_new_reqs", ()) or ())}
            connector = self if name == "build_connector_meta" else getattr(self, "connector", None)
            if connector is not None and hasattr(connector, "config"):
                facts["prefill"] = bool(getattr(connector.config, "is_prefill", False))
            return facts
        if name == "bind_connector_metadata":
            worker = getattr(self, "_worker", None)
            return {"pushes": bool(getattr(worker, "_step_has_chunks", False)),
                    "prefill": bool(getattr(getattr(self, "config", None), "is_prefill", False))}
        if name == "request_finished":
            request = args[1]
            return {"request_id": str(getattr(request, "request_id", "")),
                    "prefill": bool(getattr(getattr(self, "config", None), "is_prefill", False))}
        if name == "process_outputs":
            outputs = args[1]
            return {"outputs": len(outputs) if hasattr(outputs, "__len__") else -1}
    except Exception:
        return None
    return None


def _wrap(name: str, function):
    clock = time.monotonic_ns

    @functools.wraps(function)
    def timed(*args, **kwargs):
        start = clock()
        result = function(*args, **kwargs)
        end = clock()
        facts = _facts(name, args, result)
        _events.append([start, end, threading.get_ident(), name, facts])
        return result

    return timed


def _patch(module) -> None:
    for class_name, methods in TARGETS.get(module.__name__, ()):
        cls = getattr(module, class_name, None)
        if cls is None:
            continue
        for method in methods:
            function = cls.__dict__.get(method)
            if function is not None and callable(function):
                setattr(cls, method, _wrap(method, function))


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


def _flush() -> None:
    with _lock:
        batch = _events[:]
        del _events[:len(batch)]
        if not batch:
            return
        with open(os.path.join(_DIR, f"{os.getpid()}.jsonl"), "a") as out:
            for event in batch:
                out.write(json.dumps(event) + "\n")


def _flusher() -> None:
    while True:
        time.sleep(1.0)
        _flush()


if _DIR:
    os.makedirs(_DIR, exist_ok=True)
    with open(os.path.join(_DIR, f"{os.getpid()}.jsonl"), "a") as header:
        header.write(json.dumps({"pid": os.getpid(), "argv": sys.argv[:6]}) + "\n")
    sys.meta_path.insert(0, _Finder())
    threading.Thread(target=_flusher, name="hook-timeline-flush", daemon=True).start()
    import atexit

    atexit.register(_flush)
