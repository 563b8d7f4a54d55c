#!/usr/bin/env bash
# Builds the container images (services/*/Dockerfile, connector/Dockerfile.cpu) with podman, on a machine that can pull no base image:
#   scripts/images.sh build        directory, gateway and CPU engine images from dist/kvpush-*.whl (`make images`)
#   scripts/images.sh podman ARGS  podman with this machine's settings (what tests/integration/images runs)
# Needs root, podman, runc and mmdebstrap (scripts/setup.sh installs them). The base is a Debian bookworm Python made
# with mmdebstrap and imported as localhost/debian-py:bookworm (once); each image names it in its BASE_IMAGE build
# argument (the Dockerfiles default to python:3.11-slim). podman keeps every layer: a rebuild redoes only the steps
# after the first changed input (the lock's layer stays while only kvpush changes).
# At build time only, pip gets this machine's CA bundle and wheelhouse (torch's CPU build), and apt its settings,
# through a pip.conf mounted into the build; none of it is in an image.
set -euo pipefail
cd "$(dirname "$0")/.."
base=localhost/debian-py:bookworm
work=${KVPUSH_IMAGES_WORK:-/var/tmp/kvpush-images}
wheelhouse=${KVPUSH_WHEELHOUSE:-/opt/wheels}
mkdir -p "$work"
# This machine's cgroup layout needs runc (crun refuses it), and podman's default ulimits cannot be set here.
printf '[containers]\ndefault_ulimits = []\n' > "$work/containers.conf"
export CONTAINERS_CONF="$work/containers.conf"
podman_() { podman --runtime runc "$@"; }

base_image() {
  podman_ image exists "$base" && return 0
  echo "[images] making $base with mmdebstrap" >&2
  rm -f "$work/base.tar"
  mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates,passwd bookworm "$work/base.tar"
  podman_ import "$work/base.tar" "$base" >/dev/null
  rm -f "$work/base.tar"
}

# The Dockerfile of each image: the services' in services/<name>/, the engine's beside the connector.
dockerfile() {
  case "$1" in
    engine-cpu) echo connector/Dockerfile.cpu ;;
    *) echo "services/$1/Dockerfile" ;;
  esac
}

build() {
  local wheels=(dist/kvpush-*.whl)
  [ -f "${wheels[0]}" ] || { echo "[images] no dist/kvpush-*.whl: run make wheel" >&2; exit 2; }
  [ ${#wheels[@]} = 1 ] || { echo "[images] several wheels in dist/: ${wheels[*]}" >&2; exit 2; }
  local version
  version=$(basename "${wheels[0]}" | cut -d- -f2)
  base_image
  local certs=${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}
  {
    echo "[global]"
    echo "cert = /run/kvpush-build/ca-certificates.crt"
    [ -d "$wheelhouse" ] && echo "find-links = /run/kvpush-build/wheels"
  } > "$work/pip.conf"
  local mounts=(-v "$certs:/run/kvpush-build/ca-certificates.crt:ro" -v "$work/pip.conf:/etc/pip.conf:ro")
  [ -d "$wheelhouse" ] && mounts+=(-v "$wheelhouse:/run/kvpush-build/wheels:ro")
  for conf in /etc/apt/apt.conf.d/99artifact-registry; do  # apt settings this machine's mirror needs
    [ -f "$conf" ] && mounts+=(-v "$conf:/etc/apt/apt.conf.d/$(basename "$conf"):ro")
  done
  local name tag started previous
  for name in directory gateway engine-cpu; do
    tag=localhost/kvpush/$name:$version
    started=$SECONDS
    previous=$(podman_ image inspect --format '{{.Id}}' "$tag" 2>/dev/null || true)
    # The torch CPU wheel comes from the wheelhouse here: no PyTorch index.
    podman_ build --quiet --pull=never --isolation chroot --network host "${mounts[@]}" \
      --build-arg "BASE_IMAGE=$base" --build-arg PIP_EXTRA_INDEX_URL= \
      -f "$(dockerfile "$name")" -t "$tag" . >/dev/null
    echo "[images] $tag built in $((SECONDS - started)) s" >&2
    # The image this tag named before, now untagged: its own top layers go (the shared ones stay in use).
    if [ -n "$previous" ] && [ "$previous" != "$(podman_ image inspect --format '{{.Id}}' "$tag")" ]; then
      podman_ rmi "$previous" >/dev/null 2>&1 || true
    fi
  done
}

case "${1:-}" in
  build) build ;;
  podman) shift; podman_ "$@" ;;
  *) echo "usage: scripts/images.sh build | podman ARGS..." >&2; exit 2 ;;
esac
