"""Same-minute A/B of two versions of bertserve serving the same ONNX models, endpoint by endpoint.

    git worktree add /tmp/ab/s2 02a7117          # the old code, with its own bundles
    bertserve bench ab --old /tmp/ab/s2 --endpoints ner,qa,fill-mask,nsp --rounds 2

An old tree whose bundles are already format 2 is served as it is (a recent commit, given the
current models under its bundles/, for an A/B of one change on those models).

Each side runs the service from its own tree (bench.servers.from_tree: a tree from before the
one import name runs as `python -m service`, a later one through links named `bertserve.*`; it
must serve /classify, the readiness check) at its default settings, one side at a time, alternating
the order every round; wrk drives each endpoint closed-loop at each concurrency. The old tree
serves its own `bundles/`; this tree serves the same model files under bundle.json format 2
(`as_format_2`), so only the code differs. Machine load matters more than anything here: pause
training first (`kill -STOP`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

from bench.inputs import write_bodies
from bench.loadgen import closed_loop
from bench.servers import OURS, from_tree, serve

ROOT = Path(__file__).resolve().parents[1]
PORT = 8123
# format 1 had no output axes: they follow from the outputs' names
AXES = {
    "logits": None,
    "start_logits": "token",
    "end_logits": "token",
    "mlm_logits": "mask",
    "nsp_logits": "sequence",
}


def as_format_2(src: Path, dst: Path) -> None:
    """A bundle as format 2 in `dst`: a format-1 one upgraded, a format-2 one as it is (the
    service refuses files linked from outside a bundle, so the files are copied)."""
    spec = json.loads((src / "bundle.json").read_text())
    if spec["format_version"] == 2:  # an old tree as recent as this one: served as it is
        shutil.copytree(src, dst, dirs_exist_ok=True)
        return
    if spec["format_version"] != 1:
        raise ValueError(f"{src}: format {spec['format_version']}, not 1")
    dst.mkdir(parents=True, exist_ok=True)
    for name in (spec.get("model_file", "model.onnx"), spec["tokenizer"]["file"]):
        shutil.copyfile(src / name, dst / name)
    model = (src / spec.get("model_file", "model.onnx")).read_bytes()
    axes = {}
    for out in spec["outputs"]:
        axes[out] = AXES[out] or ("token" if "ner" in spec["tasks"] else "sequence")
    spec |= {
        "format_version": 2,
        "model_sha256": hashlib.sha256(model).hexdigest(),
        "output_axes": axes,
    }
    (dst / "bundle.json").write_text(json.dumps(spec, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", type=Path, required=True, help="the old source tree")
    parser.add_argument("--endpoints", default="ner,qa,fill-mask,nsp")
    parser.add_argument("--levels", default="32")
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "ab")
    args = parser.parse_args()

    args.old, args.work = args.old.resolve(), args.work.resolve()  # served from other folders
    new_bundles = args.work / "bundles-v2"
    for bundle in sorted((args.old / "bundles").glob("*/bundle.json")):
        as_format_2(bundle.parent, new_bundles / bundle.parent.name)
    sides = {"old": (args.old, args.old / "bundles"), "new": (ROOT, new_bundles)}
    endpoints = args.endpoints.split(",")
    bodies = {e: write_bodies(e, args.data, args.work / "inputs") for e in endpoints}
    levels = [int(x) for x in args.levels.split(",")]
    results: dict[str, list[dict]] = {}
    ready = b'{"inputs": "a charming film"}'  # both trees must serve /classify
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            tree, bundles = sides[name]
            launch = from_tree(tree, args.work)
            env = launch.env | {"BERTSERVE_LOG_LEVEL": "warning"}
            log = args.work / f"server-{name}.log"
            with serve(
                OURS, bundles, bundles, PORT, ready, log, env, cwd=launch.cwd, module=launch.module
            ):
                for endpoint in endpoints:
                    url = f"http://127.0.0.1:{PORT}/{endpoint}"
                    closed_loop(url, bodies[endpoint], 8, 2)  # warm-up
                    for c in levels:
                        res = closed_loop(url, bodies[endpoint], c, args.seconds)
                        results.setdefault(f"{endpoint} c={c} {name}", []).append(
                            {
                                "ok_per_s": round(res.throughput, 1),
                                "statuses": res.statuses,
                                "errors": res.errors,
                                "p50_ms": round(res.p50_ms, 2),
                            }
                        )
            print(json.dumps({"round": r, "side": name}), flush=True)
    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / "ab.json").write_text(json.dumps(results, indent=2) + "\n")
    print("| endpoint | concurrency | old req/s | new req/s | new / old |")
    print("|---|---|---|---|---|")
    for endpoint in endpoints:
        for c in levels:
            old = [x["ok_per_s"] for x in results[f"{endpoint} c={c} old"]]
            new = [x["ok_per_s"] for x in results[f"{endpoint} c={c} new"]]
            ratio = (sum(new) / len(new)) / max(sum(old) / len(old), 1e-9)
            print(
                f"| /{endpoint} | {c} | {' / '.join(f'{x:,.0f}' for x in old)} | "
                f"{' / '.join(f'{x:,.0f}' for x in new)} | {ratio:.2f}x |"
            )


if __name__ == "__main__":
    main()
