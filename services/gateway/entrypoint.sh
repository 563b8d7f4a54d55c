#!/bin/sh
# Entry point of the gateway image.
#   docker run IMAGE serve [FLAGS]   SageMaker's contract: the gateway on SageMaker's port (deploy/sagemaker/serve)
#   docker run IMAGE [FLAGS]         the gateway with these flags (default CMD: --host 0.0.0.0 --port 8080)
set -e
if [ "${1:-}" = "serve" ]; then
  shift
  exec serve "$@"
fi
exec python -m kvpush.gateway "$@"
