"""Deployment files checked by every means that runs without a Docker engine or a cluster:
the real validators (docker-compose config, hadolint, kubernetes-validate) and cross-checks of
the files against the code (metric names scraped from a running service, probe paths, ports,
settings, the install command)."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bertserve.service.settings import Settings
from tests.helpers.server import live_server

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "docker" / "k8s"
DOCKERFILES = {"gpu": ROOT / "docker" / "Dockerfile", "cpu": ROOT / "docker" / "Dockerfile.cpu"}
COMPOSE = [ROOT / "docker-compose.yml", ROOT / "docker-compose.gpu.yml"]
PLAIN_MANIFESTS = [
    "deployment.yaml",
    "service.yaml",
    "pdb.yaml",
    "hpa.yaml",
    "prometheus-adapter.yaml",
    "networkpolicy.yaml",
]


PIP_TOOLS = ("hadolint", "kubernetes-validate")  # the dev extra brings them: never skipped


def tool(name: str) -> str:
    """A validator: next to this Python (pip-installed) or on PATH. The dev extra's are always
    there (missing is a failure); docker-compose comes from apt: .ci/run installs it and sets
    CI, where missing is a failure too, and a developer without it gets a skip."""
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if found is None:
        if name in PIP_TOOLS or os.environ.get("CI"):
            pytest.fail(f"{name} is not installed")
        pytest.skip(f"{name} is not installed (apt-get install {name})")
    return found


def run(*args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "GRAFANA_ADMIN_PASSWORD": "a-test-password"} | env
    return subprocess.run(
        args, capture_output=True, text=True, cwd=ROOT, timeout=120, env=environment
    )


def deployment() -> dict:
    return yaml.safe_load((K8S / "deployment.yaml").read_text())


def container(manifest: dict) -> dict:
    return manifest["spec"]["template"]["spec"]["containers"][0]


# --- the validators -----------------------------------------------------------------------------


@pytest.mark.parametrize("files", [COMPOSE[:1], COMPOSE], ids=["cpu", "gpu"])
def test_compose_files_validate_offline(files):
    args = [a for f in files for a in ("-f", str(f))]
    done = run(tool("docker-compose"), *args, "config", "-q")
    assert done.returncode == 0, done.stderr


def test_gpu_override_reserves_a_gpu_and_cpu_stack_does_not():
    cpu = yaml.safe_load(run(tool("docker-compose"), "-f", str(COMPOSE[0]), "config").stdout)
    args = [a for f in COMPOSE for a in ("-f", str(f))]
    gpu = yaml.safe_load(run(tool("docker-compose"), *args, "config").stdout)
    assert "deploy" not in cpu["services"]["bertserve"]
    devices = gpu["services"]["bertserve"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"capabilities": ["gpu"], "count": 1, "driver": "nvidia"}]
    assert gpu["services"]["bertserve"]["build"]["dockerfile"] == "docker/Dockerfile"
    for stack in (cpu, gpu):
        services = stack["services"]
        assert services["prometheus"]["depends_on"]["bertserve"]["condition"] == "service_healthy"
        assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"
        assert all("healthcheck" in services[s] for s in ("bertserve", "prometheus"))


@pytest.mark.parametrize("kind", ["gpu", "cpu"])
def test_dockerfiles_pass_hadolint(kind):
    done = run(tool("hadolint"), str(DOCKERFILES[kind]))
    assert done.returncode == 0, done.stdout + done.stderr


def test_plain_manifests_validate_against_kubernetes_schemas(tmp_path):
    validate = tool("kubernetes-validate")
    done = run(validate, "--strict", "--quiet", *(str(K8S / m) for m in PLAIN_MANIFESTS))
    assert done.returncode == 0, done.stdout + done.stderr
    # The GPU overlay is a strategic-merge patch: apply it as kustomize would, then validate.
    merged = tmp_path / "deployment-gpu.yaml"
    merged.write_text(yaml.safe_dump(gpu_deployment()))
    done = run(validate, "--strict", "--quiet", str(merged))
    assert done.returncode == 0, done.stdout + done.stderr


def gpu_deployment() -> dict:
    base = deployment()
    patch = yaml.safe_load((K8S / "gpu" / "deployment-gpu.yaml").read_text())
    merged = copy.deepcopy(base)
    target, update = container(merged), container(patch)
    assert update["name"] == target["name"]
    target["image"] = update["image"]
    env = {e["name"]: e for e in target["env"]} | {e["name"]: e for e in update["env"]}
    target["env"] = list(env.values())
    for key in ("requests", "limits"):
        target["resources"][key] = target["resources"].get(key, {}) | update["resources"][key]
    return merged


def test_kustomizations_list_every_manifest():
    base = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(base["resources"]) == sorted([*PLAIN_MANIFESTS, "servicemonitor.yaml"])
    gpu = yaml.safe_load((K8S / "gpu" / "kustomization.yaml").read_text())
    assert gpu["resources"] == [".."] and gpu["patches"] == [{"path": "deployment-gpu.yaml"}]
    assert container(gpu_deployment())["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_custom_resources_are_well_formed():
    monitor = yaml.safe_load((K8S / "servicemonitor.yaml").read_text())
    service = yaml.safe_load((K8S / "service.yaml").read_text())
    assert (
        monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "ServiceMonitor"
    )
    assert monitor["spec"]["selector"]["matchLabels"] == service["metadata"]["labels"]
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"

    adapter = yaml.safe_load(
        yaml.safe_load((K8S / "prometheus-adapter.yaml").read_text())["data"]["config.yaml"]
    )
    [rule] = adapter["rules"]
    assert set(rule) == {"seriesQuery", "resources", "name", "metricsQuery"}
    assert rule["resources"]["overrides"] == {
        "namespace": {"resource": "namespace"},
        "pod": {"resource": "pod"},
    }
    hpa = yaml.safe_load((K8S / "hpa.yaml").read_text())
    [metric] = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"]
    assert re.match(rule["name"]["matches"], metric["pods"]["metric"]["name"])


# --- the files against the code -----------------------------------------------------------------


def metric_names_used() -> set[str]:
    texts = [
        (ROOT / "docker/grafana/dashboards/bertserve.json").read_text(),
        (K8S / "hpa.yaml").read_text(),
        (K8S / "prometheus-adapter.yaml").read_text(),
    ]
    return {name for text in texts for name in re.findall(r"\bbertserve_[a-z_]+", text)}


def test_every_metric_the_dashboard_and_hpa_use_is_exported(bundle_dir):
    with live_server(bundles=bundle_dir) as live, live.client() as c:
        c.post("/classify", json={"inputs": "warm the histograms"})
        exported = set(re.findall(r"^(bertserve_[a-z_]+)", c.get("/metrics").text, re.M))
    # The engine process's own metrics are checked against its scrape in test_device.py.
    used = {name for name in metric_names_used() if not name.startswith("bertserve_engine_")}
    assert {"bertserve_queue_depth", "bertserve_requests_total"} <= used
    assert used <= exported, sorted(used - exported)


def test_dashboard_is_provisioned_and_has_the_panels():
    dashboard = json.loads((ROOT / "docker/grafana/dashboards/bertserve.json").read_text())
    titles = " | ".join(p["title"] for p in dashboard["panels"]).lower()
    for needed in (
        "request rate",
        "latency percentiles",
        "queue depth",
        "batch size",
        "padding ratio",
        "errors by type",
        "in-flight",
        "engine process",
    ):
        assert needed in titles, needed
    provider = yaml.safe_load(
        (ROOT / "docker/grafana/provisioning/dashboards/bertserve.yml").read_text()
    )
    compose = yaml.safe_load(COMPOSE[0].read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert f"./docker/grafana/dashboards:{provider['providers'][0]['options']['path']}:ro" in mounts
    source = yaml.safe_load(
        (ROOT / "docker/grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"][0]
    assert all(p["datasource"]["uid"] == source["uid"] for p in dashboard["panels"])
    scrape = yaml.safe_load((ROOT / "docker/prometheus/prometheus.yml").read_text())
    assert scrape["scrape_configs"][0]["static_configs"][0]["targets"] == ["bertserve:8000"]


def test_probes_and_ports_match_the_service():
    from bertserve.service.http.app import create_app  # noqa: F401  (routes are registered on import)
    from bertserve.service.http.routes import ops

    routes = {r.path for r in ops.routes}
    spec = container(deployment())
    port = Settings.model_fields["port"].default
    assert spec["ports"][0]["containerPort"] == port
    assert spec["readinessProbe"]["httpGet"]["path"] == "/health/ready" in routes
    assert spec["livenessProbe"]["httpGet"]["path"] == "/health/live" in routes
    assert spec["startupProbe"]["httpGet"]["path"] in routes
    annotations = deployment()["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port)
    assert annotations["prometheus.io/path"] == "/metrics" in routes
    for text in [f.read_text() for f in DOCKERFILES.values()] + [COMPOSE[0].read_text()]:
        assert f"http://127.0.0.1:{port}/health/ready" in text
        assert "8000" in text
    for dockerfile in DOCKERFILES.values():
        assert (
            'ENTRYPOINT ["python", "-m", "bertserve.service"]' in dockerfile.read_text()
        )  # exec form


def test_grace_periods_outlast_the_drain():
    spec = deployment()["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in container(deployment())["env"]}
    drain = float(env["BERTSERVE_DRAIN_TIMEOUT_S"])
    pre_stop = float(container(deployment())["lifecycle"]["preStop"]["exec"]["command"][1])
    assert spec["terminationGracePeriodSeconds"] > drain + pre_stop
    compose = yaml.safe_load(COMPOSE[0].read_text())["services"]["bertserve"]
    grace = int(compose["stop_grace_period"].rstrip("s"))
    assert grace > float(compose["environment"]["BERTSERVE_DRAIN_TIMEOUT_S"])


def test_every_bertserve_variable_is_a_real_setting():
    settings = {f"BERTSERVE_{name.upper()}" for name in Settings.model_fields}
    files = [*DOCKERFILES.values(), *COMPOSE, *K8S.rglob("*.yaml")]
    used = {v for f in files for v in re.findall(r"\bBERTSERVE_[A-Z_]+\b", f.read_text())}
    assert used, "no settings found: the pattern is broken"
    assert used <= settings, sorted(used - settings)


def test_install_command_is_one_path():
    """The Dockerfiles install exactly as the README tells users to, and CI runs that install."""
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    for extra, dockerfile in DOCKERFILES.items():
        command = f'pip install -c constraints.txt ".[{extra}]"'
        assert f"RUN {command}" in dockerfile.read_text()
        assert command in readme, f"README lacks {command}"
    assert 'pip" install -c constraints.txt ".[cpu]"' in ci  # the same, in a venv per Python


def test_compose_is_hardened_and_private_by_default():
    stack = yaml.safe_load(run(tool("docker-compose"), "-f", str(COMPOSE[0]), "config").stdout)
    services = stack["services"]
    server = services["bertserve"]
    assert server["read_only"] is True and server["cap_drop"] == ["ALL"]
    assert server["tmpfs"] == ["/tmp"]  # read-only root, but the workers' metrics files
    assert "no-new-privileges:true" in server["security_opt"]
    for service in services.values():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), port
    grafana = services["grafana"]["environment"]
    assert grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert grafana["GF_SECURITY_ADMIN_PASSWORD"] == "a-test-password"
    # No password given: compose refuses, and says what to set.
    env = {k: v for k, v in os.environ.items() if k != "GRAFANA_ADMIN_PASSWORD"}
    refused = subprocess.run(
        [tool("docker-compose"), "-f", str(COMPOSE[0]), "config", "-q"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        check=False,
    )
    assert refused.returncode != 0 and "GRAFANA_ADMIN_PASSWORD" in refused.stderr


def test_kubernetes_pod_is_locked_down_and_keyed():
    spec = deployment()["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is False
    # A read-only root, and /tmp writable for the workers' shared metrics files.
    assert container(deployment())["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "tmp", "mountPath": "/tmp"} in container(deployment())["volumeMounts"]
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    keys = next(e for e in container(deployment())["env"] if e["name"] == "BERTSERVE_API_KEYS")
    assert keys["valueFrom"]["secretKeyRef"]["name"] == "bertserve-api-keys"
    policy = yaml.safe_load((K8S / "networkpolicy.yaml").read_text())
    assert policy["spec"]["podSelector"] == deployment()["spec"]["selector"]
    assert policy["spec"]["egress"] == [] and set(policy["spec"]["policyTypes"]) == {
        "Ingress",
        "Egress",
    }


def test_pods_size_their_workers_and_gpu_pods_run_one_engine_process():
    """A pod without a CPU limit has no quota to read: its workers (and their threads, which
    size a lone request's session) are set to its CPU request, not left to the node's cores.
    On a GPU the workers feed one engine process (one CUDA context); the compose GPU stack
    does the same."""
    cpu = container(deployment())
    env = {e["name"]: e.get("value") for e in cpu["env"]}
    assert env["BERTSERVE_WORKERS"] == cpu["resources"]["requests"]["cpu"]
    # A lone request's session has workers x threads: the CPU request, not the node's cores.
    requested = int(cpu["resources"]["requests"]["cpu"])
    assert int(env["BERTSERVE_WORKERS"]) * int(env["BERTSERVE_INTRA_OP_THREADS"]) == requested
    gpu = {e["name"]: e.get("value") for e in container(gpu_deployment())["env"]}
    assert gpu["BERTSERVE_ENGINE_PROCESS"] == "true" and gpu["BERTSERVE_WORKERS"] == "2"
    args = [a for f in COMPOSE for a in ("-f", str(f))]
    stack = yaml.safe_load(run(tool("docker-compose"), *args, "config").stdout)
    assert stack["services"]["bertserve"]["environment"]["BERTSERVE_ENGINE_PROCESS"] == "true"


def test_the_kserve_runtime_and_inference_service_build_and_match_the_deployment():
    """docker/k8s/kserve: `kubectl kustomize` builds the ServingRuntime and the InferenceService
    (KServe's CRDs, which kubernetes-validate has no schema for, so checked here): each serves the
    v2 protocol from the Deployment's image and resources, probes the v2 health routes on the
    port it declares, and turns gRPC on."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl")
    built = run(kubectl, "kustomize", str(K8S / "kserve"))
    assert built.returncode == 0, built.stderr
    docs = {d["kind"]: d for d in yaml.safe_load_all(built.stdout) if d}
    assert set(docs) == {"ServingRuntime", "InferenceService"}
    runtime, service = docs["ServingRuntime"], docs["InferenceService"]
    assert runtime["apiVersion"] == "serving.kserve.io/v1alpha1"
    assert service["apiVersion"] == "serving.kserve.io/v1beta1"
    assert {"v2", "grpc-v2"} <= set(runtime["spec"]["protocolVersions"])
    ours = container(deployment())
    for pod in (runtime["spec"], service["spec"]["predictor"]):
        (box,) = pod["containers"]
        env = {e["name"]: e.get("value") for e in box["env"]}
        settings = {k.removeprefix("BERTSERVE_").lower(): v for k, v in env.items()}
        Settings(**settings | {"bundles": str(ROOT / "bundles")})  # valid settings
        assert box["image"] == ours["image"]
        assert box["resources"] == ours["resources"]
        assert [p["containerPort"] for p in box["ports"]] == [int(env["BERTSERVE_PORT"])]
        assert env["BERTSERVE_GRPC_PORT"] and env["BERTSERVE_HOST"] == "0.0.0.0"
        assert box["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": 8080}
        assert box["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert dict(runtime["spec"]["containers"][0]["env"][0]) == {
        "name": "BERTSERVE_BUNDLES",
        "value": "/mnt/models",  # where KServe's storage initializer puts the storageUri
    }
