#!/usr/bin/env bash
# A one-node Kubernetes 1.20 cluster on this machine, for `make cluster-test` (test tooling, not
# the product): `cluster.sh up` starts it, `cluster.sh down` stops it and removes every trace
# (processes, mounts, iptables chains, the bridge, cgroups, the state directory).
#
# Parts: etcd, containerd, runc and the bridge + host-local CNI plugins from Debian; the control
# plane, kubelet, kube-proxy and kubectl built from Debian's source package (build.sh); every
# certificate made here by openssl. Every component authenticates with one administrator
# certificate (system:masters): the cluster lives for a test run, on loopback and on its bridge.
#
# State: $BERTSERVE_CLUSTER_RUN (default /tmp/bertserve-cluster), binaries from build.sh's cache.
set -euo pipefail

CACHE=${BERTSERVE_CLUSTER_CACHE:-/var/cache/bertserve-cluster}
RUN=${BERTSERVE_CLUSTER_RUN:-/tmp/bertserve-cluster}
BIN=$CACHE/bin
NODE=bertserve-node
POD_CIDR=10.244.0.0/24
SERVICE_CIDR=10.96.0.0/24
BRIDGE=bsk0
export KUBECONFIG=$RUN/admin.kubeconfig
PATH=$BIN:$PATH

log() { echo "cluster: $*" >&2; }

node_ip() {
    # The address of the default route's interface: what the apiserver advertises and the
    # kubelet registers (never a bridge's).
    ip -4 route get 1.1.1.1 | sed -n 's/.* src \([0-9.]*\).*/\1/p'
}

certs() {
    local d=$RUN/pki ip=$1
    mkdir -p "$d"
    openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=bertserve-cluster-ca \
        -keyout "$d/ca.key" -out "$d/ca.crt" 2>/dev/null
    issue() { # name, subject, extensions
        openssl req -newkey rsa:2048 -nodes -subj "$2" -keyout "$d/$1.key" -out "$d/$1.csr" 2>/dev/null
        printf '%s\n' "$3" >"$d/$1.ext"
        openssl x509 -req -in "$d/$1.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial \
            -days 2 -extfile "$d/$1.ext" -out "$d/$1.crt" 2>/dev/null
    }
    issue apiserver /CN=kube-apiserver \
        "subjectAltName=IP:127.0.0.1,IP:$ip,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc
extendedKeyUsage=serverAuth"
    issue admin "/O=system:masters/CN=admin" "extendedKeyUsage=clientAuth"
    issue front-proxy /CN=front-proxy-client "extendedKeyUsage=clientAuth"
    issue kubelet "/CN=$NODE" "subjectAltName=IP:$ip,IP:127.0.0.1,DNS:$NODE
extendedKeyUsage=serverAuth"
    # The test's custom metrics API (adapter.py), reached by the apiserver at the node's address.
    issue adapter /CN=custom-metrics-adapter "subjectAltName=IP:$ip,IP:127.0.0.1
extendedKeyUsage=serverAuth"
    openssl genrsa -out "$d/sa.key" 2048 2>/dev/null
    openssl rsa -in "$d/sa.key" -pubout -out "$d/sa.pub" 2>/dev/null
    : >"$KUBECONFIG"  # kubectl warns of a missing file, not of an empty one
    kubectl config set-cluster c --server=https://127.0.0.1:6443 \
        --certificate-authority="$d/ca.crt" --embed-certs >/dev/null
    kubectl config set-credentials admin --client-certificate="$d/admin.crt" \
        --client-key="$d/admin.key" --embed-certs >/dev/null
    kubectl config set-context c --cluster=c --user=admin >/dev/null
    kubectl config use-context c >/dev/null
}

start() { # name, command...: runs in the background, log and pid under $RUN
    local name=$1
    shift
    "$@" >"$RUN/log/$name.log" 2>&1 &
    echo $! >"$RUN/pid/$name"
}

wait_for() { # what, seconds, command...
    local what=$1 limit=$2 i
    shift 2
    for ((i = 0; i < limit * 2; i++)); do
        "$@" >/dev/null 2>&1 && return 0
        sleep 0.5
    done
    log "$what not ready after ${limit} s"
    return 1
}

