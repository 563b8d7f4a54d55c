#!/usr/bin/env bash
# Refresh the locks on purpose: every Python package of the development/CI environment and of the
# images (versions and sha256 hashes), the npm tree (buf), then the generated code with the newly
# locked toolchain. `make lock` runs this; commit what it changes.
#   requirements/dev.lock      pyproject.toml's [dev] extra + requirements/dev.in (vLLM for CPU, NIXL,
#                              build backend): what `make setup` installs, exactly.
#   requirements/runtime.lock  kvpush's own dependencies only, at the same versions: what the directory
#                              and gateway images install.
#   requirements/engine-cpu.lock  kvpush's dependencies with its [engine] extra + requirements/engine-cpu.in
#                              (vLLM for CPU, NIXL), at the same versions: what the CPU engine image installs.
# LOCK_ARGS passes more to uv, e.g. LOCK_ARGS="--upgrade-package grpcio" (default: --upgrade, newest of all).
set -euo pipefail
cd "$(dirname "$0")/.."
wheelhouse="${KVPUSH_WHEELHOUSE:-/opt/wheels}"
uv=.venv/bin/uv
[ -x "$uv" ] || uv=uv
common=(--native-tls --python-version 3.11 --python-platform x86_64-manylinux_2_28 --generate-hashes --no-header --quiet)
[ -d "$wheelhouse" ] && common+=(--find-links "$wheelhouse")
# read -a splits LOCK_ARGS on spaces (empty when unset).
read -r -a extra <<< "${LOCK_ARGS---upgrade}"
"$uv" pip compile pyproject.toml requirements/dev.in --extra dev "${common[@]}" "${extra[@]}" \
    --no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec \
    --no-emit-package nixl-cu12 -o requirements/dev.lock
"$uv" pip compile pyproject.toml "${common[@]}" --constraint requirements/dev.lock \
    -o requirements/runtime.lock
"$uv" pip compile pyproject.toml requirements/engine-cpu.in --extra engine "${common[@]}" \
    --constraint requirements/dev.lock --no-emit-package torchvision --no-emit-package torchaudio \
    --no-emit-package torchcodec --no-emit-package nixl-cu12 -o requirements/engine-cpu.lock
npm install --package-lock-only --no-audit --no-fund --silent
echo "[lock] requirements/*.lock and package-lock.json refreshed; regenerating src/kvpush/v1 with the locked toolchain" >&2
# The new toolchain must be installed before it generates code.
scripts/setup.sh
PATH="$PWD/.venv/bin:$PATH" scripts/gen_protos.sh
git status --short -- requirements package-lock.json src/kvpush/v1
