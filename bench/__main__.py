"""`bertserve bench <mode>` (or `python -m bench <mode>`): every measurement of a checkout.

The modes run on shared code: bench/servers.py starts and stops the servers, bench/inputs.py
writes request bodies from the shared data, bench/loadgen/ drives them (wrk closed loop, an
open-loop Poisson client), bench/peers/ holds the servers compared against. Each mode writes
its report where its --help says (the Makefile's bench targets name theirs). The experiments
(bench/experiments/) are one-question measurements that docs/performance.md and the docs cite;
they run the same way. `bertserve bench MODE --help` says what a mode takes.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Mode:
    module: str
    summary: str


MODES: dict[str, Mode] = {
    "peers": Mode("bench.run", "bertserve vs the raw ceiling and the peers (`make bench`)"),
    "reliability": Mode(
        "bench.reliability", "overload, faults and hostile input (`make reliability`)"
    ),
    "infinity": Mode("bench.infinity", "/embed against Infinity (`make bench-infinity`)"),
    "families": Mode(
        "bench.family_export", "our export of each family against Optimum's (`make bench-families`)"
    ),
    "attack": Mode("bench.attack", "the adversarial review's targets (docs/security.md)"),
    "ab": Mode("bench.ab", "same-minute A/B of two trees of bertserve"),
    "gpu-check": Mode("bench.gpu_check", "the GPU serving check (bench/gpu_check.sh)"),
    "models": Mode("bench.models", "raw ONNX Runtime throughput of several bundles"),
    "ceiling": Mode("bench.ceiling", "the raw ceiling of one bundle, no HTTP"),
    "report": Mode("bench.report", "docs/reports/benchmarks.md again from runs/bench/results.json"),
    "reliability-report": Mode(
        "bench.reliability_report", "docs/reports/reliability.md again from its results"
    ),
    "inputs": Mode("bench.inputs", "write the request bodies the modes send"),
    # one-question experiments
    "arena": Mode("bench.experiments.arena", "ONNX Runtime's CPU arena vs a worker's memory"),
    "batch-neighbours": Mode(
        "bench.experiments.batch_neighbours", "how far an answer moves with its batch's other rows"
    ),
    "client-batch": Mode("bench.experiments.client_batch", "client batches at N connections"),
    "clients": Mode(
        "bench.experiments.clients",
        "a 2,048-text request and a burst of 200, each beside its baseline",
    ),
    "cpu-split": Mode("bench.experiments.cpu_split", "where the CPU goes per request"),
    "graph-ab": Mode("bench.experiments.graph_ab", "two bundles' graphs, batch by batch"),
    "idle-gap": Mode("bench.experiments.idle_gap", "a batch-1 call back to back vs after idle"),
    "lone": Mode("bench.experiments.lone", "a lone request against the plain server"),
    "long-inputs": Mode(
        "bench.experiments.long_inputs", "long documents: chunks, late chunking, best-chunk rerank"
    ),
    "long-window": Mode(
        "bench.experiments.long_window", "ModernBERT's 8,192-token window through the service"
    ),
    "overload-stages": Mode(
        "bench.experiments.overload_stages", "where a request's time goes at 5x overload"
    ),
    "pretrain-throughput": Mode(
        "bench.experiments.pretrain_throughput", "training tokens/s of pre-training shapes"
    ),
    "rerank": Mode("bench.experiments.rerank", "/rerank against the CrossEncoder peer"),
    "sparse": Mode(
        "bench.experiments.retrieval.sparse", "/embed_sparse against /embed, same encoder"
    ),
    "multivector": Mode(
        "bench.experiments.retrieval.multivector", "/v1/multi-vector against /embed, same encoder"
    ),
    "heads": Mode(
        "bench.experiments.retrieval.heads", "/encode (dense + sparse) against the two calls"
    ),
    "protocols": Mode(
        "bench.experiments.frontdoors.protocols",
        "OIP REST and gRPC (OIP, TEI) against the JSON routes",
    ),
    "tracing": Mode(
        "bench.experiments.frontdoors.tracing", "/embed with every request traced against none"
    ),
    "deadlines": Mode(
        "bench.experiments.traffic.deadlines", "short timeouts into a queue seconds deep"
    ),
    "tenants": Mode(
        "bench.experiments.traffic.tenants", "two API keys past saturation: shares by weight"
    ),
    "mixed": Mode(
        "bench.experiments.traffic.mixed", "an indexer beside an interactive client, each alone"
    ),
    "topology": Mode("bench.experiments.topology", "workers vs one engine process, A/B"),
    "engine-choice": Mode(
        "bench.experiments.cpu.engine_choice", "ort, openvino and auto on one bundle, alternated"
    ),
    "static-int8": Mode(
        "bench.experiments.cpu.static_int8", "calibrated QDQ int8 against the shipped graph"
    ),
    "floor": Mode(
        "bench.experiments.cpu.floor", "a /classify's microseconds by step, lone and at 32"
    ),
}


def usage(prog: str) -> str:
    width = max(map(len, MODES))
    lines = [f"  {name:<{width}}  {mode.summary}" for name, mode in MODES.items()]
    return f"usage: {prog} MODE [--help | options]\n\n{__doc__}\nmodes:\n" + "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "python -m bench") -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(prog))
        return 0
    mode = MODES.get(argv[0])
    if mode is None:
        print(f"error: unknown mode {argv[0]!r}; modes: {', '.join(MODES)}", file=sys.stderr)
        return 2
    module = importlib.import_module(mode.module)
    # The modes parse sys.argv themselves (argparse), under the name the user typed.
    sys.argv = [f"{prog} {argv[0]}", *argv[1:]]
    result = module.main()
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
