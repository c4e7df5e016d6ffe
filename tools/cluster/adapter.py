"""The custom metrics API for `make cluster-test`'s autoscaler (test tooling, not the product).

prometheus-adapter has no image or binary this machine can reach, so this stands in for it,
doing what it does for the one rule docker/k8s/prometheus-adapter.yaml holds: it reads that
rule from the cluster's ConfigMap (as the adapter reads its --config), serves its metric only
while the rule's seriesQuery finds series carrying the labels its overrides name (the adapter's
discovery), and answers the autoscaler's
`custom.metrics.k8s.io/v1beta1 .../namespaces/NS/pods/*/METRIC` by running the rule's
metricsQuery against a real Prometheus, with the adapter's template filled the adapter's way
(<<.Series>>, <<.LabelMatchers>>, <<.GroupBy>>). A rule whose seriesQuery matches no series,
or whose name does not map to the HPA's metric, answers 404 exactly as the adapter would, and the
autoscaler never scales: that is the failure this run exists to catch.

Served over TLS on the node (the APIService points at it through a selector-less Service);
every read is appended to READS (JSON lines) for the run's report. Debian's Prometheus has no
Kubernetes service discovery, so this also writes TARGETS (file_sd) every 2 s: each running pod
whose prometheus.io/scrape annotation is "true", at its address, prometheus.io/port and
prometheus.io/path, labelled namespace and pod: the names kube-prometheus' relabelling gives,
so the rule is checked against those names, not against every way a Prometheus can be set up.

    python tools/cluster/adapter.py --pki RUN/pki --reads RUN/adapter-reads.jsonl \
        --targets RUN/prometheus/targets.json
"""

from __future__ import annotations

import argparse
import json
import re
import ssl
import sys
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

GROUP = "custom.metrics.k8s.io"
VERSION = "v1beta1"
CONFIGMAP = "/api/v1/namespaces/{ns}/configmaps/prometheus-adapter-bertserve"


class Cluster:
    def __init__(self, server: str, pki: Path) -> None:
        self.server = server
        self.ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        self.ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.server + path, context=self.ctx, timeout=5) as r:
            return json.load(r)


class Rule:
    """One prometheus-adapter rule: the series it discovers and the metric name it serves."""

    def __init__(self, rule: dict[str, Any]) -> None:
        self.series_query = rule["seriesQuery"]
        self.metrics_query = rule["metricsQuery"]
        self.series = re.match(r"\s*([a-zA-Z_:][a-zA-Z0-9_:]*)", self.series_query).group(1)  # type: ignore[union-attr]
        name = rule.get("name", {})
        matches = name.get("matches", f"^{re.escape(self.series)}$")
        # The adapter's `as` is a Go template of the match's groups: ${1} or $1 -> Python's \g<1>.
        as_ = re.sub(r"\$\{?(\d+)\}?", r"\\g<\1>", name.get("as", "") or r"\g<0>")
        self.metric = re.sub(matches, as_, self.series)
        overrides = rule.get("resources", {}).get("overrides", {})
        self.label_for = {v["resource"]: k for k, v in overrides.items()}

    def query(self, namespace: str, pods: list[str]) -> str:
        matchers = (
            f'{self.label_for["namespace"]}="{namespace}",'
            f'{self.label_for["pod"]}=~"{"|".join(pods)}"'
        )
        return (
            self.metrics_query.replace("<<.Series>>", self.series)
            .replace("<<.LabelMatchers>>", matchers)
            .replace("<<.GroupBy>>", self.label_for["pod"])
        )


class Adapter:
    def __init__(self, cluster: Cluster, prometheus: str, namespace: str, reads: Path) -> None:
        self.cluster, self.prometheus, self.namespace, self.reads = (
            cluster,
            prometheus,
            namespace,
            reads,
        )
        self.lock = threading.Lock()

    def rules(self) -> list[Rule]:
        cm = self.cluster.get(CONFIGMAP.format(ns=self.namespace))
        return [Rule(r) for r in yaml.safe_load(cm["data"]["config.yaml"])["rules"]]

    def discovered(self, rule: Rule) -> bool:
        """The adapter's discovery: a rule serves its metric only while its seriesQuery finds
        series that carry the labels its resource overrides name."""
        query = urllib.parse.urlencode({"match[]": rule.series_query})
        with urllib.request.urlopen(f"{self.prometheus}/api/v1/series?{query}", timeout=5) as r:
            series = json.load(r)["data"]
        labels = (rule.label_for["namespace"], rule.label_for["pod"])
        return any(all(label in s for label in labels) for s in series)

    def promql(self, query: str) -> list[dict[str, Any]]:
        url = f"{self.prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": query})
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.load(r)["data"]["result"]

    def values(
        self, namespace: str, pod: str, metric: str, selector: str
    ) -> list[dict[str, Any]] | None:
        rule = next((r for r in self.rules() if r.metric == metric), None)
        if rule is None or not self.discovered(rule):
            return None
        if pod == "*":
            q = "?labelSelector=" + urllib.parse.quote(selector) if selector else ""
            listed = self.cluster.get(f"/api/v1/namespaces/{namespace}/pods{q}")["items"]
            pods = [p["metadata"]["name"] for p in listed]
        else:
            pods = [pod]
        if not pods:
            return []
        query = rule.query(namespace, pods)
        result = self.promql(query)
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        items: list[dict[str, Any]] = [
            {
                "describedObject": {
                    "kind": "Pod",
                    "namespace": namespace,
                    "name": r["metric"][rule.label_for["pod"]],
                    "apiVersion": "/v1",
                },
                "metricName": metric,
                "timestamp": now,
                "value": f"{round(float(r['value'][1]) * 1000)}m",
            }
            for r in result
        ]
        with self.lock, self.reads.open("a") as f:
            f.write(
                json.dumps(
                    {
                        "t": time.time(),
                        "query": query,
                        "values": {
                            i["describedObject"]["name"]: float(r["value"][1])
                            for i, r in zip(items, result, strict=True)
                        },
                    }
                )
                + "\n"
            )
        return items


