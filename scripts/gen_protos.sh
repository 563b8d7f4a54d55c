#!/usr/bin/env bash
# Regenerate kvpush/v1 from protos/. CI runs this and fails on any diff.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I protos --python_out=. --pyi_out=. --grpc_python_out=. protos/kvpush/v1/*.proto
touch kvpush/v1/__init__.py
