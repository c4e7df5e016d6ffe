"""Where a served request's time goes under 5x overload: the overload scenario of `make
reliability` (5x the measured saturation, open loop), then the server's own histograms, scraped
from /metrics before and after the flood, beside the client's latencies.

    bertserve bench overload-stages --seconds 30 BERTSERVE_MAX_QUEUE_TIME_MS=0

Arguments of the form NAME=VALUE are set in the server's environment. Prints one JSON line (the
client's view) and one line a histogram: the end-to-end request duration the server measured
(from the request's arrival in the app to its answer) and the queue stage alone, as bucket
bounds (p50 / p90 / p99) and the share over 1 s. The difference between the client's tail and
the server's is time the request spent outside the app: in the socket, waiting for its loop.
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench.inputs import write_bodies
from bench.reliability import PORT, overload
from bench.servers import OURS, only_bundles, serve

ROOT = Path(__file__).resolve().parents[2]
HISTOGRAMS = (
    ("bertserve_request_duration_seconds", {"endpoint": "/classify"}),
    ("bertserve_stage_duration_seconds", {"endpoint": "/classify", "stage": "queue"}),
)


def buckets(text: str, name: str, labels: dict[str, str]) -> dict[float, float]:
    """Cumulative bucket counts of one histogram, summed over the series matching `labels`."""
    out: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == f"{name}_bucket" and all(s.labels.get(k) == v for k, v in labels.items()):
                le = float(s.labels["le"])
                out[le] = out.get(le, 0.0) + s.value
    return out


def summary(before: dict[float, float], after: dict[float, float]) -> dict[str, float]:
    counts = sorted((le, n - before.get(le, 0.0)) for le, n in after.items())
    total = counts[-1][1] if counts else 0.0
    if not total:
        return {"n": 0}

    def bound(q: float) -> float:
        return next(le for le, n in counts if n >= q * total)

    within_1s = dict(counts).get(1.0, 0.0)
    return {
        "n": total,
        "p50_le": bound(0.5),
        "p90_le": bound(0.9),
        "p99_le": bound(0.99),
        "over_1s": round(1 - within_1s / total, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--bundles", type=Path, default=ROOT / "bundles")
    parser.add_argument("--classify-bundle", default="sst2-distilled-2x192")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "overload-stages")
    parser.add_argument(
        "--preconnect", type=int, default=0, help="client connections opened before the flood"
    )
    parser.add_argument(
        "--rate", type=float, help="requests/s offered (default: 5x the measured saturation)"
    )
    parser.add_argument("env", nargs="*", help="NAME=VALUE for the server's environment")
    args = parser.parse_args()
    env = dict(pair.split("=", 1) for pair in args.env)
    bodies = write_bodies("classify", args.data, args.work / "inputs")
    ready = bodies.read_text().splitlines()[0].encode()
    bundles = only_bundles(args.bundles, [args.classify_bundle], args.work / "bundles")
    log = args.work / "server.log"
    with serve(OURS, bundles, bundles / args.classify_bundle, PORT, ready, log, env) as server:
        scrape = server.url("metrics")
        before = urllib.request.urlopen(scrape).read().decode()
        result = overload(server, bodies, args.seconds, args.preconnect, args.rate)
        after = urllib.request.urlopen(scrape).read().decode()
    ok = result["by_status"].get("200", {})
    client = {
        "env": env,
        "saturation": round(result["saturation"]),
        "answered_200_per_s": round(result["answered_200_per_s"]),
        "client_200_p50_p99_ms": (ok.get("p50_ms"), ok.get("p99_ms")),
        "client_over_1s": result["over_1s"],
        "statuses": result["statuses"],
        "socket_errors": result["socket_errors"],
        "socket_error_kinds": result["socket_error_kinds"],
        "late_by_second": result["late_by_second"],
        "late_parts_ms": result["late_parts_ms"],
        "recovery_per_s": [round(x) for x in result["recovery_per_s"]],
    }
    print(json.dumps(client))
    for name, labels in HISTOGRAMS:
        line = summary(buckets(before, name, labels), buckets(after, name, labels))
        print(json.dumps({"histogram": name, **labels, **line}))


if __name__ == "__main__":
    main()
