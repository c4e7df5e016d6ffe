#!/usr/bin/env bash
# Generate the gRPC modules (service/grpc/*_pb2.py, *_pb2_grpc.py) from service/grpc/protos/
# with grpcio-tools (the dev extra): `bash tools/protos.sh [PYTHON]`. The generated modules are
# committed; tests/test_protos.py fails when they differ from a fresh generation.
set -euo pipefail
given=${1:-.venv/bin/python}
python=$(cd "$(dirname "$given")" && pwd)/$(basename "$given")
root=$(cd "$(dirname "$0")/.." && pwd)
out=${PROTOS_OUT:-$root/service/grpc}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Compiled as bertserve/service/grpc/NAME.proto, so the generated modules import each other by
# their package path.
mkdir -p "$work/bertserve/service/grpc"
cp "$root"/service/grpc/protos/*.proto "$work/bertserve/service/grpc/"
(cd "$work" && "$python" -m grpc_tools.protoc -I . --python_out=. --pyi_out=. \
    --grpc_python_out=. bertserve/service/grpc/*.proto)
cp "$work"/bertserve/service/grpc/*_pb2*.py* "$out/"
