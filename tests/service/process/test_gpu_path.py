"""The GPU path, checked on a CPU: an ONNX Runtime that offers CUDA but cannot use it (faked by
its provider list, as on a CUDA build without a driver) falls back loudly, never silently;
BERTSERVE_REQUIRE_GPU refuses in one line; repeated model failures make the process report
itself dead; an fp16 bundle on the CPU is warned about; the gpu extra's pin matches the CUDA
base image."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import onnxruntime
import pytest

from bertserve.runtime.bundle import load_bundle_spec
from bertserve.runtime.engine import Engine, EngineError, EngineOptions
from tests.helpers.server import live_server
from tests.service.test_behaviour import wrap

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def cuda_offered(monkeypatch):
    """ONNX Runtime says it has CUDA; building a CUDA session then fails (no CUDA here)."""
    monkeypatch.setattr(
        onnxruntime,
        "get_available_providers",
        lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"],
    )


def test_fallback_to_cpu_is_a_warning_naming_both_and_the_reason(bundle_dir, cuda_offered, caplog):
    bundle = bundle_dir / "sentiment"
    with caplog.at_level(logging.INFO):
        engine = Engine(bundle, load_bundle_spec(bundle), EngineOptions(providers="auto"))
    assert (engine.requested, engine.provider) == ("CUDAExecutionProvider", "CPUExecutionProvider")
    (fallback,) = [
        r for r in caplog.records if getattr(r, "fields", {}).get("message") == "provider fallback"
    ]
    assert fallback.levelno == logging.WARNING
    assert fallback.fields["requested"] == "CUDAExecutionProvider"
    assert fallback.fields["in_use"] == "CPUExecutionProvider"
    assert "CUDA" in fallback.fields["reason"]
    # ONNX Runtime's own lines came through the logging system, not raw stderr.
    assert [r for r in caplog.records if r.name == "onnxruntime" and "CUDA" in r.getMessage()]


def test_require_gpu_fails_in_one_line_that_says_why(bundle_dir, cuda_offered):
    bundle = bundle_dir / "sentiment"
    with pytest.raises(EngineError) as error:
        Engine(bundle, load_bundle_spec(bundle), EngineOptions(require_gpu=True))
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(
        "BERTSERVE_REQUIRE_GPU is set but sentiment runs on CPUExecutionProvider: "
    )
    assert "CUDA" in message.split(": ", 1)[1]


def test_require_gpu_without_a_cuda_build_is_a_one_line_start_up_error(bundle_dir):
    done = subprocess.run(
        [sys.executable, "-m", "bertserve.service", "--bundles", str(bundle_dir)],
        env={"BERTSERVE_REQUIRE_GPU": "true", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith("error: BERTSERVE_REQUIRE_GPU is set but this ONNX Runtime build")


def test_readiness_and_models_name_the_provider_in_use(bundle_dir, cuda_offered):
    with live_server(bundles=bundle_dir, providers="auto") as live, live.client() as c:
        ready = c.get("/health/ready").json()
        models = c.get("/models").json()
    assert ready == {"status": "ready", "providers": ["CPUExecutionProvider"]}
    assert {m["provider"] for m in models} == {"CPUExecutionProvider"}
    assert {m["requested_provider"] for m in models} == {"CUDAExecutionProvider"}


def test_repeated_model_failures_fail_liveness_and_readiness(bundle_dir):
    """A CUDA error leaves the context unusable: after N failed calls in a row the process
    says it is dead, so the orchestrator stops routing to it and restarts it."""
    with live_server(bundles=bundle_dir, failed_batches_fatal=3) as live, live.client() as c:
        wrap(live, "sentiment", fail_calls={1, 2, 3})
        for _ in range(2):
            assert c.post("/classify", json={"inputs": "x"}).status_code == 500
        assert c.get("/health/live").status_code == 200  # two in a row: not yet
        assert c.post("/classify", json={"inputs": "x"}).status_code == 500
        live_response, ready = c.get("/health/live"), c.get("/health/ready")
        assert live_response.status_code == 503 and ready.status_code == 503
        assert "model sentiment failed 3 calls in a row" in live_response.json()["error"]
        metrics = c.get("/metrics").text
    assert 'bertserve_failed_batches_total{model="sentiment"} 3.0' in metrics


def test_fp16_bundle_on_cpu_is_warned_about(checkpoints, tmp_path, caplog):
    from bertserve.export.bundle import build_bundle

    build_bundle(
        checkpoints["BertForSequenceClassification"],
        ["classify"],
        tmp_path / "half",
        "fp16",
        force=True,
    )
    with caplog.at_level(logging.WARNING):
        Engine(
            tmp_path / "half",
            load_bundle_spec(tmp_path / "half"),
            EngineOptions("CPUExecutionProvider"),
        )
    assert any("fp16 bundle on the CPU" in r.getMessage() for r in caplog.records)


# onnxruntime-gpu minor versions and the CUDA major they are built for (ORT's install matrix).
ORT_CUDA = {range(19, 27): 12, range(27, 100): 13}


def test_gpu_pin_matches_the_cuda_image():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    pins = {
        name: re.search(r"onnxruntime-gpu(?:\[[^\]]*\])?==1\.(\d+)\.\d+", " ".join(deps))
        for name, deps in extras.items()
        if any("onnxruntime-gpu" in d for d in deps)
    }
    assert set(pins) == {"gpu", "gpu-wheels"} and all(pins.values())
    minors = {int(m.group(1)) for m in pins.values() if m}
    assert len(minors) == 1, "one onnxruntime-gpu for both GPU installs"
    (minor,) = minors
    cuda = next(major for versions, major in ORT_CUDA.items() if minor in versions)
    base = re.search(
        r"FROM nvidia/cuda:(\d+)\.\d+\.\d+-cudnn-runtime",
        (ROOT / "docker" / "Dockerfile").read_text(),
    )
    assert base is not None and int(base.group(1)) == cuda
    assert minor != 22, "1.22.0 segfaults loading the CUDA provider without a driver"


def test_the_cuda_settings_reach_the_provider_options(tmp_path, monkeypatch):
    """BERTSERVE_DEVICE_ID and the other CUDA settings are what the CUDA provider is given (they
    were documented but dropped on the way)."""
    from bertserve.service.settings import Settings

    for name, value in {
        "DEVICE_ID": "3",
        "GPU_MEM_LIMIT": "2000000000",
        "ARENA_EXTEND_STRATEGY": "kSameAsRequested",
        "CUDNN_CONV_ALGO_SEARCH": "HEURISTIC",
        "USE_TF32": "true",
        "INTRA_OP_THREADS": "3",
        "INTRA_OP_SPINNING": "true",
        "INTRA_OP_SPIN_STOP": "true",
    }.items():
        monkeypatch.setenv(f"BERTSERVE_{name}", value)
    options = Settings(bundles=tmp_path).engine_options()
    assert options.cuda_options() == {
        "device_id": 3,
        "gpu_mem_limit": 2000000000,
        "arena_extend_strategy": "kSameAsRequested",
        "cudnn_conv_algo_search": "HEURISTIC",
        "use_tf32": 1,
    }
    assert (options.threads, options.spinning, options.spin_stop) == (3, True, True)


def test_the_cores_are_the_containers_not_the_hosts(tmp_path, monkeypatch):
    """A container's CPU quota caps the default worker count (os.cpu_count() is the host's)."""
    from bertserve.service.settings import Settings, available_cores

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)))
    (tmp_path / "cpu.max").write_text("200000 100000\n")  # cgroup v2: 2 CPUs
    assert available_cores(tmp_path) == 2
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs: rounded up
    assert available_cores(tmp_path) == 2
    (tmp_path / "cpu.max").write_text("max 100000\n")  # no quota: the affinity
    assert available_cores(tmp_path) == 64
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()  # cgroup v1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("400000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert available_cores(tmp_path) == 4
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")  # v1: no quota
    assert available_cores(tmp_path) == 64
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2})  # taskset / cpuset
    assert available_cores(tmp_path) == 3

    monkeypatch.setattr("bertserve.service.settings.available_cores", lambda cgroup=None: 4)
    settings = Settings(bundles=tmp_path)
    assert (settings.worker_count, settings.threads) == (4, 1)
    assert settings.engine_options(device=True).threads == 4
    # A lone request gets every worker's threads by default (every core, here), never more
    # than the workers were given; the engine process's calls never run alone.
    assert settings.engine_options().lone_threads == 4
    monkeypatch.setenv("BERTSERVE_WORKERS", "2")
    assert Settings(bundles=tmp_path).engine_options().lone_threads == 4  # 2 workers x 2
    monkeypatch.setenv("BERTSERVE_INTRA_OP_THREADS", "1")
    assert Settings(bundles=tmp_path).engine_options().lone_threads == 2  # 2 workers x 1
    assert settings.engine_options(device=True).lone_threads == 0
    monkeypatch.delenv("BERTSERVE_WORKERS")
    monkeypatch.setenv("BERTSERVE_LONE_THREADS", "1")
    assert Settings(bundles=tmp_path).engine_options().lone_threads == 1  # off: 1 thread
