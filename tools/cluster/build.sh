#!/usr/bin/env bash
# Builds Kubernetes 1.20 from Debian's source package into a cache outside the repository
# (BERTSERVE_CLUSTER_CACHE, default /var/cache/bertserve-cluster), once: about 4 minutes of
# two cores here, 410 MB of binaries. Later runs find the binaries and return at once.
#
# No ready-made Kubernetes installs from the registries this machine reaches (Debian, PyPI, npm),
# but Debian's source package `kubernetes` carries its vendor/ tree, so Debian's golang-go builds
# it without a network, in GOPATH mode. The one generated file the source package lacks
# (pkg/generated/openapi) is generated first with the vendored openapi-gen.
set -euo pipefail

CACHE=${BERTSERVE_CLUSTER_CACHE:-/var/cache/bertserve-cluster}
BIN=$CACHE/bin
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl)
# Binaries built by another version of these steps are built again.
RECIPE="1.20.2 reflect2-1.0.2 openapi-vendor"

have_all() {
    [[ $(cat "$BIN/.recipe" 2>/dev/null) == "$RECIPE" ]] || return 1
    for b in "${BINARIES[@]}"; do [[ -x $BIN/$b ]] || return 1; done
}
if have_all; then
    echo "build: Kubernetes binaries cached in $BIN"
    exit 0
fi

need_root() { [[ $(id -u) -eq 0 ]] || { echo "build: run as root (apt-get, /var/cache)" >&2; exit 1; }; }
need_root

export DEBIAN_FRONTEND=noninteractive
SOURCES=/etc/apt/sources.list.d/bertserve-cluster-src.sources
# The deb-src line is only for the download: apt is left as it was, whatever happens.
trap '[[ -f $SOURCES ]] && rm -f "$SOURCES" && apt-get update -qq' EXIT
if ! apt-cache showsrc kubernetes 2>/dev/null | grep -q '^Package: kubernetes'; then
    . /etc/os-release
    cat > "$SOURCES" <<SRC
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: $VERSION_CODENAME
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
    apt-get update -qq
fi
apt-get install -y -qq --no-install-recommends golang-go dpkg-dev \
    golang-github-modern-go-reflect2-dev >/dev/null

SRC=$CACHE/src
mkdir -p "$SRC" "$BIN"
cd "$SRC"
if [[ ! -d k8s ]]; then
    ls kubernetes_*.dsc >/dev/null 2>&1 || apt-get source --download-only kubernetes 2>&1 | tail -1
    dpkg-source -x --no-check kubernetes_*.dsc k8s >/dev/null
fi

export GOPATH=$CACHE/gopath GO111MODULE=off CGO_ENABLED=0 GOFLAGS=
export GOCACHE=$CACHE/gocache
mkdir -p "$GOPATH/src/k8s.io"
ln -sfn "$SRC/k8s" "$GOPATH/src/k8s.io/kubernetes"
cd "$GOPATH/src/k8s.io/kubernetes"

# The vendored reflect2 1.0.1 reads Go's map internals as they were before Go 1.18: built with
# Debian's Go 1.19, every JSON encoding of a map dies in mapiternext. Debian's own reflect2
# (1.0.2, the fix) replaces it; json-iterator's calls into it are unchanged.
if [[ ! -f vendor/github.com/modern-go/reflect2/go_above_118.go ]]; then
    rm -rf vendor/github.com/modern-go/reflect2
    cp -r /usr/share/gocode/src/github.com/modern-go/reflect2 vendor/github.com/modern-go/reflect2
fi
[[ $(cat "$BIN/.recipe" 2>/dev/null) == "$RECIPE" ]] || rm -f "$BIN"/kube* "$BIN/.recipe"

OPENAPI=pkg/generated/openapi/zz_generated.openapi.go
if [[ ! -f $OPENAPI || ! -f $BIN/.recipe ]]; then
    echo "build: generating $OPENAPI"
    go build -o "$CACHE/openapi-gen" ./vendor/k8s.io/kube-openapi/cmd/openapi-gen
    # The packages that ask for OpenAPI definitions, as Makefile.generated_files finds them.
    dirs=$( (grep -Rl --include='*.go' '+k8s:openapi-gen=' pkg vendor/k8s.io/ 2>/dev/null || true) \
        | grep -v -e '^vendor/k8s.io/code-generator/' -e '^vendor/k8s.io/sample-apiserver/' \
            -e '_test.go$' -e '/testdata/' \
        | xargs -n1 dirname | LC_ALL=C sort -u | sed 's|^|k8s.io/kubernetes/|' | paste -sd,)
    "$CACHE/openapi-gen" -i "$dirs" -p k8s.io/kubernetes/pkg/generated/openapi \
        -O zz_generated.openapi -h vendor/k8s.io/code-generator/hack/boilerplate.go.txt \
        -r /dev/null
fi

version_flags="-X k8s.io/component-base/version.gitVersion=v1.20.2 \
 -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=20 \
 -X k8s.io/client-go/pkg/version.gitVersion=v1.20.2"
for b in "${BINARIES[@]}"; do
    [[ -x $BIN/$b ]] && continue
    echo "build: $b"
    go build -p "${BUILD_JOBS:-2}" -o "$BIN/$b.tmp" \
        -ldflags "-s -w $(echo $version_flags | sed 's|k8s.io/|k8s.io/kubernetes/vendor/k8s.io/|g')" \
        "./cmd/$b"
    mv "$BIN/$b.tmp" "$BIN/$b"
done
echo "$RECIPE" >"$BIN/.recipe"
du -sh "$BIN"
