#!/usr/bin/env bash
# `make cluster-test`: docker/k8s on a real one-node Kubernetes cluster, under load (not in CI:
# root, about 4 minutes of building once and 15 minutes a run).
#
# 1. build.sh: Kubernetes 1.20 from Debian's source package, cached outside the repository;
# 2. cluster.sh up: etcd, the control plane, containerd, kubelet, kube-proxy on this machine;
# 3. images.sh: bertserve:cpu (and a second tag for the rolling update) and the pause image,
#    imported into the cluster's containerd;
# 4. run.py: the manifests applied (overlay.py), the scenarios under load, the report
#    (docs/reports/cluster.md by default; REPORT=... elsewhere);
# 5. always: the run's logs kept in runs/cluster-test/, Prometheus stopped, cluster.sh down, a
#    dockerd this started stopped. The machine is left as it was, but for the apt packages it
#    installed and the build cache (and, where this started dockerd, what dockerd leaves: the
#    docker0 bridge and its iptables chains, as `make image-test` does).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
REPORT=${REPORT:-docs/reports/cluster.md}
RUN=${BERTSERVE_CLUSTER_RUN:-/tmp/bertserve-cluster}
export BERTSERVE_CLUSTER_RUN=$RUN

[[ $(id -u) -eq 0 ]] || { echo "cluster-test: run as root (a kubelet, iptables, mounts)" >&2; exit 1; }
export DEBIAN_FRONTEND=noninteractive
need=()
for pkg in etcd-server containerd runc containernetworking-plugins conntrack iptables iproute2 \
    openssl curl gcc libc6-dev docker.io docker-compose debootstrap; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if ((${#need[@]})); then
    echo "cluster-test: apt-get install ${need[*]}"
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

started_dockerd=""
work=$(mktemp -d)
teardown() {
    set +e
    # The run's record outlives the cluster: every request of each load, the adapter's reads,
    # each component's log, result.json (runs/ is not committed).
    if [[ -d $RUN/log ]]; then
        rm -rf runs/cluster-test && mkdir -p runs/cluster-test
        cp -r "$RUN/log" "$RUN"/*.json "$RUN"/*.jsonl runs/cluster-test/ 2>/dev/null
    fi
    docker rm -f bertserve-cluster-prometheus >/dev/null 2>&1
    [[ -f $RUN/pid/adapter ]] && kill "$(cat "$RUN/pid/adapter")" 2>/dev/null
    tools/cluster/cluster.sh down
    [[ -n $started_dockerd ]] && kill "$started_dockerd" 2>/dev/null
    rm -rf "$work" docker/build-ca/host-ca.crt
}
trap teardown EXIT

skip() { echo "cluster-test: $*" >&2; exit 1; }
PREFIX="cluster-test: "
# shellcheck source=tools/image-lib.sh
. tools/image-lib.sh
tools/cluster/build.sh
engine_up  # before the cluster: dockerd loads br_netfilter, which the pod network needs
base_image
tools/cluster/cluster.sh up
tools/cluster/images.sh
# Prometheus as the compose stack builds it (Debian's package).
docker image inspect bertserve-prometheus:debian >/dev/null 2>&1 ||
    BERTSERVE_BASE=$BASE_IMAGE GRAFANA_ADMIN_PASSWORD=x docker-compose -f docker-compose.yml \
        -f docker/compose.debian-prometheus.yml build -q prometheus >/dev/null
"$PY" tools/cluster/run.py --run "$RUN" --report "$REPORT"
