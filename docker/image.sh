#!/bin/sh
# Build hlbp's image with whatever this machine has: docker (with a running daemon), else podman, else buildah
# (neither needs a daemon). Used by `make image` and `make image-test`.
#
#   IMAGE        the tag to build (default hlbp:latest)
#   BASE         the base image (default: the Dockerfile's python:3.11-slim); "local" makes a Debian base here
#                with debootstrap (no registry needed) and tags it localhost/hlbp-base:bookworm
#   TORCH_INDEX  torch's index (default: the Dockerfile's CPU index); "local" installs a torch wheel found in
#                TORCH_WHEELS (default: pip's find-links folder, /opt/wheels) from docker/wheels/
#   PIP_CERT     a CA bundle for pip in the build (a TLS-inspecting proxy); default: pip's own setting here
#   ENGINE       docker, podman or buildah, to choose instead of detecting
set -eu
cd "$(dirname "$0")/.."
IMAGE=${IMAGE:-hlbp:latest}
LOCAL_BASE=localhost/hlbp-base:bookworm
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

say() { echo "image: $*" >&2; }

engine() {
    if [ -n "${ENGINE:-}" ]; then echo "$ENGINE"; return; fi
    if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then echo docker; return; fi
    if command -v podman >/dev/null 2>&1; then echo podman; return; fi
    if command -v buildah >/dev/null 2>&1; then echo buildah; return; fi
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        say "no docker daemon, podman or buildah here: installing podman and buildah (Debian packages)"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman buildah >/dev/null
        echo podman; return
    fi
    say "needs docker (with its daemon), podman or buildah"; exit 1
}

has_image() {  # has_image ENGINE NAME
    case "$1" in
        docker) docker image inspect "$2" >/dev/null 2>&1 ;;
        *) "$1" image exists "$2" 2>/dev/null || "$1" inspect "$2" >/dev/null 2>&1 ;;
    esac
}

local_base() {  # make LOCAL_BASE with debootstrap unless it exists
    if has_image "$1" "$LOCAL_BASE"; then return; fi
    if ! command -v debootstrap >/dev/null 2>&1; then
        say "installing debootstrap (Debian package) to make a base image without a registry"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
    fi
    root=$(mktemp -d)
    mirror=${DEBIAN_MIRROR:-$(sed -n 's/^URIs: *\([^ ]*debian\)$/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n1)}
    say "making $LOCAL_BASE: Debian bookworm with python3 and its venv module (debootstrap, a few minutes)"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" ${mirror:+"$mirror"} >/dev/null
    tar -C "$root" -c . | "$1" import - "$LOCAL_BASE" >/dev/null
    rm -rf "$root"
}

torch_wheel() {  # copy a torch wheel of TORCH_VERSION into docker/wheels/
    dir=${TORCH_WHEELS:-/opt/wheels}
    wheel=$(ls "$dir"/torch-"$TORCH_VERSION"*-cp311-*.whl 2>/dev/null | head -n1 || true)
    if [ -z "$wheel" ]; then say "TORCH_INDEX=local: no torch $TORCH_VERSION wheel for Python 3.11 in $dir"; exit 1; fi
    cp "$wheel" docker/wheels/
}

tool=$(engine)
rm -f docker/wheels/*.whl docker/certs/ca.pem
cert=${PIP_CERT:-$(pip config get global.cert 2>/dev/null || true)}
if [ -n "$cert" ] && [ -f "$cert" ]; then say "pip in the build trusts $cert"; cp "$cert" docker/certs/ca.pem; fi
args=""
if [ "${BASE:-}" = local ]; then local_base "$tool"; args="$args --build-arg BASE=$LOCAL_BASE"
elif [ -n "${BASE:-}" ]; then args="$args --build-arg BASE=$BASE"; fi
if [ "${TORCH_INDEX:-}" = local ]; then torch_wheel; fi
if [ -n "${TORCH_INDEX:-}" ]; then args="$args --build-arg TORCH_INDEX=$TORCH_INDEX"; fi
say "building $IMAGE with $tool${args:+ (}${args# }${args:+)}"
case "$tool" in
    docker) docker build $args -t "$IMAGE" . ;;
    # chroot isolation: RUN steps need no OCI runtime (a container or a sandbox may not run one)
    podman) podman build --isolation chroot --format docker $args -t "$IMAGE" . ;;
    buildah) buildah bud --isolation chroot --format docker $args -t "$IMAGE" . ;;
esac
rm -f docker/wheels/*.whl docker/certs/ca.pem
"$tool" image inspect --format '{{.Size}}' "$IMAGE" 2>/dev/null | awk '{printf "image: %s is %.2f GB\n", "'"$IMAGE"'", $1 / 1e9}' >&2 || true
