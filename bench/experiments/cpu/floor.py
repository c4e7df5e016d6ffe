"""The per-request floor: what one /classify costs the server beside its model call, step by
step (HTTP read and parse, JSON, validation, tokenising, queue, batch assembly, the model's
run, decoding the answer, writing it, the access log), in microseconds a request: for a lone
request (one connection) and at saturation (32).

    bertserve bench floor --bundle sst2-distilled-2x192 [--seconds 8] [--rounds 2] \
        [--out docs/reports/floor.md]

Each round serves the bundle alone (bench.servers) and, at each level (one connection, then
32), runs:
1. a closed-loop wrk run, unprofiled: each thread's CPU from /proc
   (bench.experiments.cpu_split.measure) gives the event loops' and the model threads' CPU a
   request, the requests/s and their p50;
2. the same load with py-spy sampling every serving process at `--rate`: its samples of the
   event-loop threads, each stack put in the step of its innermost frame that names one
   (STEPS). A step's share of the loops' samples times the loops' CPU a request of run 1 is
   that step's microseconds (py-spy's own CPU slows run 2, which is why run 1 is separate).
A lone request's model call runs on the event loop's own thread (the lone session), so at one
connection the loop's steps include the model's run; at 32 the model runs on its own thread
and its CPU is a line of its own. py-spy counts a thread that is running or waiting for a
core: at 32 connections two cores carry more threads than they have, and a step that ends in
a system call (a write, getrandom) is where the loop tends to lose its core, so those steps
read high there. After the server stops, the raw ceiling (bench.ceiling) in this process gives
the model's own CPU a sequence at its best batch and its batch-1 call. Needs py-spy (the dev
extra) and wrk; pause any background job first.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.ceiling import measure as raw_ceiling
from bench.experiments.cpu_split import measure
from bench.inputs import write_bodies
from bench.loadgen import closed_loop
from bench.run import commit, machine
from bench.servers import OURS, only_bundles, serve

ROOT = Path(__file__).resolve().parents[3]
PORT = 8133

# (step, what a frame "function (file)" contains): a sample's step is that of the first frame
# from its leaf up that matches one; within a frame the first step listed wins.
STEPS: list[tuple[str, tuple[str, ...]]] = [
    ("access log", ("(logging/", "(service/logs.py)")),
    ("metrics", ("(prometheus_client/", "(service/metrics.py)")),
    ("request id", ("uuid4 (",)),
    ("model run", ("Session.run (", "Engine.run (", "OpenVINOSession.run (")),
    ("tokenise", ("tokenize (runtime/tasks/common.py)", "TaskContext.encode (")),
    ("validate (pydantic)", ("(pydantic/", "model_validate")),
    ("JSON decode", ("loads (json/",)),
    ("rows from tokens", ("Task.plan (", "preprocess (", "prepare (")),
    ("answer: labels, scores, JSON", ("finish (service/handler.py)",)),
    (
        "batch assembly and hand-off",
        ("Batcher._loop", "Batcher._select", "Batcher._run_batch", "Batcher._call", "pad_rows"),
    ),
    ("queue in, wait, results out", ("submit (service/handler.py)", "Batcher.enqueue", "gather (")),
    (
        "write the answer",
        (
            "_Prefix.write (",
            "Response.__call__",
            "send_with_id",
            "OneWriteCycle.send",
            "RequestResponseCycle.send",
        ),
    ),
    # wrk closes its connections at the end of a run: the requests in flight are answered 499
    ("refusals and 499s", ("(service/http/errors.py)",)),
    (
        "read and parse HTTP",
        (
            "data_received",
            "on_headers_complete",
            "on_body",
            "on_message_begin",
            "on_message_complete",
            "on_url",
            "GuardedProtocol.",
            "_Collect.",
            "declared_size (",
        ),
    ),
    ("handler, deadline, admission", ("(service/handler.py)", "(service/state.py)")),
    ("app: context, limits, fast path", ("(service/http/",)),
]
REST = "event loop and the rest"
LINE = re.compile(r":\d+\)$")


def step_of(frames: list[str]) -> str:
    """The step of one sampled stack (its frames root first, "function (file:line)")."""
    for frame in reversed(frames):
        frame = LINE.sub(")", frame)
        for step, marks in STEPS:
            if any(mark in frame for mark in marks):
                return step
    return REST


def loop_samples(raw: str) -> collections.Counter[str]:
    """py-spy's raw output (`--format raw --threads --subprocesses`: "process ...;thread (TID):
    NAME;frame;... COUNT" a line): the event-loop threads' samples by step. A loop is a
    worker's MainThread, under uvicorn's Server.run; the supervisor serves no request."""
    steps: collections.Counter[str] = collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        parts = stack.split(";")  # a process's command line may hold one too
        at = next((i for i, p in enumerate(parts) if p.startswith("thread (")), None)
        if at is None or not parts[at].endswith("MainThread"):
            continue
        frames = parts[at + 1 :]
        if not any(f.startswith("Server.run (uvicorn/") for f in frames):
            continue
        steps[step_of(frames)] += int(count)
    return steps


def per_request_us(samples: collections.Counter[str], loops_us: float) -> dict[str, float]:
    """Each step's share of the loops' samples times the loops' CPU a request."""
    total = sum(samples.values())
    if not total:
        raise ValueError("py-spy sampled no event-loop thread: is the server running?")
    order = [step for step, _ in STEPS] + [REST]
    return {s: loops_us * samples[s] / total for s in order if samples[s]}


