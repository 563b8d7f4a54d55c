#!/usr/bin/env bash
# On the GPU machine (a copy of this checkout there): install the CUDA vLLM 0.25 wheel set once per
# machine (../shared/gpu/README.md; its three parts already copied to /tmp/carry-parts), install kvpush itself
# whenever its sources changed, then run bench/gpu_e2e.py from /tmp (outside the checkout, so the installed
# kvpush package is imported rather than the source folder).
#
#   bash bench/gpu_run.sh e2e                 # arguments go to bench/gpu_e2e.py
#   bash bench/gpu_run.sh serve --connectors kvpush,nixl-push
#   bash bench/gpu_run.sh probe --variants default,side-stream,host-bound   (bench/gpu_stream_probe.py)
#   KVPUSH_GPU_TIMEOUT_S=250 KVPUSH_GPU_TAG=_eager bash bench/gpu_run.sh e2e --eager   (bound and log name)
#   KVPUSH_GPU_WHEEL='dist/kvpush-*.whl' bash bench/gpu_run.sh e2e   (the built wheel instead of the sources)
#
# Results land in $OUT (the folder collected after the run); engine logs under /tmp/kvpush-gpu-logs. A copy of the
# checkout without .git records its commit from KVPUSH_BENCH_COMMIT (bench/bench_io.py).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/kvpush-gpu-out}
mkdir -p "$out"
if [ ! -f /tmp/site/.kvpush-carry ]; then
  # The last part carries install.sh (.gpu-carry/p2 of three parts, or q3 of four: docs/development.md).
  install=$(ls "$repo"/.gpu-carry/*/install.sh 2>/dev/null | head -1)
  [ -n "$install" ] || { echo "wheel set not installed and no .gpu-carry/*/install.sh carried" >&2; exit 2; }
  bash "$install" > "$out/install.log" 2>&1 || { tail -20 "$out/install.log"; exit 1; }
fi
# Wheels kvpush needs beyond the wheel set (aetcd, for directory replicas: the directory imports it; orjson, the
# gateway's JSON), from a carried .gpu-carry/extra:
#   pip download --no-deps -d .gpu-carry/extra aetcd
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 -d .gpu-carry/extra orjson
if ! PYTHONPATH=/tmp/site python3 -c "import aetcd, orjson" 2>/dev/null; then
  ls "$repo"/.gpu-carry/extra/*.whl >/dev/null 2>&1 \
    || { echo "aetcd or orjson missing: carry .gpu-carry/extra (see above)" >&2; exit 2; }
  python3 -m pip install -q --no-deps --no-index --target /tmp/site "$repo"/.gpu-carry/extra/*.whl > "$out/extra.log" 2>&1 \
    || { tail -20 "$out/extra.log"; exit 1; }
fi
# KVPUSH_GPU_PYTHONPATH_PREFIX: a folder put first on PYTHONPATH (a measuring aid such as bench/hook_timeline).
export PYTHONPATH=${KVPUSH_GPU_PYTHONPATH_PREFIX:+$KVPUSH_GPU_PYTHONPATH_PREFIX:}/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 KVPUSH_MODEL_CACHE=${KVPUSH_MODEL_CACHE:-/tmp/kvpush-models}
# kvpush itself: a built wheel when one is carried (KVPUSH_GPU_WHEEL=dist/kvpush-*.whl, what users install: docs/
# install.md), else the checkout's sources, each installed again only when it changed.
if [ -n "${KVPUSH_GPU_WHEEL:-}" ]; then
  wheel=$(cd "$repo" && ls $KVPUSH_GPU_WHEEL | head -1)
  [ -n "$wheel" ] || { echo "no wheel matches $KVPUSH_GPU_WHEEL" >&2; exit 2; }
  install_from="$repo/$wheel"
  sources=$(sha256sum "$install_from" | cut -c1-16)
else
  install_from=.
  sources=$(cd "$repo" && find src protos pyproject.toml -type f -not -path '*/__pycache__/*' \
    | sort | xargs cat | sha256sum | cut -c1-16)
fi
if [ "$(cat /tmp/site/.kvpush-sources 2>/dev/null)" != "$sources" ]; then
  (cd "$repo" && python3 -m pip install -q --no-deps --no-index --no-build-isolation --upgrade --target /tmp/site "$install_from") \
    > "$out/pip.log" 2>&1 || { tail -20 "$out/pip.log"; exit 1; }
  echo "$sources" > /tmp/site/.kvpush-sources
fi
# Which kvpush runs: the installed one, never the checkout (recorded beside the results).
(cd /tmp && python3 -c "import kvpush, kvpush.connector; print(kvpush.__file__, kvpush.connector.__file__)") > "$out/kvpush-path.txt" 2>&1
command=$1; shift
# `profile` is bench/gpu_profile.py (the prefill engine's CUPTI trace); `probe` is bench/gpu_stream_probe.py (streamed
# writes behind a stand-in forward, no vLLM); every other command is gpu_e2e.py's.
script=gpu_e2e.py
[ "$command" = profile ] && script=gpu_profile.py
log_dir=/tmp/kvpush-gpu-logs/$command-$(date +%H%M%S)
cd /tmp
status=0
if [ "$command" = probe ]; then
  timeout "${KVPUSH_GPU_TIMEOUT_S:-560}" python3 "$repo/bench/gpu_stream_probe.py" "$@" > "$out/probe${KVPUSH_GPU_TAG:-}.log" 2>&1 \
    || status=$?
  grep -v "debug\|info " "$out/probe${KVPUSH_GPU_TAG:-}.log" | tail -20
  echo "exit $status"
  exit $status
fi
# Bounded: one remote command may run 10 minutes at most, and a vLLM engine that dies at start-up can leave its
# parent waiting forever (../shared/gpu/README.md).
# KVPUSH_GPU_LAUNCHER: words put before python3, e.g. a profiler (bench/gpu_nsys.sh runs it under nsys).
# shellcheck disable=SC2086
timeout "${KVPUSH_GPU_TIMEOUT_S:-560}" ${KVPUSH_GPU_LAUNCHER:-} python3 "$repo/bench/$script" "$command" --log-dir "$log_dir" "$@" \
  > "$out/$command${KVPUSH_GPU_TAG:-}.log" 2>&1 || status=$?
grep -v "waiting [0-9]* s\|Writing model shards" "$out/$command${KVPUSH_GPU_TAG:-}.log" | tail -40
if [ "$status" != 0 ] && [ -d "$log_dir" ]; then
  # The engines' logs die with the machine: their tails come back in one archive (few files come back per call).
  tails=$(mktemp -d)
  for f in "$log_dir"/*.log; do [ -f "$f" ] && tail -c 200000 "$f" > "$tails/$(basename "$f")"; done
  tar -czf "$out/engine-logs$command${KVPUSH_GPU_TAG:-}.tgz" -C "$tails" . && rm -rf "$tails"
fi
echo "exit $status; engine logs in $log_dir"
exit $status
