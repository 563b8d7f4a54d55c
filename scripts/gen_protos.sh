#!/usr/bin/env bash
# Regenerate src/kvpush/v1 from protos/. CI runs this and fails on any diff.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I protos --python_out=src --pyi_out=src --grpc_python_out=src protos/kvpush/v1/*.proto
touch src/kvpush/v1/__init__.py
