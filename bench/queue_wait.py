"""How the queued-time admission budget shapes latency under overload: the overload scenario of
`make reliability` (5x the measured saturation, open loop) once per BERTSERVE_MAX_QUEUE_WAIT_MS.

    python -m bench.queue_wait --values 500,250 --seconds 30

One server process per value (default settings otherwise), the values alternated over
`--rounds`, the same bodies (SST-2 dev, the 2 x 192 student). Prints one Markdown row a run:
what was answered 200 and how fast, how many answers of any status took over 1 s.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.inputs import write_bodies
from bench.reliability import PORT, overload
from bench.servers import OURS, only_bundles, serve

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--values", default="500,250", help="milliseconds, comma-separated")
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--bundles", type=Path, default=ROOT / "bundles")
    parser.add_argument("--classify-bundle", default="sst2-distilled-2x192")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "queue-wait")
    args = parser.parse_args()
    bodies = write_bodies("classify", args.data, args.work / "inputs")
    ready = bodies.read_text().splitlines()[0].encode()
    bundles = only_bundles(args.bundles, [args.classify_bundle], args.work / "bundles")
    values = args.values.split(",")
    rows = []
    print(
        "| max queue wait | saturation | 200/s during | 200 p50 / p99 | all p99 | over 1 s | "
        "errors | first second after |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in range(args.rounds):
        for value in values if r % 2 == 0 else list(reversed(values)):
            env = {"BERTSERVE_MAX_QUEUE_WAIT_MS": value}
            log = args.work / f"server-{value}.log"
            with serve(OURS, bundles, bundles / args.classify_bundle, PORT, ready, log, env) as s:
                res = overload(s, bodies, args.seconds)
            ok = res["by_status"].get("200", {})
            answered = sum(res["statuses"].values())
            rows.append({"max_queue_wait_ms": int(value), **res})
            print(
                f"| {value} ms | {res['saturation']:,.0f} | {res['answered_200_per_s']:,.0f} | "
                f"{ok.get('p50_ms', 0):,.0f} / {ok.get('p99_ms', 0):,.0f} ms | "
                f"{res['p99_ms']:,.0f} ms | {res['over_1s']:,} of {answered:,} | "
                f"{res['socket_errors']} | {res['recovery_per_s'][0]:,.0f} |",
                flush=True,
            )
    (args.work / "queue-wait.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
