#!/usr/bin/env bash
# buf breaking: protos/ as it is now against the protos of a baseline commit, offline (the baseline is
# read with git archive, so it works in a worktree and a fresh clone alike).
#   On a branch: the baseline is where it left main (git merge-base HEAD main): what this branch changes.
#   On main (CI's fresh clone has main checked out): the baseline is HEAD's first parent, i.e. main
#   before the last commit or merge.
#   BUF_BREAKING_AGAINST=<ref> overrides both.
# Compatibility is checked for wire and generated code alike (buf's FILE rules).
set -euo pipefail
cd "$(dirname "$0")/.."
against="${BUF_BREAKING_AGAINST:-}"
if [[ -z "$against" ]]; then
    head=$(git rev-parse HEAD)
    main=$(git rev-parse --verify --quiet main || true)
    base=""
    [[ -n "$main" ]] && base=$(git merge-base HEAD main || true)
    if [[ -n "$base" && "$base" != "$head" ]]; then
        against="$base"
    elif git rev-parse --verify --quiet HEAD~1 >/dev/null; then
        against="HEAD~1"
    else
        echo "buf breaking: no baseline commit (a single-commit history); skipped"
        exit 0
    fi
fi
# A commit that breaks the API on purpose (before anything outside depends on it) says so with a
# "Proto-Breaking: allowed" trailer; changes are then checked from that commit on.
allowed=$(git log --format=%H --grep='^Proto-Breaking: allowed$' "$against..HEAD" | head -n 1)
if [[ -n "$allowed" ]]; then
    echo "buf breaking: $(git rev-parse --short "$allowed") breaks the API on purpose; checking from there"
    against="$allowed"
fi
if ! git cat-file -e "$against:protos/buf.yaml" 2>/dev/null; then
    echo "buf breaking: $against has no protos/buf.yaml; skipped"
    exit 0
fi
baseline=$(mktemp -d)
trap 'rm -rf "$baseline"' EXIT
git archive "$against" protos | tar -x -C "$baseline"
cd protos
../node_modules/.bin/buf breaking --against "$baseline/protos"
echo "buf breaking: no breaking change against $(git rev-parse --short "$against")"
