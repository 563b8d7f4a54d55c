"""The standalone gateway's CPU time per request, with stand-in engines (no vLLM), so only the gateway's own work
counts.

What runs: a real directory, two stand-in engines (tests/unit/services/gateway/standin.py: aiohttp servers that
answer at once) registered as prefill and decode, and the gateway (`python -m kvpush.gateway`, first token
from prefill off: one non-streamed leg each way, the plan). Requests go one at a time with a short pause; the
gateway process's user + system CPU (/proc/PID/stat) over the measured requests, divided by their count, is the
figure. With --profile, py-spy samples the gateway meanwhile (raw format; summarise with any flame tool).

    .venv/bin/python bench/gateway_cpu_bench.py --requests 300 --prompt-tokens 512 [--profile /tmp/gateway.txt]

JSON to stdout and bench/results/gateway-cpu-<UTC>.json.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_io import emit  # bench/, this script's folder

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def cpu_seconds(pid: int) -> float:
    """User + system CPU of one process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--gap-s", type=float, default=0.01)
    parser.add_argument("--profile", type=Path, default=None, help="py-spy raw samples of the gateway to this file")
    parser.add_argument("--gateway-pythonpath", default=None,
                        help="run the gateway from another checkout's packages (the code before a change)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)

    from kvpush.localstack.client import call
    from tests.unit.services.gateway.test_gateway import Deployment

    # Ahead of the environment's own PYTHONPATH (which is how kvpush is found on the H200 host), not instead of it.
    pythonpath = [p for p in (args.gateway_pythonpath, os.environ.get("PYTHONPATH")) if p]
    gateway_env = {"PYTHONPATH": os.pathsep.join(pythonpath)} if args.gateway_pythonpath else {}
    deployment = Deployment(Path(tempfile.mkdtemp(prefix="kvpush-gateway-cpu-")), gateway_env,
                            first_token_from_prefill=False)
    try:
        pid = deployment.gateway.process.pid
        rng = random.Random(0)
        body = {"model": "tiny", "prompt": [rng.randrange(3, 1000) for _ in range(args.prompt_tokens)], "max_tokens": 4}
        url = deployment.gateway.url + "/v1/completions"
        for _ in range(args.warmup):
            assert call("POST", url, body, timeout_s=10).status == 200
        profiler = None
        if args.profile:
            profiler = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(pid),
                                         "-r", "500", "-f", "raw", "-o", str(args.profile)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.5)  # py-spy attaches
        walls, cpu_before = [], cpu_seconds(pid)
        for _ in range(args.requests):
            started = time.monotonic()
            answer = call("POST", url, body, timeout_s=10)
            walls.append((time.monotonic() - started) * 1000)
            assert answer.status == 200, answer.text
            time.sleep(args.gap_s)
        cpu_per_request_ms = (cpu_seconds(pid) - cpu_before) / args.requests * 1000
        if profiler is not None:
            profiler.send_signal(2)  # SIGINT: py-spy writes its samples and exits
            profiler.wait(timeout=30)
    finally:
        deployment.stop()
    result = {"bench": "gateway_cpu", "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "requests": args.requests, "prompt_tokens": args.prompt_tokens, "cpu_count": os.cpu_count(),
              "gateway_cpu_per_request_ms": round(cpu_per_request_ms, 3),
              "request_wall_ms": {"p50": round(statistics.median(walls), 3),
                                  "p90": round(statistics.quantiles(walls, n=10)[-1], 3)},
              "profile": str(args.profile) if args.profile else None, "gateway_pythonpath": args.gateway_pythonpath}
    emit(result, args.out, "gateway-cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
