"""The parts of `make cluster-test` (tools/cluster/) that run without a cluster: the 1.20
overlay changes only what it says it changes, the custom metrics stand-in reads the shipped
adapter rule as prometheus-adapter does, and the load generator counts what a client sees."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def tool(name: str):
    """A module of tools/cluster/ (not a package), under a name of its own."""
    spec = importlib.util.spec_from_file_location(
        f"cluster_{name}", ROOT / "tools" / "cluster" / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


adapter = tool("adapter")
overlay = tool("overlay")


def test_overlay_changes_only_the_api_versions_and_the_test_nodes_cpu():
    source = overlay.manifests()
    rendered, changes = overlay.render(copy.deepcopy(source))
    kustomization = yaml.safe_load((overlay.K8S / "kustomization.yaml").read_text())
    assert len(source) == len(kustomization["resources"])
    by_kind = {d["kind"]: d for d in rendered}
    assert by_kind["HorizontalPodAutoscaler"]["apiVersion"] == "autoscaling/v2beta2"
    assert by_kind["PodDisruptionBudget"]["apiVersion"] == "policy/v1beta1"
    c = by_kind["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"]["requests"]["cpu"] == "250m" and c["resources"]["limits"]["cpu"] == "300m"
    assert {e["name"]: e.get("value") for e in c["env"]}["BERTSERVE_WORKERS"] == "1"
    # the memory the manifest asks for is kept
    src = next(d for d in source if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert (
        c["resources"]["requests"]["memory"]
        == src["containers"][0]["resources"]["requests"]["memory"]
    )
    # every other document, and every other field, as shipped
    for before, after in zip(source, rendered, strict=True):
        if before["kind"] in ("HorizontalPodAutoscaler", "PodDisruptionBudget"):
            assert {**after, "apiVersion": before["apiVersion"]} == before
        elif before["kind"] != "Deployment":
            assert after == before
    assert len(changes) == 3 and all("->" in line or "cpu" in line for line in changes)


def shipped_rule() -> adapter.Rule:
    cm = yaml.safe_load((ROOT / "docker" / "k8s" / "prometheus-adapter.yaml").read_text())
    (rule,) = yaml.safe_load(cm["data"]["config.yaml"])["rules"]
    return adapter.Rule(rule)


def test_the_adapter_serves_the_hpas_metric_from_the_shipped_rule():
    rule = shipped_rule()
    hpa = yaml.safe_load((ROOT / "docker" / "k8s" / "hpa.yaml").read_text())
    (metric,) = hpa["spec"]["metrics"]
    assert rule.metric == metric["pods"]["metric"]["name"] == "bertserve_queue_depth"
    assert rule.series == "bertserve_queue_depth"
    assert rule.label_for == {"namespace": "namespace", "pod": "pod"}
    # the adapter's template, filled its way: one series per pod, the pods asked for
    assert rule.query("default", ["bertserve-a-1", "bertserve-b-2"]) == (
        'sum(bertserve_queue_depth{namespace="default",pod=~"bertserve-a-1|bertserve-b-2"})'
        " by (pod)"
    )


def test_a_rule_under_another_name_does_not_serve_the_hpas_metric():
    rule = adapter.Rule(
        {
            "seriesQuery": 'bertserve_queue_depth{namespace!="",pod!=""}',
            "name": {"matches": "^bertserve_(.*)$", "as": "${1}_per_pod"},
            "resources": {
                "overrides": {
                    "kubernetes_namespace": {"resource": "namespace"},
                    "kubernetes_pod": {"resource": "pod"},
                }
            },
            "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)",
        }
    )
    assert rule.metric == "queue_depth_per_pod"  # the adapter's ${1}, filled
    assert 'kubernetes_pod=~"p"' in rule.query("ns", ["p"])


class Flaky(BaseHTTPRequestHandler):
    """Answers 200, then 503 with Retry-After, then 503 without, then drops the connection."""

    protocol_version = "HTTP/1.1"
    count = 0

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        n = Flaky.count
        Flaky.count += 1
        if n % 4 == 3:
            self.close_connection = True
            self.connection.close()
            return
        self.send_response(200 if n % 4 == 0 else 503)
        if n % 4 == 1:
            self.send_header("Retry-After", "1")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")


def test_the_load_generator_tells_a_refusal_from_a_failure():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = dict(os.environ, TARGET=f"127.0.0.1:{server.server_port}", CONCURRENCY="1", DURATION="1")
    started = time.time()
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "cluster" / "load.py")],
        env=env, capture_output=True, text=True, timeout=30,
    ).stdout  # fmt: skip
    server.shutdown()
    lines = out.splitlines()
    assert lines[-1] == json.dumps({"done": True})
    records = [json.loads(line) for line in lines[:-1]]
    outcomes = [r[2] for r in records]
    assert outcomes[:4] == [200, "503ra", 503, "conn"]
    assert set(outcomes) == {200, "503ra", 503, "conn"}
    assert all(started - 1 <= r[0] <= time.time() for r in records)
    # a request after the first on a connection is marked reused; after a drop, a new one is not
    assert records[1][3] is True and records[4][3] is False
