#!/usr/bin/env bash
# `make image-test`: the CPU image and the compose stack, built and run for real.
#
# 1. a container engine: dockerd if none answers (default bridge networking: the build's RUN
#    steps reach the package registries through it); none at all is a skip, not a failure;
# 2. a base image from Debian (debootstrap --variant=minbase bookworm, then docker import): no
#    registry is reachable, and the Dockerfile's BASE argument takes it (users keep the
#    official python image);
# 3. docker/Dockerfile.cpu built on it, run read-only as it ships, and checked by
#    tools/image_check.py: readiness, every endpoint, non-root, read-only root, SIGTERM with
#    requests in flight (all answered, exit 0), the image size;
# 4. docker-compose up of bertserve + Prometheus (built from Debian's package in place of the
#    pinned image): traffic, then Prometheus' API must report it.
# Everything it started is stopped and removed at the end, pass or fail.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
work=$(mktemp -d)

skip() {
    echo "image-test: skipped: $*"
    exit 0
}

cleanup() {
    set +e
    docker rm -f bertserve-image-test >/dev/null 2>&1
    GRAFANA_ADMIN_PASSWORD=x docker-compose -p bertserve-image-test -f docker-compose.yml \
        -f docker/compose.debian-prometheus.yml down -v --remove-orphans >/dev/null 2>&1
    rm -f docker/build-ca/*.crt
    if [ -n "$started_dockerd" ]; then
        kill "$started_dockerd" 2>/dev/null
        wait "$started_dockerd" 2>/dev/null
    fi
    rm -rf "$work"
}
trap cleanup EXIT

# --- 1-3. the engine, a base image from Debian, the CPU image (tools/image-lib.sh) ------------------
# shellcheck source=tools/image-lib.sh
. tools/image-lib.sh
PREFIX="image-test: "
engine_up
base_image
build_cpu_image bertserve:cpu
"$PY" tools/image_check.py image bertserve:cpu

# --- 4. the compose stack with a live Prometheus ---------------------------------------------------
export GRAFANA_ADMIN_PASSWORD BERTSERVE_BASE="$BASE_IMAGE"
GRAFANA_ADMIN_PASSWORD=$("$PY" -c 'import secrets; print(secrets.token_urlsafe(18))')
compose=(docker-compose -p bertserve-image-test -f docker-compose.yml -f docker/compose.debian-prometheus.yml)
started=$(date +%s)
"${compose[@]}" build -q prometheus >/dev/null
if ! "${compose[@]}" up -d bertserve prometheus >"$work/up.log" 2>&1; then
    cat "$work/up.log"
    "${compose[@]}" logs --tail 20 bertserve prometheus
    exit 1
fi
echo "image-test: compose up in $(($(date +%s) - started)) s"
"$PY" tools/image_check.py compose http://127.0.0.1:8000 http://127.0.0.1:9090