def py_spy() -> str:
    """py-spy's command: the virtualenv's (not on PATH when it is not activated), else PATH's."""
    beside = Path(sys.executable).parent / "py-spy"
    spy = str(beside) if beside.exists() else shutil.which("py-spy")
    if spy is None:
        raise SystemExit("py-spy is not installed: pip install -c constraints.txt -e '.[dev]'")
    return spy


def profile(
    pid: int, url: str, bodies: Path, connections: int, seconds: float, rate: int, out: Path
) -> str:
    """py-spy's raw samples of the server's processes under `seconds` of closed-loop load."""
    record = [
        py_spy(),
        "record",
        "--pid",
        str(pid),
        "--subprocesses",
        "--threads",
        "--nonblocking",  # the server is not paused to be sampled
        "--format",
        "raw",
        "--rate",
        str(rate),
        "--duration",
        str(round(seconds) + 2),
        "--output",
        str(out),
    ]
    errors = out.with_suffix(".stderr")
    with open(errors, "wb") as stderr:
        spy_proc = subprocess.Popen(record, stdout=subprocess.DEVNULL, stderr=stderr)
        time.sleep(1)  # attached before the load starts
        closed_loop(url, bodies, connections, seconds)
        code = spy_proc.wait(timeout=60)
    if code != 0 or not out.exists():  # e.g. no ptrace permission (CAP_SYS_PTRACE in a container)
        said = errors.read_text(errors="replace").strip()[-500:]
        raise SystemExit(f"py-spy record failed (exit {code}): {said}")
    return out.read_text()


LEVELS = (1, 32)


def table(rounds: list[dict], level: int, ceiling: dict) -> str:
    """The report's table at `level` connections: the median microseconds a request per step
    over the rounds."""
    at = [r["levels"][str(level)] for r in rounds]
    steps = [s for s, _ in STEPS] + [REST]
    med = {s: statistics.median(a["loop_steps_us"].get(s, 0.0) for a in at) for s in steps}
    loops = statistics.median(a["cpu"]["us_per_answer"]["loops"] for a in at)
    model = statistics.median(a["cpu"]["us_per_answer"]["other threads"] for a in at)
    rps = statistics.median(a["cpu"]["rps"] for a in at)
    lines = [
        f"| step, on the event loop ({level} connection{'s' if level > 1 else ''}) "
        "| us a request | share of the loop |",
        "|---|---|---|",
        *(
            f"| {s} | {med[s]:.0f} | {100 * med[s] / loops:.0f}% |"
            for s in sorted(steps, key=lambda s: -med[s])
            if med[s] >= 0.5
        ),
        f"| **event loop, all** | **{loops:.0f}** | 100% |",
        f"| other threads (ORT's, the batch thread) | {model:.0f} | |",
        f"| requests/s | {rps:,.0f} | |",
    ]
    if level == 1:
        lone = statistics.median(a["p50_ms"] for a in at)
        lines.append(
            f"| p50 ms (the model's batch-1 call: {ceiling['single_ms']:.3f}) | {lone:.2f} | |"
        )
    else:
        lines.append(
            f"| the raw ceiling's CPU a sequence (batch {ceiling['best_batch']}; "
            f"{ceiling['sequences_per_s']:,.0f} sequences/s) | "
            f"{ceiling['cpu_us_per_sequence']:.0f} | |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundles", type=Path, default=ROOT / "bundles")
    parser.add_argument("--bundle", default="sst2-distilled-2x192")
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rate", type=int, default=100, help="py-spy's samples a second")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-floor")
    parser.add_argument("--out", type=Path, default=None, help="also write the tables here")
    args = parser.parse_args()

    py_spy()  # before any server starts
    bundles = only_bundles(args.bundles, [args.bundle], args.work / "bundles")
    bodies = write_bodies("classify", args.data, args.work / "inputs")
    ready = bodies.read_text().split("\n")[0].encode()
    rounds = []
    for r in range(args.rounds):
        log = args.work / f"server-{r}.log"
        row: dict = {"round": r, "levels": {}}
        with serve(OURS, bundles, bundles / args.bundle, PORT, ready, log) as s:
            url = s.url("classify")
            closed_loop(url, bodies, 32, 2)  # warm
            for c in LEVELS:
                cpu = measure(s.base, url, s.proc.pid, bodies, c, args.seconds)
                spy = args.work / f"spy-{r}-{c}.txt"
                samples = loop_samples(
                    profile(s.proc.pid, url, bodies, c, args.seconds, args.rate, spy)
                )
                row["levels"][str(c)] = {
                    "cpu": cpu,
                    "p50_ms": cpu["p50_ms"],
                    "loop_samples": dict(samples),
                    "loop_steps_us": per_request_us(samples, cpu["us_per_answer"]["loops"]),
                }
        rounds.append(row)
        (args.work / "rounds.json").write_text(json.dumps(rounds, indent=1))  # kept if one fails
        print(json.dumps(row), flush=True)
    ceiling = raw_ceiling(bundles / args.bundle, bodies, seconds=2)
    text = "\n\n".join(table(rounds, c, ceiling) for c in LEVELS)
    summary = {
        "bundle": args.bundle,
        "machine": machine(),
        "commit": commit(),
        "ceiling_sequences_per_s": round(ceiling["sequences_per_s"], 1),
        "model_batch1_ms": round(ceiling["single_ms"], 3),
    }
    print(text)
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(text + "\n\n" + json.dumps(summary, indent=1) + "\n")
    (args.work / "results.json").write_text(json.dumps({"rounds": rounds, **summary}, indent=1))


if __name__ == "__main__":
    main()
