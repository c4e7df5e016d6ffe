"""`make cluster-test`'s scenarios, on the cluster tools/cluster/cluster.sh started (test
tooling, not the product): docker/k8s applied through overlay.py, a steady keyed load from a
pod inside the cluster (load.py), then

1. two replicas ready, the Service spreading requests over both;
2. a rolling update to a new image under the load;
3. `kubectl delete pod` of one replica under the load;
4. load past the replicas' capacity: the HPA scales up on bertserve_queue_depth, served by
   Prometheus and adapter.py (the ConfigMap's rule), and the load's p99 after the new replica;
5. `kubectl drain` of the node's bertserve pods: the PDB keeps one serving.

Each scenario's requests are counted from the load's own log (every request, its outcome and
time). The figures go to --report (Markdown); the exit status is 1 when a target is missed.

    python tools/cluster/run.py --run /tmp/bertserve-cluster --report docs/reports/cluster.md
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
import overlay  # noqa: E402

APP = "app.kubernetes.io/name=bertserve"
NODE = "bertserve-node"
# Keyed clients on keep-alive connections, each recycled after 100 requests as client pools do
# (the Service balances connections, not requests).
STEADY = {
    "CONCURRENCY": "8",
    "RECYCLE": "100",
    "BODY": json.dumps({"inputs": "a charming and often affecting journey"}),
}
SURGE_TEXTS = [
    "a charming and often affecting journey",
    "the plot is nothing but a string of clichés",
    "an utterly compelling portrait of a family in crisis",
    "it drags on far too long and never finds its footing",
    "one of the year's most satisfying films",
    "a dull, lifeless exercise in style over substance",
    "the performances are uniformly excellent",
    "I could not wait for it to end",
]
SURGE = {"CONCURRENCY": "12", "RECYCLE": "100", "BODY": json.dumps({"inputs": SURGE_TEXTS})}


APPLIED = (" created", " configured", " unchanged")


def log(msg: str) -> None:
    sys.stderr.write(f"cluster-test: {msg}\n")
    sys.stderr.flush()


class Kube:
    def __init__(self, run: Path) -> None:
        self.run = run
        self.env = dict(os.environ, KUBECONFIG=str(run / "admin.kubeconfig"))
        bins = os.environ.get("BERTSERVE_CLUSTER_CACHE", "/var/cache/bertserve-cluster") + "/bin"
        self.env["PATH"] = bins + os.pathsep + self.env["PATH"]

    def __call__(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> str:
        p = subprocess.run(
            ["kubectl", *args],
            input=input,
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
        )
        if check and p.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {p.stderr.strip()}")
        return p.stdout + (p.stderr if not check else "")

    def json(self, *args: str) -> Any:
        return json.loads(self("get", *args, "-o", "json"))

    def apply(self, doc: dict[str, Any]) -> str:
        return self("apply", "-f", "-", input=json.dumps(doc))

    def pods(self, selector: str = APP) -> list[dict[str, Any]]:
        return [
            p
            for p in self.json("pods", "-l", selector)["items"]
            if not p["metadata"].get("deletionTimestamp")
        ]

    def ready_pods(self) -> list[dict[str, Any]]:
        def ready(p: dict[str, Any]) -> bool:
            conds = p["status"].get("conditions", [])
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

        return [p for p in self.pods() if ready(p)]


def scrape(ip: str, name: str) -> float:
    """The sum of a metric's samples on one pod's /metrics (NaN when the pod does not answer)."""
    try:
        with urllib.request.urlopen(f"http://{ip}:8000/metrics", timeout=3) as r:
            text = r.read().decode()
    except OSError:
        return float("nan")
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


@dataclass
class Load:
    """A load pod: its log followed into a file from the start (a container's log rotates),
    and its requests read back from it."""

    name: str
    log: Path
    follower: subprocess.Popen[bytes] | None = None
    records: list[list[Any]] = field(default_factory=list)
    done: bool = False

    def window(self, start: float, end: float) -> list[list[Any]]:
        return [r for r in self.records if start <= r[0] < end]


def start_load(kube: Kube, name: str, target: str, duration: float, spec: dict[str, str]) -> Load:
    env: list[dict[str, Any]] = [
        {"name": "TARGET", "value": target},
        {"name": "DURATION", "value": str(duration)},
    ]
    env += [{"name": k, "value": v} for k, v in spec.items()]
    key = {"secretKeyRef": {"name": "bertserve-api-keys", "key": "keys"}}
    env.append({"name": "API_KEY", "valueFrom": key})
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": {"bertserve-client": "true", "role": "load"}},
            "spec": {
                "restartPolicy": "Never",
                "automountServiceAccountToken": False,
                "containers": [
                    {
                        "name": "load",
                        "image": "bertserve:cpu",
                        "command": ["python", "/load/load.py"],
                        "env": env,
                        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
                        "volumeMounts": [{"name": "load", "mountPath": "/load"}],
                    }
                ],
                "volumes": [{"name": "load", "configMap": {"name": "bertserve-load"}}],
            },
        }
    )
    kube("wait", "--for=condition=Ready", f"pod/{name}", "--timeout=60s")
    load = Load(name, kube.run / "log" / f"{name}.jsonl")
    with load.log.open("wb") as out:
        load.follower = subprocess.Popen(["kubectl", "logs", "-f", name], stdout=out, env=kube.env)
    return load


def finish_load(kube: Kube, load: Load, wait: float) -> Load:
    """Stop the load, read every request it made, delete its pod."""
    kube("exec", load.name, "--", "touch", "/tmp/stop", check=False)
    assert load.follower is not None
    try:
        load.follower.wait(wait)  # the log ends when the container does
    except subprocess.TimeoutExpired:
        load.follower.kill()
        log(f"{load.name}: still running after {wait:.0f} s")
    text = load.log.read_text()
    load.records = [json.loads(line) for line in text.splitlines() if line.startswith("[")]
    load.done = '{"done": true}' in text
    if not load.done:
        log(f"{load.name}: its log does not end with done (the pod did not finish)")
    kube("delete", "pod", load.name, "--wait=false")
    return load


def outcomes(records: list[list[Any]]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for r in records:
        counts[str(r[2])] = counts.get(str(r[2]), 0) + 1
    ok = [r[1] for r in records if r[2] == 200]
    failed = sum(n for k, n in counts.items() if k not in ("200", "503ra"))
    return {
        "requests": len(records),
        "ok": counts.get("200", 0),
        "refused_503_retry_after": counts.get("503ra", 0),
        "failed": failed,
        "failures": {k: n for k, n in counts.items() if k not in ("200", "503ra")},
        "p50_ms": round(float(np.percentile(ok, 50)), 1) if ok else None,
        "p99_ms": round(float(np.percentile(ok, 99)), 1) if ok else None,
    }


def setup(kube: Kube, run: Path) -> tuple[list[str], int, int]:
    """What the manifests need (the API key, the monitoring namespace, the ServiceMonitor type,
    Prometheus, the custom metrics API), then the manifests. Returns the lines for the report
    (the overlay's differences, `kubectl apply`'s output), the documents rendered, and the
    objects kubectl says it applied."""
    key = secrets.token_urlsafe(32)
    kube("create", "secret", "generic", "bertserve-api-keys", f"--from-literal=keys={key}")
    kube("create", "configmap", "bertserve-load", f"--from-file=load.py={HERE / 'load.py'}")
    # Kubernetes 1.21+ labels every namespace with its name; the NetworkPolicy selects on it.
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {
                "name": "monitoring",
                "labels": {"kubernetes.io/metadata.name": "monitoring"},
            },
        }
    )
    kube.apply(json.loads((HERE / "servicemonitor-crd.json").read_text()))
    node_ip = kube.json("node", NODE)["status"]["addresses"][0]["address"]
    pki = run / "pki"
    # Prometheus as the compose stack builds it (Debian's package), scraping the pods the
    # deployment's prometheus.io annotations name, on the node's network.
    prom = run / "prometheus"
    prom.mkdir(exist_ok=True)
    for f in ("ca.crt", "admin.crt", "admin.key"):
        (prom / f).write_bytes((pki / f).read_bytes())
        (prom / f).chmod(0o644)
    (prom / "prometheus.yml").write_text((HERE / "prometheus.yml").read_text())
    (prom / "targets.json").write_text("[]")
    subprocess.run(["docker", "rm", "-f", "bertserve-cluster-prometheus"], capture_output=True)
    subprocess.run(
        [
            "docker",
            "run",
            "-d",
            "--name",
            "bertserve-cluster-prometheus",
            "--network",
            "host",
            "-v",
            f"{prom}:/etc/prometheus:ro",
            "bertserve-prometheus:debian",
            "--config.file=/etc/prometheus/prometheus.yml",
            "--web.listen-address=127.0.0.1:9090",
            "--storage.tsdb.path=/prometheus",
        ],
        check=True,
        capture_output=True,
    )
    adapter = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "adapter.py"),
            "--pki",
            str(pki),
            "--reads",
            str(run / "adapter-reads.jsonl"),
            "--targets",
            str(prom / "targets.json"),
        ],
        stdout=(run / "log" / "adapter.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    (run / "pid" / "adapter").write_text(str(adapter.pid))
    for doc in (
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "custom-metrics", "namespace": "monitoring"},
            "spec": {"ports": [{"port": 443, "targetPort": 6444}]},
        },
        {
            "apiVersion": "v1",
            "kind": "Endpoints",
            "metadata": {"name": "custom-metrics", "namespace": "monitoring"},
            "subsets": [{"addresses": [{"ip": node_ip}], "ports": [{"port": 6444}]}],
        },
        {
            "apiVersion": "apiregistration.k8s.io/v1",
            "kind": "APIService",
            "metadata": {"name": "v1beta1.custom.metrics.k8s.io"},
            "spec": {
                "group": "custom.metrics.k8s.io",
                "version": "v1beta1",
                "insecureSkipTLSVerify": True,
                "groupPriorityMinimum": 100,
                "versionPriority": 100,
                "service": {"namespace": "monitoring", "name": "custom-metrics", "port": 443},
            },
        },
    ):
        kube.apply(doc)
    # `kubectl apply -k docker/k8s`, the documented command, builds the same documents with the
    # kustomize inside this kubectl (1.20's); they are applied through the overlay from here.
    built = [d for d in yaml.safe_load_all(kube("kustomize", str(overlay.K8S))) if d]
    source = overlay.manifests()

    def identity(d: dict[str, Any]) -> tuple[str, str]:
        return d["kind"], d["metadata"]["name"]

    if sorted(built, key=identity) != sorted(source, key=identity):
        raise RuntimeError("kubectl kustomize docker/k8s builds other documents than its files")
    docs, changes = overlay.render(source)
    changes.append(
        f"kubectl kustomize docker/k8s (kubectl 1.20) builds the same {len(built)} documents"
    )
    applied = kube(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs})
    )
    lines = [line for line in applied.splitlines() if line]
    return changes + lines, len(docs), sum(1 for line in lines if line.endswith(APPLIED))


def verdicts(r: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """Each target of the issue: what was measured, and whether it holds."""
    ph = r["phases"]
    up = ph["rolling update"]
    deleted = ph["pod deletion"]
    hpa = r["hpa"]
    drain = ph["drain (PDB)"]
    kinds = set(deleted["failures"]) - {"conn", "503"}
    out = {
        "two replicas share the load": (
            ", ".join(f"{int(v)}" for v in r["spread"].values()) + " requests",
            len(r["spread"]) == 2 and min(r["spread"].values()) > 0.1 * max(r["spread"].values()),
        ),
        "rolling update: 0 failed": (f"{up['failed']} of {up['requests']}", up["failed"] == 0),
        "pod deletion: failed <= in flight on it, none a timeout": (
            f"{deleted['failed']} failed ({deleted['failures'] or 'none'}), "
            f"{r['deleted']['in_flight_before']:.0f} in flight on it",
            deleted["failed"] <= r["deleted"]["in_flight_before"] and not kinds,
        ),
        "HPA: scale-up within 60 s of overload": (
            f"desired > 2 at {hpa['scaled_at_s']:.0f} s"
            if hpa["scaled_at_s"] is not None
            else "never",
            hpa["scaled_at_s"] is not None and hpa["scaled_at_s"] <= 60,
        ),
        "HPA: p99 falls after the new replica": (
            f"{hpa.get('p99_before_ms')} -> {hpa.get('p99_after_ms')} ms (p50 "
            f"{hpa.get('p50_before_ms')} -> {hpa.get('p50_after_ms')} ms; both loads' requests "
            f"a second {hpa.get('rate_before')} -> {hpa.get('rate_after')})",
            bool(hpa.get("p99_after_ms")) and hpa["p99_after_ms"] < hpa["p99_before_ms"],
        ),
        "drain: the PDB keeps a replica serving": (
            f"{r['drain']['evicted']} evicted, at least {r['drain']['ready_min']} ready "
            f"throughout, {drain['failed']} failed",
            r["drain"]["ready_min"] >= 1 and drain["failed"] == 0,
        ),
        "the whole run: no failed request outside the deletion's allowance": (
            f"{r['whole']['failed']} failed of {r['whole']['requests']} "
            f"({r['whole']['failures'] or 'none'})",
            r["whole"]["failed"] - deleted["failed"] == 0,
        ),
        "the steady load ran throughout": (
            f"longest pause between requests {r['longest_gap_s']:.1f} s; "
            + ("finished" if r["steady_done"] else "**did not finish**"),
            r["steady_done"] and r["longest_gap_s"] < 10,
        ),
        "every manifest applies": (
            f"{r['objects_applied']} of {r['objects_rendered']} objects",
            r["objects_applied"] == r["objects_rendered"],
        ),
    }
    return out


def seconds(t: float | None) -> str:
    return "never" if t is None else f"{t:.0f} s"


def report(r: dict[str, Any], path: Path) -> None:
    v = verdicts(r)
    lines = [
        "# docker/k8s on a Kubernetes cluster",
        "",
        f"`make cluster-test` (tools/cluster/), {r['started']}, at {r['commit']}: a one-node "
        f"Kubernetes {r['server']} built from Debian's source package (tools/cluster/build.sh), "
        f"containerd {r['containerd']}, on {r['machine']}. The load: keyed POST /classify from a "
        "pod inside the cluster to the Service's ClusterIP (tools/cluster/load.py), 8 clients one "
        "request after another on keep-alive connections recycled every 100 requests; the "
        "autoscaling step adds 12 clients sending 8 texts a request.",
        "",
        "| target | measured | |",
        "|---|---|---|",
    ]
    lines += [f"| {k} | {m} | {'met' if ok else '**missed**'} |" for k, (m, ok) in v.items()]
    d = r["deleted"]
    lines += [
        "",
        "## Timeline",
        "",
        f"- The manifests applied, 2 replicas ready after {r['ready_s']:.0f} s.",
        f"- The rolling update (`kubectl set image`, maxSurge 1, maxUnavailable 0) done in "
        f"{r['rollout_s']:.0f} s; the pods then run {', '.join(r['images_after_update'])}.",
        f"- `kubectl delete pod {d['pod']}` with {d['in_flight_before']:.0f} requests in flight on "
        f"it: the pod was gone {d['gone_s']:.0f} s later (preStop 5 s, then the drain).",
        f"- The autoscaler wanted more replicas at {seconds(r['hpa']['scaled_at_s'])} after the "
        f"surge began; a third was ready at {seconds(r['hpa']['ready_at_s'])}.",
        f"- The drain evicted {r['drain']['evicted']} pods and kept at least "
        f"{r['drain']['ready_min']} ready throughout"
        + (
            ": the last eviction was refused (the PDB) until the drain's 60 s ran out."
            if r["drain"]["timed_out"]
            else "."
        ),
        f"- Container restarts of bertserve pods during the run: {r['restarts']}.",
    ]
    lines += [
        "",
        "## Requests in each step",
        "",
        "Failed: a connection error, a timeout (30 s) or any status but 200 and 503 with "
        "Retry-After (a refusal, which a client retries).",
        "",
        "| step | seconds | requests | 200 | 503 + Retry-After | failed | p50 ms | p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, o in r["phases"].items():
        a, b = r["marks"][name]
        fails = ", ".join(f"{n} {k}" for k, n in o["failures"].items()) or "0"
        lines.append(
            f"| {name} | {b - a:.0f} | {o['requests']} | {o['ok']} | "
            f"{o['refused_503_retry_after']} | {fails} | {o['p50_ms']} | {o['p99_ms']} |"
        )
    hpa = r["hpa"]
    lines += [
        "",
        "## Autoscaling",
        "",
        "The surge starts at 0 s. bertserve_queue_depth per pod as the HPA read it (target 16), "
        f"the replicas it wanted, and the ready ones; {r['adapter_reads']} reads of the custom "
        "metrics API.",
        "",
        "| s | metric | desired | ready |",
        "|---|---|---|---|",
    ]
    last = None
    for t in hpa["trace"]:
        row = (t["metric"], t["desired"], t["ready"])
        if row != last:
            lines.append(f"| {t['t']:.0f} | {t['metric']} | {t['desired']} | {t['ready']} |")
            last = row
    lines += [
        "",
        "## The drain",
        "",
        "`kubectl drain` of the bertserve pods, 60 s timeout:",
        "",
        "```",
    ]
    lines += r["drain"]["output"] + ["```", "", "## What the test applied", ""]
    lines += [f"- {a}" for a in r["applied"]]
    path.write_text("\n".join(lines) + "\n")


def restarts(kube: Kube) -> int:
    """Container restarts summed over the bertserve pods there are now."""
    return sum(
        c.get("restartCount", 0)
        for p in kube.pods()
        for c in p["status"].get("containerStatuses") or []
    )


def wait_ready(kube: Kube, n: int, timeout: float) -> float:
    start = time.time()
    while time.time() - start < timeout:
        if len(kube.ready_pods()) >= n:
            return time.time() - start
        time.sleep(1)
    raise RuntimeError(f"{n} bertserve pods not ready in {timeout:.0f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--run",
        type=Path,
        default=Path(os.environ.get("BERTSERVE_CLUSTER_RUN", "/tmp/bertserve-cluster")),
    )
    ap.add_argument("--report", type=Path, default=ROOT / "docs" / "reports" / "cluster.md")
    args = ap.parse_args()
    kube = Kube(args.run)
    r: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "machine": f"{os.cpu_count()} cores, "
        + next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            "?",
        ),
    }

    log("applying docker/k8s with the 1.20 overlay")
    r["applied"], r["objects_rendered"], r["objects_applied"] = setup(kube, args.run)
    for line in r["applied"]:
        log(line)
    r["ready_s"] = wait_ready(kube, 2, 300)
    r["restarts"] = 0
    log(f"2 replicas ready in {r['ready_s']:.0f} s")
    version = kube.json("node", NODE)["status"]["nodeInfo"]
    r["server"] = version["kubeletVersion"]
    r["containerd"] = version["containerRuntimeVersion"].split("://")[-1]
    cluster_ip = kube.json("service", "bertserve")["spec"]["clusterIP"]
    target = f"{cluster_ip}:80"
    time.sleep(10)  # the endpoints and Prometheus' first scrapes

    steady = start_load(kube, "load-steady", target, 1800, STEADY)
    t0 = time.time()
    marks: dict[str, tuple[float, float]] = {}

    # 1. the Service spreads the load over both replicas
    before = {
        p["metadata"]["name"]: scrape(p["status"]["podIP"], "bertserve_requests_total")
        for p in kube.ready_pods()
    }
    time.sleep(30)
    after = {
        p["metadata"]["name"]: scrape(p["status"]["podIP"], "bertserve_requests_total")
        for p in kube.ready_pods()
    }
    r["spread"] = {n: after[n] - before.get(n, 0) for n in after}
    marks["steady"] = (t0, time.time())
    log(f"spread over the replicas: {r['spread']}")

    # 2. rolling update to a new image
    s = time.time()
    kube("set", "image", "deployment/bertserve", "bertserve=bertserve:cpu-b")
    kube("rollout", "status", "deployment/bertserve", "--timeout=600s", timeout=620)
    time.sleep(10)
    marks["rolling update"] = (s, time.time())
    r["rollout_s"] = marks["rolling update"][1] - s - 10
    images = {p["spec"]["containers"][0]["image"] for p in kube.ready_pods()}
    r["images_after_update"] = sorted(images)
    log(f"rolled out in {r['rollout_s']:.0f} s: {images}")

    # 3. one replica deleted under the load
    victim = kube.ready_pods()[0]
    in_flight = scrape(victim["status"]["podIP"], "bertserve_in_flight_requests")
    s = time.time()
    kube("delete", "pod", victim["metadata"]["name"], "--wait=false")
    r["deleted"] = {"pod": victim["metadata"]["name"], "in_flight_before": in_flight}
    kube(
        "wait",
        "--for=delete",
        f"pod/{victim['metadata']['name']}",
        "--timeout=120s",
        check=False,
        timeout=130,
    )
    r["deleted"]["gone_s"] = time.time() - s
    wait_ready(kube, 2, 300)
    time.sleep(5)
    marks["pod deletion"] = (s, time.time())
    log(f"deleted {victim['metadata']['name']} (in flight: {in_flight})")

    # 4. past capacity: the autoscaler adds a replica
    s = time.time()
    surge = start_load(kube, "load-surge", target, 240, SURGE)
    s_surge = time.time()  # its pod ready and sending
    hpa_trace: list[dict[str, Any]] = []
    scaled_at = ready_at = None
    while time.time() - s < 230:
        hpa = kube.json("hpa.v2beta2.autoscaling", "bertserve")  # kubectl's default is v1
        st = hpa["status"]
        metric = next(
            (
                m["pods"]["current"]["averageValue"]
                for m in st.get("currentMetrics") or []
                if m.get("type") == "Pods"
            ),
            None,
        )
        ready = len(kube.ready_pods())
        r["restarts"] = max(r["restarts"], restarts(kube))
        hpa_trace.append(
            {
                "t": round(time.time() - s, 1),
                "metric": metric,
                "desired": st.get("desiredReplicas"),
                "replicas": st.get("currentReplicas"),
                "ready": ready,
            }
        )
        if scaled_at is None and (st.get("desiredReplicas") or 0) > 2:
            scaled_at = time.time() - s
            log(
                f"HPA wants {st['desiredReplicas']} replicas at {scaled_at:.0f} s (metric {metric})"
            )
        if scaled_at is not None and ready_at is None and ready > 2:
            ready_at = time.time() - s
            log(f"a third replica ready at {ready_at:.0f} s")
        time.sleep(2)
    surge = finish_load(kube, surge, 60)
    marks["autoscaling"] = (s, time.time())
    r["hpa"] = {"trace": hpa_trace, "scaled_at_s": scaled_at, "ready_at_s": ready_at}

    # 5. a drain of the node's bertserve pods: the PDB keeps one
    s = time.time()
    drain_cmd = ["kubectl", "drain", NODE, f"--pod-selector={APP}", "--ignore-daemonsets"]
    drain_cmd += ["--delete-local-data", "--timeout=60s"]
    draining = subprocess.Popen(
        drain_cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=kube.env
    )
    ready_min = len(kube.ready_pods())
    while draining.poll() is None:  # the fewest ready replicas while it runs, polled each second
        ready_min = min(ready_min, len(kube.ready_pods()))
        time.sleep(1)
    lines = [
        line for line in (draining.stdout.read() if draining.stdout else "").splitlines() if line
    ]
    r["drain"] = {
        "output": lines[-6:],
        "evicted": sum(1 for line in lines if line.endswith(" evicted")),
        "timed_out": any("global timeout reached" in line for line in lines),
        "ready_min": ready_min,
    }
    kube("uncordon", NODE)
    marks["drain (PDB)"] = (s, time.time())
    log(f"drain: at least {ready_min} ready throughout; {r['drain']['output'][-1:]}")

    r["restarts"] = max(r["restarts"], restarts(kube))
    steady = finish_load(kube, steady, 60)
    r["whole"] = outcomes(steady.records + surge.records)
    starts = sorted(rec[0] for rec in steady.records)
    r["longest_gap_s"] = max((b - a for a, b in itertools.pairwise(starts)), default=1e9)
    r["steady_done"] = steady.done
    r["phases"] = {}
    for name, (a, b) in marks.items():
        r["phases"][name] = outcomes(
            steady.window(a, b) + (surge.window(a, b) if name == "autoscaling" else [])
        )
    if scaled_at is not None and ready_at is not None:
        # The steady clients' requests while two replicas serve the surge (after its first 5 s),
        # against the minute after the third is ready and has taken its share (15 s on).
        s_hpa = marks["autoscaling"][0]
        surge_end = max((rec[0] for rec in surge.records), default=s_surge)
        windows = {
            "before": (s_surge + 5, s_hpa + ready_at),
            "after": (s_hpa + ready_at + 15, min(s_hpa + ready_at + 75, surge_end)),
        }
        for name, (a, b) in windows.items():
            o = outcomes(steady.window(a, b))
            r["hpa"][f"p99_{name}_ms"] = o["p99_ms"]
            r["hpa"][f"p50_{name}_ms"] = o["p50_ms"]
            both = len(steady.window(a, b)) + len(surge.window(a, b))
            r["hpa"][f"rate_{name}"] = round(both / (b - a), 1)
    reads = args.run / "adapter-reads.jsonl"
    r["adapter_reads"] = sum(1 for _ in reads.open()) if reads.exists() else 0
    r["marks"] = marks
    (args.run / "result.json").write_text(json.dumps(r, indent=1))
    report(r, args.report)
    missed = [k for k, (_, ok) in verdicts(r).items() if not ok]
    log(f"report: {args.report}; " + (f"missed: {missed}" if missed else "every target met"))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
