#!/usr/bin/env bash
# The images the cluster runs, made here and imported into its containerd (no registry is
# reachable): the pause image (pause.c, static, FROM scratch), bertserve:cpu as
# docker/Dockerfile.cpu builds it (tools/image-lib.sh), and a second tag of it, bertserve:cpu-b,
# for the rolling update. It needs a running engine and the Debian base image (cluster-test.sh
# makes both).
set -euo pipefail
cd "$(dirname "$0")/../.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
skip() { echo "images: $*" >&2; exit 1; }
PREFIX="images: "
# shellcheck source=tools/image-lib.sh
. tools/image-lib.sh
docker info >/dev/null 2>&1 || skip "no container engine answers"
build_cpu_image bertserve:cpu
# The rolling update's "new image": the same build with a label of its own, so its image id
# differs as a new release's would.
printf 'FROM bertserve:cpu\nLABEL org.bertserve.release=b\n' | docker build -q -t bertserve:cpu-b - >/dev/null 2>&1

gcc -static -Os -o "$work/pause" tools/cluster/pause.c
printf 'FROM scratch\nCOPY pause /pause\nENTRYPOINT ["/pause"]\n' >"$work/Dockerfile"
docker build -q -t bertserve.local/pause:1 "$work" >/dev/null 2>&1
for image in bertserve.local/pause:1 bertserve:cpu bertserve:cpu-b; do
    tools/cluster/cluster.sh import "$image"
    say "$image imported"
done
