"""bench/experiments/cpu: the floor profile's reading of py-spy's samples, and the engine-choice
check's verdict."""

from __future__ import annotations

import pytest

from bench.experiments.cpu.engine_choice import summarise
from bench.experiments.cpu.floor import REST, loop_samples, per_request_us, step_of

WORKER = (
    'process 10:"python -m bertserve.service";process 12:"python -c from multiprocessing.spawn'
    ' import spawn_main; spawn_main(tracker_fd=9) --multiprocessing-fork";thread (12): MainThread;'
    "<module> (<string>:1);Server.run (uvicorn/server.py:86);Runner.run (asyncio/runners.py:118)"
)


def sample(frames: str, count: int, head: str = WORKER) -> str:
    return f"{head};{frames} {count}"


def test_a_sample_goes_to_its_innermost_named_step():
    app = "FastPath.__call__ (service/http/fastpath.py:103)"
    assert step_of([app, "handle (service/handler.py:80)"]) == "handler, deadline, admission"
    # inside the handler, the tokeniser names the step, whatever calls it
    tokenise = [app, "_run (service/handler.py:250)", "tokenize (runtime/tasks/common.py:40)"]
    assert step_of(tokenise) == "tokenise"
    # the access log's line, written from the app's middleware
    logged = [app, "Logger.info (logging/__init__.py:1489)", "Logger._log (logging/__init__.py:9)"]
    assert step_of(logged) == "access log"
    model = ["Batcher._run_batch (runtime/batching.py:1)", "Session.run (onnxruntime/x.py:2)"]
    assert step_of(model) == "model run"
    assert step_of(["Runner.run (asyncio/runners.py:118)"]) == REST


def test_only_the_workers_event_loops_are_read():
    raw = "\n".join(
        [
            sample("FastPath.__call__ (service/http/fastpath.py:1)", 30),
            sample("tokenize (runtime/tasks/common.py:40)", 10),
            # the model's thread, and the supervisor's main thread (no uvicorn): not loops
            sample(
                "Session.run (onnxruntime/x.py:2)",
                50,
                'process 12:"python";thread (14): infer-student_0',
            ),
            sample(
                "Supervisor.run (service/process/supervisor.py:1)",
                5,
                'process 10:"python";thread (10): MainThread',
            ),
        ]
    )
    assert loop_samples(raw) == {"app: context, limits, fast path": 30, "tokenise": 10}


def test_a_steps_microseconds_are_its_share_of_the_loops_cpu():
    samples = loop_samples(
        "\n".join(
            [
                sample("FastPath.__call__ (service/http/fastpath.py:1)", 30),
                sample("tokenize (runtime/tasks/common.py:40)", 10),
            ]
        )
    )
    assert per_request_us(samples, 400.0) == {
        "tokenise": 100.0,
        "app: context, limits, fast path": 300.0,
    }
    with pytest.raises(ValueError, match="no event-loop thread"):
        per_request_us(loop_samples(""), 400.0)


def test_auto_is_judged_by_the_engine_it_chose_forced():
    rounds = [
        {"ort": 300.0, "openvino": 330.0, "auto": 310.0},
        {"ort": 310.0, "openvino": 320.0, "auto": 330.0},
        {"ort": 290.0, "openvino": 340.0, "auto": 320.0},
    ]
    right = summarise(rounds, "openvino")
    assert right["faster"] == "openvino" and right["chosen_vs_faster"] == 1.0
    assert right["passed"] and right["auto_arm_vs_faster"] == pytest.approx(320 / 330, abs=1e-3)
    wrong = summarise(rounds, "onnxruntime")  # kept ORT, 300 against 330: 9% slower
    assert wrong["auto_chose"] == "ort" and wrong["chosen_vs_faster"] == pytest.approx(
        0.909, abs=1e-3
    )
    assert not wrong["passed"]


def test_another_tree_is_served_from_its_own_code(tmp_path):
    """bench ab and cpu-split --tree start the other tree's service as bench.servers.from_tree
    says: started from the tree's own folder, its bertserve/ (no service/ in it) came first and
    the editable install's finder supplied this checkout's service."""
    import subprocess
    import sys

    from bench.servers import from_tree

    tree = tmp_path / "tree"
    (tree / "bertserve").mkdir(parents=True)
    (tree / "bertserve" / "__init__.py").write_text("")
    for folder in ("export", "model", "runtime", "service"):
        (tree / folder).mkdir()
        (tree / folder / "__init__.py").write_text(f"WHERE = {str(tree)!r}\n")
    (tree / "pyproject.toml").write_text(
        '[tool.setuptools.package-dir]\n"bertserve.service" = "service"\n'
    )
    launch = from_tree(tree, tmp_path / "work")
    assert launch.module == "bertserve.service"
    where = subprocess.run(
        [sys.executable, "-c", f"import {launch.module} as s; print(s.WHERE)"],
        cwd=launch.cwd,
        env=launch.env | {"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert where.stdout.strip() == str(tree)
    # from the tree's own folder this very import is the installed checkout's: no WHERE
    wrong = subprocess.run(
        [sys.executable, "-c", f"import {launch.module} as s; print(s.__file__)"],
        cwd=tree,
        env=launch.env | {"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert str(tree) not in wrong.stdout