containerd_config() {
    cat <<EOF
version = 2
root = "$RUN/containerd/root"
state = "$RUN/containerd/state"
[grpc]
  address = "$RUN/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "bertserve.local/pause:1"
  # These machines refuse a container's oom_score_adj below the runtime's own.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$RUN/cni"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
EOF
}

cni_config() {
    cat <<EOF
{"cniVersion": "0.4.0", "name": "bertserve", "plugins": [
  {"type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": true, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR"}]],
            "routes": [{"dst": "0.0.0.0/0"}], "dataDir": "$RUN/cni-ipam"}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
EOF
}

up() {
    [[ $(id -u) -eq 0 ]] || { log "run as root"; exit 1; }
    [[ -e $RUN ]] && { log "$RUN exists: a cluster is up or was not torn down (cluster.sh down)"; exit 1; }
    # What down removes (KUBE-* and CNI-* chains, cni-* namespaces) must be this cluster's own.
    if iptables-save 2>/dev/null | grep -q '^:KUBE-' || ip netns list 2>/dev/null | grep -q '^cni-'; then
        log "another Kubernetes or CNI runtime is active here (KUBE-* chains or cni-* namespaces)"
        exit 1
    fi
    [[ -e /proc/sys/net/bridge/bridge-nf-call-iptables ]] || modprobe br_netfilter 2>/dev/null ||
        { log "the br_netfilter module is not loaded (modprobe br_netfilter)"; exit 1; }
    mkdir -p "$RUN"/{log,pid,cni,etcd,kubelet}
    local ip
    ip=$(node_ip)
    log "node $NODE at $ip"
    certs "$ip"
    local p=$RUN/pki

    # Bridged pod traffic passes iptables (Services between pods on one bridge), forwarding on;
    # Docker's FORWARD policy is DROP, so the pod network is let through, and taken out at down.
    # The kernel settings this sets, the kubelet sets (panic on oops, overcommit, key quotas) and
    # kube-proxy sets (route_localnet, conntrack): as they were, for down to put back.
    for f in net/bridge/bridge-nf-call-iptables net/ipv4/ip_forward kernel/panic kernel/panic_on_oops \
        vm/overcommit_memory kernel/keys/root_maxkeys kernel/keys/root_maxbytes \
        net/ipv4/conf/all/route_localnet net/netfilter/nf_conntrack_max \
        net/netfilter/nf_conntrack_tcp_timeout_established net/netfilter/nf_conntrack_tcp_timeout_close_wait; do
        [[ -w /proc/sys/$f ]] && echo "/proc/sys/$f $(cat "/proc/sys/$f")" >>"$RUN/sysctl.before"
    done
    echo 1 >/proc/sys/net/bridge/bridge-nf-call-iptables
    echo 1 >/proc/sys/net/ipv4/ip_forward
    iptables -I FORWARD -s "$POD_CIDR" -m comment --comment bertserve-cluster -j ACCEPT
    iptables -I FORWARD -d "$POD_CIDR" -m comment --comment bertserve-cluster -j ACCEPT

    start etcd etcd --name bertserve --data-dir "$RUN/etcd" \
        --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
        --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
        --initial-cluster bertserve=http://127.0.0.1:2380
    wait_for etcd 30 curl -sf http://127.0.0.1:2379/health

    start kube-apiserver kube-apiserver --etcd-servers=http://127.0.0.1:2379 \
        --bind-address=0.0.0.0 --secure-port=6443 --advertise-address="$ip" \
        --service-cluster-ip-range="$SERVICE_CIDR" --allow-privileged=true \
        --authorization-mode=Node,RBAC --client-ca-file="$p/ca.crt" \
        --tls-cert-file="$p/apiserver.crt" --tls-private-key-file="$p/apiserver.key" \
        --kubelet-client-certificate="$p/admin.crt" --kubelet-client-key="$p/admin.key" \
        --kubelet-certificate-authority="$p/ca.crt" \
        --kubelet-preferred-address-types=InternalIP,Hostname \
        --service-account-key-file="$p/sa.pub" --service-account-signing-key-file="$p/sa.key" \
        --service-account-issuer=https://kubernetes.default.svc \
        --requestheader-client-ca-file="$p/ca.crt" --requestheader-allowed-names=front-proxy-client \
        --requestheader-username-headers=X-Remote-User --requestheader-group-headers=X-Remote-Group \
        --requestheader-extra-headers-prefix=X-Remote-Extra- \
        --proxy-client-cert-file="$p/front-proxy.crt" --proxy-client-key-file="$p/front-proxy.key" \
        --enable-aggregator-routing=true
    wait_for kube-apiserver 90 kubectl get --raw /readyz

    start kube-controller-manager kube-controller-manager --kubeconfig="$KUBECONFIG" \
        --leader-elect=false --service-account-private-key-file="$p/sa.key" \
        --root-ca-file="$p/ca.crt" --cluster-cidr="$POD_CIDR" --allocate-node-cidrs=false \
        --use-service-account-credentials=false --horizontal-pod-autoscaler-sync-period=15s
    start kube-scheduler kube-scheduler --kubeconfig="$KUBECONFIG" --leader-elect=false

    mkdir -p "$RUN/containerd"
    containerd_config >"$RUN/containerd/config.toml"
    cni_config >"$RUN/cni/10-bertserve.conflist"
    start containerd containerd --config "$RUN/containerd/config.toml"
    wait_for containerd 30 ctr --address "$RUN/containerd.sock" version

    cat >"$RUN/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication:
  anonymous: {enabled: false}
  x509: {clientCAFile: "$p/ca.crt"}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
tlsCertFile: "$p/kubelet.crt"
tlsPrivateKeyFile: "$p/kubelet.key"
cgroupDriver: cgroupfs
failSwapOn: false
readOnlyPort: 0
serializeImagePulls: false
# The load pods' logs are every request they made: rotated at 10 Mi by default.
containerLogMaxSize: 500Mi
# The test gives each replica a CPU limit of 300m (overlay.py). Enforced over the default 100 ms
# CFS period, that is 30 ms of running and 70 ms stopped, and a pod's tail latency is the
# stop, whatever its load; over 10 ms a replica behaves as a slower CPU, as a small node would.
featureGates: {CustomCPUCFSQuotaPeriod: true}
cpuCFSQuotaPeriod: 10ms
# The images are imported, never pulled: never collect them.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "500Mi", nodefs.available: "2%", imagefs.available: "2%"}
EOF
    start kubelet kubelet --config="$RUN/kubelet/config.yaml" --kubeconfig="$KUBECONFIG" \
        --root-dir="$RUN/kubelet" --hostname-override="$NODE" --node-ip="$ip" \
        --container-runtime=remote --container-runtime-endpoint="unix://$RUN/containerd.sock" \
        --pod-infra-container-image=bertserve.local/pause:1
    start kube-proxy kube-proxy --kubeconfig="$KUBECONFIG" --hostname-override="$NODE" \
        --proxy-mode=iptables --cluster-cidr="$POD_CIDR" --conntrack-max-per-core=0
    wait_for "node $NODE" 90 kubectl wait --for=condition=Ready "node/$NODE" --timeout=1s
    log "up: $(kubectl version --short 2>/dev/null | tail -1)"
}

import_image() { # docker image reference
    docker save "$1" | ctr --address "$RUN/containerd.sock" -n k8s.io images import - >/dev/null
}

down() {
    [[ -d $RUN ]] || return 0
    set +e
    if [[ -f $RUN/pid/kube-apiserver ]] && kubectl get --raw /readyz >/dev/null 2>&1; then
        # Pods first, while the kubelet runs: each one's network (CNI DEL) goes with it.
        kubectl delete deployments,hpa --all --wait=false >/dev/null 2>&1
        kubectl delete pods --all --all-namespaces --grace-period=1 --timeout=60s >/dev/null 2>&1
    fi
    for name in kube-proxy kubelet kube-scheduler kube-controller-manager kube-apiserver etcd; do
        [[ -f $RUN/pid/$name ]] && kill "$(cat "$RUN/pid/$name")" 2>/dev/null
    done
    sleep 2
    # Sandboxes and containers the kubelet left, then containerd itself.
    if [[ -S $RUN/containerd.sock ]]; then
        local c=(ctr --address "$RUN/containerd.sock" -n k8s.io)
        for t in $("${c[@]}" tasks ls -q 2>/dev/null); do "${c[@]}" tasks kill -s KILL "$t" 2>/dev/null; done
        sleep 1
        for t in $("${c[@]}" tasks ls -q 2>/dev/null); do "${c[@]}" tasks delete -f "$t" 2>/dev/null; done
        for t in $("${c[@]}" containers ls -q 2>/dev/null); do "${c[@]}" containers delete "$t" 2>/dev/null; done
    fi
    [[ -f $RUN/pid/containerd ]] && kill "$(cat "$RUN/pid/containerd")" 2>/dev/null
    for name in kube-proxy kubelet kube-scheduler kube-controller-manager kube-apiserver etcd containerd; do
        [[ -f $RUN/pid/$name ]] || continue
        local pid
        pid=$(cat "$RUN/pid/$name")
        for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        kill -9 "$pid" 2>/dev/null
    done
    pkill -f "containerd-shim-runc-v2 -namespace k8s.io -address $RUN/containerd.sock" 2>/dev/null
    # What the kubelet and the CNI plugins left in the kernel.
    kube-proxy --cleanup >/dev/null 2>&1
    while iptables -D FORWARD -s "$POD_CIDR" -m comment --comment bertserve-cluster -j ACCEPT 2>/dev/null; do :; done
    while iptables -D FORWARD -d "$POD_CIDR" -m comment --comment bertserve-cluster -j ACCEPT 2>/dev/null; do :; done
    iptables-save -t nat | sed -n 's/^-A POSTROUTING \(.*CNI-[0-9a-f]*.*\)$/\1/p' | while read -r rule; do
        eval "iptables -t nat -D POSTROUTING $rule" 2>/dev/null
    done
    for chain in $(iptables-save -t nat | sed -n 's/^:\(CNI-[0-9a-f]*\) .*/\1/p'); do
        iptables -t nat -F "$chain" 2>/dev/null
        iptables -t nat -X "$chain" 2>/dev/null
    done
    # The kubelet's own chains (KUBE-FIREWALL, KUBE-MARK-*, the canaries), which kube-proxy's
    # cleanup leaves: the jumps to them from the built-in chains first, then the chains.
    for cmd in iptables ip6tables; do
        for table in filter nat mangle; do
            "$cmd-save" -t "$table" 2>/dev/null | grep -E '^-A [A-Z]+ .*-j KUBE-' | grep -v '^-A KUBE-' |
                while read -r rule; do eval "$cmd -t $table -D ${rule#-A }" 2>/dev/null; done
            for chain in $("$cmd-save" -t "$table" 2>/dev/null | sed -n 's/^:\(KUBE-[A-Z0-9-]*\) .*/\1/p'); do
                "$cmd" -t "$table" -F "$chain" 2>/dev/null
            done
            for chain in $("$cmd-save" -t "$table" 2>/dev/null | sed -n 's/^:\(KUBE-[A-Z0-9-]*\) .*/\1/p'); do
                "$cmd" -t "$table" -X "$chain" 2>/dev/null
            done
        done
    done
    ip link delete "$BRIDGE" 2>/dev/null
    [[ -f $RUN/sysctl.before ]] && while read -r f v; do echo "$v" >"$f"; done <"$RUN/sysctl.before"
    grep " $RUN" /proc/mounts | awk '{print $2}' | sort -r | xargs -r -n1 umount -l 2>/dev/null
    for ns in $(ip netns list 2>/dev/null | awk '/^cni-/{print $1}'); do ip netns delete "$ns"; done
    find /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/kubepods* -depth -type d -exec rmdir {} \; 2>/dev/null
    rm -rf "$RUN"
    log "down: processes stopped; iptables, bridge, mounts, cgroups, sysctls and $RUN as before"
}

case ${1:-} in
up) up ;;
down) down ;;
import) import_image "$2" ;;
env) echo "export KUBECONFIG=$KUBECONFIG PATH=$BIN:\$PATH" ;;
*) echo "usage: cluster.sh up|down|import IMAGE|env" >&2; exit 2 ;;
esac
