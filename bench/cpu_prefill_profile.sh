#!/usr/bin/env bash
# On the CPU machine: bench/prefill_stages_bench.py (blocks of p_alone and p_leg requests on the local stack) while
# py-spy samples, with --gil, which thread of the prefill engine holds the GIL. A p_alone request needs no thread of
# kvpush's, so the GIL time of the connector's threads (the NIXL I/O thread that owns the pushes, the directory
# client's) over the run, divided by the p_leg requests, is what each prefill leg takes from the forward thread at
# most (on 2 cores the forward waits for the GIL while they hold it). Output in OUT_DIR: bench.txt (the bench's
# output; its JSON also goes to bench/results/), prefill_gil.txt (py-spy raw), prefill_gil_summary.json.
#
#   bash bench/cpu_prefill_profile.sh [OUT_DIR, default /tmp/kvpush-cpu-prefill-prof] [BLOCKS, default 8]
set -u
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-/tmp/kvpush-cpu-prefill-prof}
blocks=${2:-8}
py="$repo/.venv/bin/python"
mkdir -p "$out"
"$py" "$repo/bench/prefill_stages_bench.py" --blocks "$blocks" --log-dir "$out/stack" > "$out/bench.txt" 2>&1 &
bench=$!
# Bounded waits: the engine's pid once it started, then its readiness (the bench's first request follows).
for _ in $(seq 1 300); do grep -q "pid=[0-9]* process=prefill" "$out/bench.txt" 2>/dev/null && break; sleep 1; done
prefill=$(grep -o "pid=[0-9]* process=prefill" "$out/bench.txt" | head -1 | sed 's/pid=\([0-9]*\).*/\1/')
[ -n "$prefill" ] || { echo "prefill engine did not start"; kill "$bench"; exit 1; }
for _ in $(seq 1 300); do grep -q "prefill.*ready\|ready.*prefill" "$out/bench.txt" 2>/dev/null && break; sleep 1; done
# The whole run of blocks: 2 kinds x blocks x 10 requests x (0.3 s gap + ~20 ms), plus the scrapes.
seconds=$(( blocks * 2 * 4 + 5 ))
timeout $(( seconds + 30 )) "$repo/.venv/bin/py-spy" record --pid "$prefill" --subprocesses --threads --gil \
  -r 200 -d "$seconds" -f raw -o "$out/prefill_gil.txt" > "$out/pyspy.log" 2>&1
echo "py-spy exit $?"; tail -2 "$out/pyspy.log"
wait "$bench"; echo "bench exit $?"; tail -1 "$out/bench.txt"
# py-spy names a file by its path from the checkout ("src/kvpush/connector/worker/prefill.py") or in full.
"$py" "$repo/bench/profile_summary.py" "$out/prefill_gil.txt" --marker "(connector/" --marker "(services/" \
  --marker "$repo/connector/" --marker "$repo/services/" --out "$out/prefill_gil_summary.json" > /dev/null
echo "summary: $out/prefill_gil_summary.json"
