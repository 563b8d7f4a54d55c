#!/usr/bin/env bash
# On the GPU machine: `gpu_e2e.py hops` (Llama-3.1-8B's shape) while py-spy samples the prefill engine's processes,
# so the forward thread's time in kvpush's hooks and the connector's threads show next to vLLM's own work.
# Needs the wheel set installed (bench/gpu_run.sh) and a py-spy wheel carried in .gpu-carry/tools
# (`pip download --no-deps -d .gpu-carry/tools py-spy`). Output in $OUT: prefill_prof.txt (py-spy raw), the hops log.
# Summarise here with `python bench/profile_summary.py prefill_prof.txt`.
#
#   timeout 270 bash bench/gpu_prefill_profile.sh [seconds to sample, default 30]
#
# Another process or preset: KVPUSH_PROFILE_PROCESS (default prefill; e.g. gateway-kvpush) and KVPUSH_PROFILE_HOPS_ARGS
# (gpu_e2e.py hops flags, default "--iterations 60 --tag _8b_prof"); the samples land in <process>_prof.txt.
set -u
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/kvpush-gpu-out}
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-index --target /tmp/pyspy "$repo"/.gpu-carry/tools/py_spy-*.whl \
  > "$out/pyspy-install.log" 2>&1 || { tail -5 "$out/pyspy-install.log"; exit 1; }
process=${KVPUSH_PROFILE_PROCESS:-prefill}
# shellcheck disable=SC2086  # the hops flags are words
(KVPUSH_GPU_TIMEOUT_S=400 KVPUSH_GPU_TAG=_prof bash "$repo/bench/gpu_run.sh" hops \
  ${KVPUSH_PROFILE_HOPS_ARGS:---iterations 60 --tag _8b_prof} > "$out/run.txt" 2>&1 &)
# Bounded waits: the gateway starts after both engines are ready.
for _ in $(seq 1 200); do grep -q "process=gateway-kvpush" "$out/hops_prof.log" 2>/dev/null && break; sleep 2; done
pid=$(grep -o "pid=[0-9]* process=$process" "$out/hops_prof.log" | head -1 | sed 's/pid=\([0-9]*\).*/\1/')
[ -n "$pid" ] || { echo "$process did not start"; exit 1; }
sleep 6  # the first rounds (warm-up) pass
timeout 90 /tmp/pyspy/bin/py-spy record --pid "$pid" --subprocesses --threads -d "${1:-30}" -r 250 -f raw \
  -o "$out/${process}_prof.txt" > "$out/pyspy.log" 2>&1
echo "py-spy exit $?"; tail -2 "$out/pyspy.log"
