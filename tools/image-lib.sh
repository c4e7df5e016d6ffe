# Shared by tools/image-test.sh and tools/cluster/cluster-test.sh (sourced, not run): a container
# engine, a Debian base image and the CPU image, each made only if missing (`build_cpu_image`
# always rebuilds: the layers cache makes an unchanged tree a few seconds).
# The caller sets `work` (a temporary directory) and stops a dockerd this started
# (`started_dockerd`) when it exits; `skip` says why nothing could run; `PREFIX` starts each line.
BASE_IMAGE=bertserve-debian:bookworm
started_dockerd=""

say() { echo "${PREFIX:-}$*"; }

engine_up() {
    command -v docker >/dev/null || skip "no docker client (apt-get install docker.io)"
    if ! docker info >/dev/null 2>&1; then
        command -v dockerd >/dev/null || skip "no container engine (apt-get install docker.io)"
        dockerd --host unix:///var/run/docker.sock >"$work/dockerd.log" 2>&1 &
        started_dockerd=$!
        for _ in $(seq 60); do
            docker info >/dev/null 2>&1 && break
            kill -0 "$started_dockerd" 2>/dev/null || break
            sleep 0.5
        done
        docker info >/dev/null 2>&1 || skip "dockerd did not start: $(tail -1 "$work/dockerd.log")"
    fi
    say "engine $(docker version --format '{{.Server.Version}}')"
}

# A base image from Debian: no registry is reachable, and the Dockerfile's BASE argument takes it
# (users keep the official python image).
base_image() {
    docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 && return 0
    command -v debootstrap >/dev/null || skip "no debootstrap (apt-get install debootstrap)"
    local started
    started=$(date +%s)
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm \
        "$work/rootfs" http://deb.debian.org/debian >"$work/debootstrap.log" 2>&1 ||
        { tail -20 "$work/debootstrap.log"; exit 1; }
    tar -C "$work/rootfs" -c . | docker import - "$BASE_IMAGE" >/dev/null
    rm -rf "$work/rootfs"
    say "base $BASE_IMAGE from debootstrap in $(($(date +%s) - started)) s"
}

# docker/Dockerfile.cpu on that base, tagged $1 (default bertserve:cpu).
build_cpu_image() {
    local tag=${1:-bertserve:cpu} started
    # This host's CA bundle, for the build stage only (its egress may re-sign TLS).
    cp /etc/ssl/certs/ca-certificates.crt docker/build-ca/host-ca.crt
    started=$(date +%s)
    DOCKER_BUILDKIT=0 docker build -q -f docker/Dockerfile.cpu --build-arg BASE="$BASE_IMAGE" \
        --build-arg PIP_CERT=/tmp/build-ca/host-ca.crt -t "$tag" . >/dev/null
    rm -f docker/build-ca/host-ca.crt
    say "$tag built in $(($(date +%s) - started)) s"
}
