"""What tracing costs: /embed client batches (32 texts a request) on a server tracing every
request (sampling 1.0, spans sent to an OTLP receiver in this process) against the same server
without tracing, two servers up at once and loaded in turn (the order alternating each round),
best round of each.

    bertserve bench tracing --report docs/reports/tracing.md

The receiver counts what it is sent, so the report says the spans arrived.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

from bench.experiments.retrieval.side_by_side import SETTLE_S, report
from bench.inputs import write_bodies
from bench.loadgen import closed_loop
from bench.servers import OURS, linked_bundles, serve


def receiver() -> tuple[Any, int, dict]:
    """An OTLP/gRPC trace receiver on a free port: (server, port, counts)."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    counts = {"spans": 0}
    lock = threading.Lock()

    class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            with lock:
                counts["spans"] += sum(
                    len(s.spans) for r in request.resource_spans for s in r.scope_spans
                )
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", type=Path, default=Path("bundles/minilm-embed"))
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--levels", default="1,4")
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=8201)
    parser.add_argument("--work", type=Path, default=Path("runs/bench-tracing"))
    parser.add_argument("--report", type=Path, default=None)
    args = parser.parse_args()
    single = write_bodies("classify", args.data, args.work / "inputs")
    texts = [json.loads(line)["inputs"] for line in single.read_text().splitlines() if line]
    batches = [texts[i : i + 32] for i in range(0, len(texts) - 31, 32)]
    bodies = args.work / "embed-x32.jsonl"
    bodies.write_text("\n".join(json.dumps({"inputs": b, "truncate": True}) for b in batches))
    bundles = linked_bundles([args.bundle], args.work / "bundles")
    otlp, otlp_port, counts = receiver()
    first = json.dumps({"inputs": "warm up"}).encode()
    traced = {
        "BERTSERVE_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}",
        "BERTSERVE_OTLP_SAMPLE_RATIO": "1.0",
    }
    runs: dict[tuple[str, str, int], list[dict]] = {}
    with (
        serve(
            OURS,
            bundles,
            bundles / args.bundle.name,
            args.port,
            first,
            args.work / "off.log",
            ready_path="/embed",
        ) as off,
        serve(
            OURS,
            bundles,
            bundles / args.bundle.name,
            args.port + 1,
            first,
            args.work / "on.log",
            env=traced,
            ready_path="/embed",
        ) as on,
    ):
        servers = [("off", off), ("on", on)]
        for round_ in range(args.rounds):
            for level in (int(x) for x in args.levels.split(",")):
                for name, server in servers if round_ % 2 == 0 else servers[::-1]:
                    url = f"{server.base}/embed"
                    closed_loop(url, bodies, 1, 2)
                    time.sleep(SETTLE_S)
                    load = closed_loop(url, bodies, level, args.seconds)
                    runs.setdefault(("batch", name, level), []).append(load.to_dict())
                    print(
                        json.dumps(
                            {
                                "tracing": name,
                                "level": level,
                                "req_s": load.throughput,
                                "spans": counts["spans"],
                            }
                        )
                    )
        time.sleep(2)  # the last spans' export
    otlp.stop(0)
    table = [
        "| connections | off req/s | on (sampling 1.0) req/s | on / off | p50 off / on |",
        "|---|---|---|---|---|",
    ]
    for level in (int(x) for x in args.levels.split(",")):
        best = {
            n: max(runs[("batch", n, level)], key=lambda x: x["throughput"]) for n in ("off", "on")
        }
        table.append(
            f"| {level} | {best['off']['throughput']:.2f} | {best['on']['throughput']:.2f} | "
            f"{best['on']['throughput'] / best['off']['throughput']:.2f}x | "
            f"{best['off']['p50_ms']:.0f} / {best['on']['p50_ms']:.0f} ms |"
        )
    report(
        "Tracing: /embed client batches with every request traced against none",
        "bertserve bench tracing",
        args,
        f"two servers of `{args.bundle.name}` up at once, one exporting every request's spans "
        "(sampling 1.0) over OTLP/gRPC to a receiver in the bench's process, loaded in turn, "
        "the order alternating each round, best of the rounds; 32 SST-2 sentences a request.",
        table,
        runs,
        after=["", f"The receiver got {counts['spans']:,} spans."],
    )


if __name__ == "__main__":
    main()
