"""The front doors against the JSON routes, same server, same minute (each pair alternating
first each round, best round of each): the Open Inference Protocol's REST infer against
/classify on the student classifier, driven by wrk at each level of connections; and
client batches of 32 embeddings over gRPC (OIP ModelInfer with 32 texts, TEI's EmbedStream of 32
messages) against /embed with 32 inputs over HTTP (wrk).

    bertserve bench protocols --report docs/reports/protocols.md

The gRPC side is driven by this process (grpc.aio, one channel a connection): its own CPU is
printed beside the numbers, since on two cores it takes time from the server. perf_analyzer,
which the issue names as the outside tool for the OIP side, is not on PyPI here (`perf-analyzer`
0.1.0 is an empty placeholder), so wrk, which nobody here wrote either, drives OIP's REST route.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import time
from pathlib import Path

from bench.experiments.retrieval.side_by_side import SETTLE_S, report
from bench.inputs import write_bodies
from bench.loadgen import closed_loop
from bench.servers import OURS, linked_bundles, serve

BATCH = 32


def oip_body(texts: list[str], parameters: dict | None = None) -> dict:
    body = {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [len(texts)], "data": texts}]}
    return body | ({"parameters": parameters} if parameters else {})


def bodies(data: Path, work: Path) -> tuple[dict[str, Path], list[list[str]]]:
    """The files wrk replays (the same sentences in each schema) and the batches of 32."""
    single = write_bodies("classify", data, work / "inputs")
    texts = [json.loads(line)["inputs"] for line in single.read_text().splitlines() if line]
    batches = [texts[i : i + BATCH] for i in range(0, len(texts) - BATCH + 1, BATCH)]
    files = {
        "/classify": [{"inputs": t, "parameters": {"truncation": True}} for t in texts],
        "oip-classify": [oip_body([t], {"truncation": True}) for t in texts],
        "/embed": [{"inputs": b, "truncate": True} for b in batches],
    }
    out = {}
    for name, items in files.items():
        out[name] = work / f"{name.strip('/')}.jsonl"
        out[name].write_text("\n".join(json.dumps(b) for b in items) + "\n")
    return out, batches


async def grpc_loop(
    target: str, kind: str, model: str, batches: list[list[str]], connections: int, seconds: float
) -> dict:
    """`connections` channels, each sending its next batch once the last is answered, for
    `seconds`: batches answered a second, and this process's CPU meanwhile."""
    import grpc

    from bertserve.service.grpc import grpc_predict_v2_pb2 as oip
    from bertserve.service.grpc import grpc_predict_v2_pb2_grpc as oip_grpc
    from bertserve.service.grpc import tei_pb2 as tei
    from bertserve.service.grpc import tei_pb2_grpc as tei_grpc

    def oip_request(texts: list[str]):
        tensor = oip.ModelInferRequest.InferInputTensor(
            name="TEXT", datatype="BYTES", shape=[len(texts)]
        )
        raw = b"".join(len(t.encode()).to_bytes(4, "little") + t.encode() for t in texts)
        truncate = {"truncate": oip.InferParameter(bool_param=True)}
        return oip.ModelInferRequest(
            model_name=model, inputs=[tensor], raw_input_contents=[raw], parameters=truncate
        )

    done, errors = 0, 0
    deadline = time.monotonic() + seconds

    async def worker(i: int) -> None:
        nonlocal done, errors
        async with grpc.aio.insecure_channel(target) as channel:
            infer = oip_grpc.GRPCInferenceServiceStub(channel).ModelInfer
            embed = tei_grpc.EmbedStub(channel)
            n = i
            while time.monotonic() < deadline:
                texts = batches[n % len(batches)]
                n += connections
                try:
                    if kind == "oip":
                        await infer(oip_request(texts))
                    else:
                        stream = embed.EmbedStream(
                            iter(
                                [
                                    tei.EmbedRequest(inputs=t, truncate=True, normalize=True)
                                    for t in texts
                                ]
                            )
                        )
                        count = 0
                        async for _ in stream:
                            count += 1
                        assert count == len(texts)
                    done += 1
                except grpc.aio.AioRpcError:
                    errors += 1

    cpu = resource.getrusage(resource.RUSAGE_SELF)
    started = time.monotonic()
    await asyncio.gather(*(worker(i) for i in range(connections)))
    elapsed = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    used = (after.ru_utime - cpu.ru_utime) + (after.ru_stime - cpu.ru_stime)
    return {
        "throughput": done / elapsed,
        "errors": errors,
        "client_cpu_pct": 100 * used / elapsed,
        "statuses": {"200": done, **({"error": errors} if errors else {})},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--classifier", type=Path, default=Path("bundles/sst2-distilled-2x192"))
    parser.add_argument("--embedder", type=Path, default=Path("bundles/minilm-embed"))
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--levels", default="1,32")
    parser.add_argument("--batch-levels", default="1,4")
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=8197)
    parser.add_argument("--grpc-port", type=int, default=8198)
    parser.add_argument("--work", type=Path, default=Path("runs/bench-protocols"))
    parser.add_argument("--report", type=Path, default=None)
    args = parser.parse_args()
    files, batches = bodies(args.data, args.work)
    bundles = linked_bundles([args.classifier, args.embedder], args.work / "bundles")
    classifier, embedder = args.classifier.name, args.embedder.name
    first = json.dumps({"inputs": "warm up"}).encode()
    env = {"BERTSERVE_GRPC_PORT": str(args.grpc_port)}
    runs: dict[tuple[str, str, int], list[dict]] = {}

    def keep(kind: str, route: str, level: int, result: dict) -> None:
        runs.setdefault((kind, route, level), []).append(result)
        print(json.dumps({"kind": kind, "route": route, "level": level} | result))

    with serve(
        OURS,
        bundles,
        bundles / classifier,
        args.port,
        first,
        args.work / "server.log",
        env=env,
        ready_path=f"/classify?model={classifier}",
    ) as server:
        json_url = f"{server.base}/classify?model={classifier}"
        oip_url = f"{server.base}/v2/models/{classifier}/infer"
        embed_url = f"{server.base}/embed?model={embedder}"
        target = f"127.0.0.1:{args.grpc_port}"
        for round_ in range(args.rounds):
            pair = [("/classify", json_url), ("oip-classify", oip_url)]
            for level in (int(x) for x in args.levels.split(",")):
                for route, url in pair if round_ % 2 == 0 else pair[::-1]:
                    closed_loop(url, files[route], 1, 2)
                    time.sleep(SETTLE_S)
                    load = closed_loop(url, files[route], level, args.seconds)
                    keep("single", route, level, load.to_dict())
            sides = ["/embed", "oip", "tei"]
            for level in (int(x) for x in args.batch_levels.split(",")):
                for side in sides if round_ % 2 == 0 else sides[::-1]:
                    time.sleep(SETTLE_S)
                    if side == "/embed":
                        closed_loop(embed_url, files["/embed"], 1, 2)
                        load = closed_loop(embed_url, files["/embed"], level, args.seconds)
                        keep("batch", side, level, load.to_dict())
                    else:
                        asyncio.run(grpc_loop(target, side, embedder, batches, 1, 2))
                        result = asyncio.run(
                            grpc_loop(target, side, embedder, batches, level, args.seconds)
                        )
                        keep("batch", side, level, result)
    best = {k: max(v, key=lambda x: x["throughput"]) for k, v in runs.items()}
    table = [
        "| what | connections | JSON route req/s | front door req/s | front door / JSON | "
        "client CPU, front door |",
        "|---|---|---|---|---|---|",
    ]
    for level in (int(x) for x in args.levels.split(",")):
        a, b = best[("single", "/classify", level)], best[("single", "oip-classify", level)]
        table.append(
            f"| one text: OIP REST infer vs /classify (wrk) | {level} | {a['throughput']:.1f} | "
            f"{b['throughput']:.1f} | {b['throughput'] / a['throughput']:.2f}x | "
            f"{b['client_cpu_pct']:.0f}% (wrk) |"
        )
    for level in (int(x) for x in args.batch_levels.split(",")):
        base = best[("batch", "/embed", level)]
        for side, name in (("oip", "OIP gRPC ModelInfer"), ("tei", "TEI gRPC EmbedStream")):
            got = best[("batch", side, level)]
            table.append(
                f"| 32 texts: {name} vs /embed (wrk) | {level} | {base['throughput']:.2f} | "
                f"{got['throughput']:.2f} | {got['throughput'] / base['throughput']:.2f}x | "
                f"{got['client_cpu_pct']:.0f}% (this process) |"
            )
    command = f"bertserve bench protocols --batch-levels {args.batch_levels}"
    report(
        "Front doors: the Open Inference Protocol and gRPC against the JSON routes",
        command,
        args,
        f"one server (BERTSERVE_GRPC_PORT set) holding `{classifier}` and `{embedder}`, each "
        "pair alternating first each round, best of the rounds. One text: SST-2 sentences, one a "
        "request. 32 texts: the same sentences 32 to a request, truncated at the model's length.",
        table,
        runs,
        after=[
            "",
            "Each ratio is the front door's best round against the JSON route's, same server, "
            "same minute. A TEI EmbedStream of 32 messages is 32 requests (each admitted, "
            "validated and answered on its own, batched together in the model), where /embed "
            "and ModelInfer are one request of 32 texts: the stream pays the per-request cost "
            "32 times. perf_analyzer could not be run: `perf-analyzer` on PyPI is an empty "
            "placeholder (0.1.0).",
        ],
    )


if __name__ == "__main__":
    main()
