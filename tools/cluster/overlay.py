"""The manifests of docker/k8s as `make cluster-test` applies them: each file of the
kustomization, unchanged but for the differences below, each of which is printed with the
rendering so the run's report lists them.

Kubernetes 1.20 (the cluster this machine can build) predates two API versions the manifests
use for current clusters:
- HorizontalPodAutoscaler autoscaling/v2 -> autoscaling/v2beta2 (the same fields);
- PodDisruptionBudget policy/v1 -> policy/v1beta1 (the same fields).

The test node is one 2-core machine, where the manifests size a pod for a node of its own:
- cpu: request 250m and limit 300m a pod, one worker (BERTSERVE_WORKERS=1), so that a
  replica's capacity is bounded as a node's would be and the replicas the autoscaler adds bring
  capacity the machine has: without a limit two pods take both cores and a third adds nothing
  (with 600m, two replicas and the load generators already filled the machine, and the load's
  p99 over the rest of the surge rose after a third came: 129 -> 150 ms).

    python tools/cluster/overlay.py > manifests.json      # kubectl apply -f manifests.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "docker" / "k8s"

API_1_20 = {
    ("HorizontalPodAutoscaler", "autoscaling/v2"): "autoscaling/v2beta2",
    ("PodDisruptionBudget", "policy/v1"): "policy/v1beta1",
}
TEST_NODE_CPU = {"requests": "250m", "limits": "300m"}
TEST_NODE_ENV = {"BERTSERVE_WORKERS": "1"}


def manifests() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    docs: list[dict[str, Any]] = []
    for name in kustomization["resources"]:
        docs.extend(d for d in yaml.safe_load_all((K8S / name).read_text()) if d)
    return docs


def render(docs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The documents for the test cluster, and one line per difference made."""
    changes: list[str] = []
    for doc in docs:
        kind, name = doc["kind"], doc["metadata"]["name"]
        old = API_1_20.get((kind, doc["apiVersion"]))
        if old:
            changes.append(
                f"{kind}/{name}: apiVersion {doc['apiVersion']} -> {old} (Kubernetes 1.20)"
            )
            doc["apiVersion"] = old
        if kind == "Deployment":
            for c in doc["spec"]["template"]["spec"]["containers"]:
                res = c.setdefault("resources", {})
                res.setdefault("requests", {})["cpu"] = TEST_NODE_CPU["requests"]
                res.setdefault("limits", {})["cpu"] = TEST_NODE_CPU["limits"]
                for env in c.get("env", []):
                    if env["name"] in TEST_NODE_ENV:
                        env["value"] = TEST_NODE_ENV[env["name"]]
                changes.append(
                    f"{kind}/{name}: cpu request {TEST_NODE_CPU['requests']}, limit "
                    f"{TEST_NODE_CPU['limits']}, "
                    + ", ".join(f"{k}={v}" for k, v in TEST_NODE_ENV.items())
                    + " (a 2-core test node)"
                )
    return docs, changes


def main() -> None:
    docs, changes = render(manifests())
    for line in changes:
        sys.stderr.write(f"overlay: {line}\n")
    json.dump({"apiVersion": "v1", "kind": "List", "items": docs}, sys.stdout)


if __name__ == "__main__":
    main()
