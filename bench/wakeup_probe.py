"""What one more process on the request's path costs at low load: an idle process's wake-up, measured.

Round trips of one small POST (a new connection each, as the hops bench's client makes them) to two servers, with
no pause between requests and with `--gaps-s` of idle before each:
  * bare      an aiohttp server that reads the body and answers 400 (the least a Python HTTP hop does);
  * gateway   kvpush's gateway, which validates the request and refuses it with a 400 (a negative token id):
              its intake path (metrics, error middleware, body, validation) with no directory or engine behind it.
The rows alternate, so both servers see the same machine. On the 2-core CPU machine (cpuidle driver haltpoll) a
round trip after 10 ms or 0.1 s of idle costs 0.75-0.85 ms more than with none, for the bare server as for the
gateway (which adds 0.2-0.3 ms of its own code at every gap): the wake-up of idle processes, not the gateway's code.
A disaggregated request at low load wakes the gateway twice (the client's request, then prefill's token), which is
most of the gateway's 2 ms on the H200's hops (docs/benchmarks.md). JSON to bench/results/wakeup_probe.json.

    .venv/bin/python bench/wakeup_probe.py [--requests 100] [--gaps-s 0 0.01 0.1]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from bench_io import write_result

from kvpush.localstack.processes import ManagedProcess, free_port, tcp_open

_BARE_SERVER = """
import sys
from aiohttp import web
async def refuse(request):
    await request.read()
    return web.json_response({"error": {"message": "refused"}}, status=400)
app = web.Application()
app.router.add_post("/v1/completions", refuse)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""

# A valid request but for one negative id: the gateway reads, parses and validates all 513 ids, then answers 400.
_BODY = json.dumps({"model": "tiny", "prompt": [-1] + list(range(3, 515)), "max_tokens": 8, "stream": True}).encode()


def round_trip_ms(port: int) -> float:
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", "/v1/completions", body=_BODY, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        if response.status != 400:
            raise RuntimeError(f"port {port} answered {response.status}, not 400")
    finally:
        conn.close()
    return (time.perf_counter() - started) * 1000


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=100, help="round trips per server and gap")
    parser.add_argument("--gaps-s", type=float, nargs="+", default=[0.0, 0.01, 0.1])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "wakeup_probe.json")
    args = parser.parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="kvpush-wakeup-"))
    ports = {"bare": free_port(), "gateway": free_port()}
    # The gateway against a directory nobody listens on: it serves, and a refused request never reaches the directory
    # (its /health would say 503, so readiness is its port accepting).
    argvs = {"bare": [sys.executable, "-c", _BARE_SERVER, str(ports["bare"])],
             "gateway": [sys.executable, "-m", "kvpush.gateway", "--host", "127.0.0.1",
                         "--port", str(ports["gateway"]), "--directory", f"127.0.0.1:{free_port()}"]}
    servers = [ManagedProcess(name, argv, log_dir / f"{name}.log") for name, argv in argvs.items()]
    rows = []
    try:
        for server, port in zip(servers, ports.values()):
            server.start().wait_ready(lambda port=port: tcp_open("127.0.0.1", port), 30.0)
        for gap_s in args.gaps_s:
            samples: dict[str, list[float]] = {name: [] for name in ports}
            for _ in range(args.requests):
                for name, port in ports.items():
                    time.sleep(gap_s)
                    samples[name].append(round_trip_ms(port))
            row = {"gap_s": gap_s, **{f"{name}_median_ms": round(statistics.median(values), 3)
                                      for name, values in samples.items()}}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    finally:
        for server in servers:
            server.stop(grace_s=5.0)
    idle_driver = Path("/sys/devices/system/cpu/cpuidle/current_driver")
    result = {"bench": "wakeup_probe", "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "requests": args.requests, "cpu_count": len(os.sched_getaffinity(0)),
              "cpuidle_driver": idle_driver.read_text().strip() if idle_driver.exists() else None, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, result, indent=1, echo=False)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
