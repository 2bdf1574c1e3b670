#!/usr/bin/env bash
# The images the farm builds on, made from Debian packages alone (no image registry):
#
#   deploy/base-image.sh                 # prorl-base:bookworm and prorl-redis:bookworm
#   docker build --build-arg BASE=prorl-base:bookworm -t prorl-farm:latest .
#   PRORL_REDIS_IMAGE=prorl-redis:bookworm docker compose up -d
#
# prorl-base:bookworm is a debootstrap of Debian 12 (the release of python:3.11-slim-bookworm,
# the Dockerfile's default base) with Python 3.11 and venv, and what the farm's image adds
# anyway (bubblewrap, git, pytest, curl), then `docker import`. prorl-redis:bookworm is that
# base with Debian's redis-server (7.0), for docker-compose.yml's redis service.
#
# Needs root (debootstrap), debootstrap, and a Docker engine (DOCKER_HOST is honoured).
# Settings (environment): BASE_TAG, REDIS_TAG, SUITE (bookworm), MIRROR
# (http://deb.debian.org/debian), FORCE=1 to rebuild images that exist.
set -euo pipefail

BASE_TAG=${BASE_TAG:-prorl-base:bookworm}
REDIS_TAG=${REDIS_TAG:-prorl-redis:bookworm}
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
PACKAGES=ca-certificates,python3,python3-venv,python3-pytest,bubblewrap,git,curl,redis-server
here=$(cd "$(dirname "$0")" && pwd)

die() { echo "base-image: $*" >&2; exit 1; }
command -v docker >/dev/null || die "docker (the client) is not installed"
docker info >/dev/null 2>&1 || die "no Docker engine answers (DOCKER_HOST=${DOCKER_HOST:-unset})"

if [ "${FORCE:-0}" = 1 ] || ! docker image inspect "$BASE_TAG" >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || die "debootstrap needs root"
    command -v debootstrap >/dev/null || die "debootstrap is not installed (apt-get install debootstrap)"
    root=$(mktemp -d /var/tmp/prorl-rootfs.XXXXXX)
    trap 'rm -rf "$root"' EXIT
    echo "base-image: debootstrap $SUITE from $MIRROR" >&2
    debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$root" "$MIRROR" >&2 \
        || { tail -30 "$root/debootstrap/debootstrap.log" >&2 2>/dev/null; die "debootstrap failed"; }
    # What a container image leaves out: package caches and lists, logs.
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/var/log/*
    printf 'deb %s %s main\ndeb %s %s-updates main\n' "$MIRROR" "$SUITE" "$MIRROR" "$SUITE" \
        > "$root/etc/apt/sources.list"
    tar --numeric-owner -C "$root" -c . | docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' - "$BASE_TAG" >/dev/null
    echo "base-image: $BASE_TAG imported" >&2
fi

if [ "${FORCE:-0}" = 1 ] || ! docker image inspect "$REDIS_TAG" >/dev/null 2>&1; then
    docker build -q --network host --build-arg BASE="$BASE_TAG" -t "$REDIS_TAG" \
        -f "$here/redis.Dockerfile" "$here" >/dev/null
    echo "base-image: $REDIS_TAG built" >&2
fi
echo "$BASE_TAG $REDIS_TAG"