def discover(cluster: Cluster, targets: Path) -> None:
    """Prometheus' targets from the pods' prometheus.io annotations, every 2 s."""
    while True:
        try:
            found = []
            for pod in cluster.get("/api/v1/pods")["items"]:
                notes = pod["metadata"].get("annotations") or {}
                ip = pod["status"].get("podIP")
                if (
                    notes.get("prometheus.io/scrape") != "true"
                    or not ip
                    or pod["status"].get("phase") != "Running"
                ):
                    continue
                found.append(
                    {
                        "targets": [f"{ip}:{notes.get('prometheus.io/port', '80')}"],
                        "labels": {
                            "namespace": pod["metadata"]["namespace"],
                            "pod": pod["metadata"]["name"],
                            "__metrics_path__": notes.get("prometheus.io/path", "/metrics"),
                        },
                    }
                )
            tmp = targets.with_suffix(".tmp")
            tmp.write_text(json.dumps(found))
            tmp.replace(targets)
        except OSError as e:
            sys.stderr.write(f"adapter: discovery: {e}\n")
        time.sleep(2)


def handler(adapter: Adapter) -> type[BaseHTTPRequestHandler]:
    base = f"/apis/{GROUP}/{VERSION}"

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def send(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def failure(self, code: int, reason: str, message: str) -> None:
            """A Kubernetes Status, as an aggregated API server answers an error."""
            body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code}
            self.send(code, body | {"reason": reason, "message": message})

        def not_found(self, message: str) -> None:
            self.failure(404, "NotFound", message)

        def do_GET(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            url = url._replace(
                path=urllib.parse.unquote(url.path)
            )  # the autoscaler asks for pods/%2A
            if url.path in ("/healthz", "/livez", "/readyz"):
                self.send(200, {"status": "ok"})
                return
            if url.path.rstrip("/") == base:
                resources = [
                    {
                        "name": f"pods/{r.metric}",
                        "singularName": "",
                        "namespaced": True,
                        "kind": "MetricValueList",
                        "verbs": ["get"],
                    }
                    for r in adapter.rules()
                ]
                self.send(
                    200,
                    {
                        "kind": "APIResourceList",
                        "apiVersion": "v1",
                        "groupVersion": f"{GROUP}/{VERSION}",
                        "resources": resources,
                    },
                )
                return
            m = re.fullmatch(rf"{base}/namespaces/([^/]+)/pods/([^/]+)/([^/]+)", url.path)
            if not m:
                self.not_found(f"{url.path}: not served")
                return
            selector = urllib.parse.parse_qs(url.query).get("labelSelector", [""])[0]
            try:
                items = adapter.values(m.group(1), m.group(2), m.group(3), selector)
            except Exception as e:
                self.failure(500, "InternalError", repr(e))
                return
            if not items:
                self.not_found(f"the custom metric {m.group(3)} is not found for pods {m.group(2)}")
                return
            self.send(
                200,
                {
                    "kind": "MetricValueList",
                    "apiVersion": f"{GROUP}/{VERSION}",
                    "metadata": {"selfLink": url.path},
                    "items": items,
                },
            )

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=6444)
    ap.add_argument("--pki", type=Path, required=True)
    ap.add_argument("--server", default="https://127.0.0.1:6443")
    ap.add_argument("--prometheus", default="http://127.0.0.1:9090")
    ap.add_argument("--namespace", default="default")
    ap.add_argument("--reads", type=Path, required=True)
    ap.add_argument("--targets", type=Path, required=True)
    args = ap.parse_args()
    cluster = Cluster(args.server, args.pki)
    threading.Thread(target=discover, args=(cluster, args.targets), daemon=True).start()
    adapter = Adapter(cluster, args.prometheus, args.namespace, args.reads)
    httpd = ThreadingHTTPServer(("0.0.0.0", args.port), handler(adapter))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(args.pki / "adapter.crt"), str(args.pki / "adapter.key"))
    httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
    sys.stderr.write(f"adapter: https://0.0.0.0:{args.port}/apis/{GROUP}/{VERSION}\n")
    sys.stderr.flush()
    httpd.serve_forever()


if __name__ == "__main__":
    main()
