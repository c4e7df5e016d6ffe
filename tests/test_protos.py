"""The committed gRPC modules are what tools/protos.sh generates from service/grpc/protos/."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ROOT / "service" / "grpc"


def test_the_generated_grpc_modules_are_current(tmp_path):
    subprocess.run(
        ["bash", str(ROOT / "tools" / "protos.sh"), sys.executable],
        env={**os.environ, "PROTOS_OUT": str(tmp_path)},
        check=True,
        timeout=120,
    )
    fresh = sorted(p.name for p in tmp_path.iterdir())
    assert fresh == sorted(p.name for p in GENERATED.glob("*_pb2*"))
    for name in fresh:
        assert (tmp_path / name).read_text() == (GENERATED / name).read_text(), (
            f"service/grpc/{name} is stale: run `bash tools/protos.sh`"
        )
