#!/usr/bin/env bash
# On the GPU machine: `gpu_e2e.py hops` under Nsight Systems (CUDA API and GPU activity of every process, kernels of
# CUDA graphs one by one), then bench/gpu_nsys_summary.py over its SQLite export: on which stream each of the prefill
# engine's NIXL copies runs, at what priority, when it is enqueued and when it runs next to the forward's kernels.
# Needs the wheel set installed or its last part carried (bench/gpu_run.sh installs it). Output in $OUT:
# nsys_<tag>.json (the summary), hops_nsys<tag>.log, gpu_hops_nsys<tag>.json.
#
#   KVPUSH_GPU_TIMEOUT_S=400 bash bench/gpu_nsys.sh _8192 --prompt-tokens 8192 --iterations 6 --kv-cache-gib 7
set -u
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/kvpush-gpu-out}
mkdir -p "$out"
tag=$1; shift
nsys=$(command -v nsys || ls -d /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys \
  /usr/local/cuda/nsight-systems*/bin/nsys 2>/dev/null | head -1)
[ -n "$nsys" ] || { echo "no nsys on this machine" >&2; exit 2; }
"$nsys" --version > "$out/nsys-version.txt" 2>&1
report=/tmp/kvpush-nsys/hops$tag
mkdir -p /tmp/kvpush-nsys
KVPUSH_GPU_LAUNCHER="$nsys profile --trace=cuda --cuda-graph-trace=node --sample=none --cpuctxsw=none \
  --force-overwrite=true -o $report" KVPUSH_GPU_TAG="_nsys$tag" bash "$repo/bench/gpu_run.sh" hops --tag "_nsys$tag" "$@"
status=$?
[ -f "$report.nsys-rep" ] || { echo "no report written (exit $status)" >&2; exit 1; }
ls -la "$report.nsys-rep" > "$out/nsys-report-size$tag.txt"
timeout 240 "$nsys" export --type sqlite --force-overwrite=true --output "$report.sqlite" "$report.nsys-rep" \
  > "$out/nsys-export$tag.log" 2>&1 || { tail -5 "$out/nsys-export$tag.log"; exit 1; }
timeout 120 python3 "$repo/bench/gpu_nsys_summary.py" "$report.sqlite" > "$out/nsys$tag.json" \
  2> "$out/nsys-summary$tag.err" || { tail -5 "$out/nsys-summary$tag.err"; exit 1; }
python3 - "$out/nsys$tag.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
p = s.get("prefill") or {}
print(json.dumps({k: p.get(k) for k in ("copy_streams", "copy_stream_priorities", "compute_stream_priorities", "copies",
                                        "wait_us", "run_us", "started_inside_forward_window",
                                        "own_kernel_busy_during_wait_us", "other_process_kernel_busy_during_wait_us",
                                        "own_kernel_busy_during_run_us")}, indent=1))
PY
exit $status
