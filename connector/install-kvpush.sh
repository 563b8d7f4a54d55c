#!/bin/sh
# Installs kvpush into an image from the hashed lock, with the image's `python3` (a venv's where PATH puts one first):
#   install-kvpush.sh deps LOCK                     every package of LOCK at its version and sha256, no resolver
#   install-kvpush.sh deps LOCK --keep-installed    the same, less what the image already has (an image built on
#                                                   vLLM's keeps vLLM's torch and the packages vLLM shares with kvpush)
#   install-kvpush.sh deps LOCK --only NAME,NAME    only these packages of LOCK (replacing the image's versions)
#   install-kvpush.sh wheel WHEEL                   kvpush itself, --no-deps, then a check that every requirement of
#                                                   kvpush is met (a base whose version is too old fails the build)
# Two steps so that the dependencies' layer is kept while only kvpush changes.
set -eu
pip() { python3 -m pip --disable-pip-version-check install --no-cache-dir "$@"; }
case "${1:-}" in
  deps)
    lock=$2
    case "${3:-}" in
      # Names as pip canonicalises them: lower case, runs of - _ . as one -.
      --keep-installed)
        names=$(python3 -m pip list --format=freeze | cut -d= -f1 | tr 'A-Z_.' 'a-z--' | tr -s -) keep=0 ;;
      --only) names=$(echo "$4" | tr ',' '\n') keep=1 ;;
      *) names="" keep=0 ;;
    esac
    # A lock entry is its `name==version \` line and the indented hash and comment lines under it: one entry is
    # left out when its name is listed (or, with --only, when it is not).
    awk -v names=" $(echo $names) " -v keep="$keep" '
      /^[A-Za-z0-9]/ { name = tolower($1); sub(/==.*/, "", name); gsub(/[-_.]+/, "-", name)
                       drop = (index(names, " " name " ") > 0) != keep }
      !drop' "$lock" > /tmp/kvpush-selected.lock
    lock=/tmp/kvpush-selected.lock
    # An empty lock (the base has everything) is not an error.
    if grep -q '==' "$lock"; then pip --require-hashes --no-deps -r "$lock"; fi
    rm -f /tmp/kvpush-selected.lock
    ;;
  wheel)
    pip --no-deps "$2"
    # pip check lists every broken requirement in the image; kvpush's own must all hold.
    if python3 -m pip check | grep '^kvpush '; then
      echo "install-kvpush.sh: kvpush's requirements above are not met by this image" >&2
      exit 1
    fi
    ;;
  *)
    echo "usage: install-kvpush.sh deps LOCK [--keep-installed | --only NAME,NAME] | wheel WHEEL" >&2
    exit 2
    ;;
esac
