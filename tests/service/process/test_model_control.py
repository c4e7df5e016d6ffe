"""Models loaded, replaced and unloaded while the service runs (explicit model control,
service.control): across two real workers under steady traffic, with nothing lost, and in one
process for the management API's answers. Real bundles, real HTTP, real processes."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.server import free_port, live_server
from tests.service.process.test_process import start, wait_ready, worker_pids

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[3]
ADMIN = "admin-key-0123456789abcdef"
API = "api-key-0123456789abcdefgh"
AS_ADMIN = {"authorization": f"Bearer {ADMIN}"}
AS_USER = {"authorization": f"Bearer {API}"}


def add_bundle(repo: Path, source: Path, name: str, label_prefix: str = "") -> None:
    """`source` copied into the repository as bundle `name`; `label_prefix` makes another
    version of it (its labels renamed, so its answers tell the versions apart)."""
    target = repo / name
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target)
    spec = json.loads((target / "bundle.json").read_text())
    spec["name"], spec["default"] = name, False
    spec["labels"] = [label_prefix + label for label in spec["labels"]]
    (target / "bundle.json").write_text(json.dumps(spec))


@pytest.fixture
def repo(bundle_dir, tmp_path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    add_bundle(root, bundle_dir / "sentiment", "a")
    add_bundle(root, bundle_dir / "sentiment", "b")
    return root


def classify(client: httpx.Client, name: str) -> httpx.Response:
    return client.post(f"/classify?model={name}", json={"inputs": "a fine film"}, headers=AS_USER)


class Traffic:
    """`clients` threads sending /classify to one model until stopped: every status seen."""

    def __init__(self, url: str, name: str, clients: int) -> None:
        self.statuses: list[int] = []
        self.running = True
        self.threads = [threading.Thread(target=self.run, args=(url, name)) for _ in range(clients)]
        for thread in self.threads:
            thread.start()

    def run(self, url: str, name: str) -> None:
        with httpx.Client(base_url=url, timeout=30) as client:
            while self.running:
                self.statuses.append(classify(client, name).status_code)

    def stop(self) -> list[int]:
        self.running = False
        for thread in self.threads:
            thread.join()
        return self.statuses


def worker_rss_mb(pids: list[int]) -> list[float]:
    return [
        int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())[1]) / 1024
        for pid in pids
    ]


def test_load_replace_unload_across_workers_under_traffic(repo):
    """The issue's scenario: 2 workers, explicit control, 4 clients on model A throughout;
    load B, use it, replace B with another version, unload B; a worker started later loads the
    current set; unloading gives back what loading took."""
    (repo / "minilm-embed").symlink_to(ROOT / "bundles" / "minilm-embed")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start(
        repo,
        port,
        workers=2,
        model_control="explicit",
        load_at_start="a",
        admin_keys=ADMIN,
        api_keys=API,
        log_level="warning",  # its output is a pipe nobody reads: an access log would fill it
    )
    try:
        wait_ready(url, process)
        on_a = Traffic(url, "a", 4)
        with httpx.Client(base_url=url, timeout=120) as c:
            missing = classify(c, "b")
            assert missing.status_code == 404 and "'b' is not loaded" in missing.json()["error"]

            loaded = c.post("/models/b/load", headers=AS_ADMIN)
            assert loaded.status_code == 200, loaded.text
            assert loaded.json()["state"] == "ready" and loaded.json()["workers"] == 2
            first = [classify(c, "b") for _ in range(12)]  # connections spread over both
            assert all(r.status_code == 200 for r in first)
            assert not any(x["label"].startswith("v2-") for r in first for x in r.json())

            on_b = Traffic(url, "b", 2)
            add_bundle(repo, repo / "a", "b", label_prefix="v2-")
            replaced = c.post("/models/b/load", headers=AS_ADMIN)
            assert replaced.status_code == 200, replaced.text
            assert replaced.json()["version"] != loaded.json()["version"]
            after = [classify(c, "b") for _ in range(12)]
            assert all(x["label"].startswith("v2-") for r in after for x in r.json())
            b_statuses = on_b.stop()
            assert b_statuses and set(b_statuses) == {200}, b_statuses

            # A worker started later (here: in a killed one's place) loads the current set.
            os.kill(worker_pids(process.pid)[0], signal.SIGKILL)
            deadline = time.monotonic() + 60
            while len(worker_pids(process.pid)) < 2 or c.get("/health/ready").status_code != 200:
                assert time.monotonic() < deadline, "the killed worker was not replaced"
                time.sleep(0.2)
            time.sleep(1)  # the successor accepts once warm
            fresh = [
                httpx.post(f"{url}/classify?model=b", json={"inputs": "x"}, headers=AS_USER)
                for _ in range(12)
            ]
            assert all(r.status_code == 200 for r in fresh), [r.text for r in fresh]
            assert all(x["label"].startswith("v2-") for r in fresh for x in r.json())

            unloaded = c.post("/models/b/unload", headers=AS_ADMIN)
            assert unloaded.status_code == 200 and unloaded.json()["state"] == "unloaded"
            gone = classify(c, "b")
            assert gone.status_code == 404 and "'b' is not loaded" in gone.json()["error"]
            assert "['a']" in gone.json()["error"]  # what is served

            # Memory: what loading a MiniLM bundle added, unloading gives back (>= 80%).
            pids = worker_pids(process.pid)
            before = worker_rss_mb(pids)
            assert c.post("/models/minilm-embed/load", headers=AS_ADMIN).status_code == 200
            peak = worker_rss_mb(pids)
            assert c.post("/models/minilm-embed/unload", headers=AS_ADMIN).status_code == 200
            end = worker_rss_mb(pids)
            for b0, b1, b2 in zip(before, peak, end, strict=True):
                assert b1 - b0 > 50, (before, peak, end)
                assert b1 - b2 >= 0.8 * (b1 - b0), (before, peak, end)
            # Two changes at once, taken by either worker: both stand, in every worker.
            for name in ("c", "d"):
                add_bundle(repo, repo / "a", name)
            calls = [
                threading.Thread(
                    target=lambda n=name: httpx.post(
                        f"{url}/models/{n}/load", headers=AS_ADMIN, timeout=120
                    )
                )
                for name in ("c", "d")
            ]
            for call in calls:
                call.start()
            for call in calls:
                call.join()
            for _ in range(8):  # new connections: both workers answer
                seen = httpx.get(f"{url}/models", headers=AS_USER).json()
                assert [m["name"] for m in seen] in (["a", "c", "d"], ["a", "d", "c"]), seen
            for name in ("c", "d"):
                assert c.post(f"/models/{name}/unload", headers=AS_ADMIN).status_code == 200
            models = c.get("/models", headers=AS_USER).json()
            metrics = c.get("/metrics").text
        a_statuses = on_a.stop()
        assert len(a_statuses) > 50 and set(a_statuses) == {200}, set(a_statuses)
        assert [m["name"] for m in models] == ["a"] and models[0]["state"] == "ready"
        assert 'bertserve_model_loaded{model="b"} 0.0' in metrics
        assert 'bertserve_model_loaded{model="a"} 1.0' in metrics
        assert 'bertserve_model_events_total{event="replaced",model="b"}' in metrics
        assert 'bertserve_model_load_seconds_count{model="minilm-embed"} 2.0' in metrics
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


@pytest.fixture
def managed(repo):
    with live_server(
        bundles=repo, model_control="explicit", load_at_start="a", admin_keys=ADMIN, api_keys=API
    ) as live:
        yield live


def test_the_management_api_asks_for_an_admin_key(managed):
    with managed.client() as c:
        assert c.post("/models/b/load").status_code == 401
        wrong = c.post("/models/b/load", headers={"authorization": "Bearer " + "x" * 20})
        assert wrong.status_code == 401 and "admin key" in wrong.json()["error"]
        user = c.post("/models/b/load", headers=AS_USER)
        assert user.status_code == 403 and "an API key cannot" in user.json()["error"]
        # The router's `$` matches before a trailing newline: still a management call.
        for tail in ("%0A", "%0a", "/", "%20"):
            assert c.post(f"/models/b/load{tail}", headers=AS_USER).status_code == 403
            assert c.post(f"/models/b/unload{tail}").status_code == 401
        assert [m["name"] for m in c.get("/models", headers=AS_USER).json()] == ["a"]
        # The admin key is not an API key, and GET /models reads with an API key as before.
        assert c.get("/models", headers=AS_ADMIN).status_code == 401
        assert [m["name"] for m in c.get("/models", headers=AS_USER).json()] == ["a"]


def test_management_refuses_in_one_line(managed, repo):
    with managed.client() as c:
        # A repository model that is not loaded and would not serve the route either: says so.
        wrong = c.post("/ner?model=b", json={"inputs": "Paris"}, headers=AS_USER)
        assert wrong.status_code == 404 and "has no ner head" in wrong.json()["error"]
        unknown = c.post("/models/zz/load", headers=AS_ADMIN)
        assert unknown.status_code == 404 and "['a', 'b']" in unknown.json()["error"]
        assert c.post("/models/..a/load", headers=AS_ADMIN).status_code == 404
        # A name with a slash: under /models/ all the same (an admin key; then no route).
        assert c.post("/models/..%2Fa/load", headers=AS_ADMIN).status_code == 404
        assert c.post("/models/..%2Fa/load", headers=AS_USER).status_code == 403
        idle = c.post("/models/b/unload", headers=AS_ADMIN)
        assert idle.status_code == 404 and "'b' is not loaded" in idle.json()["error"]
        # A bundle that cannot load: 422 with why; a loaded model of that name serves on.
        spec = json.loads((repo / "a" / "bundle.json").read_text())
        (repo / "a" / "bundle.json").write_text(json.dumps({**spec, "model_sha256": "0" * 64}))
        broken = c.post("/models/a/load", headers=AS_ADMIN)
        assert broken.status_code == 422 and "sha256" in broken.json()["error"], broken.text
        assert classify(c, "a").status_code == 200
        listed = c.get("/models", headers=AS_USER).json()
        assert listed[0]["state"] == "ready" and "replacement failed" in listed[0]["reason"]
        # Rolled back (the old files again): the same version, loaded, its failure forgotten.
        (repo / "a" / "bundle.json").write_text(json.dumps(spec))
        restored = c.post("/models/a/load", headers=AS_ADMIN)
        assert restored.status_code == 200 and restored.json()["reason"] is None, restored.text
        # Named as another bundle: refused before anything loads.
        spec_b = json.loads((repo / "b" / "bundle.json").read_text())
        (repo / "b" / "bundle.json").write_text(json.dumps({**spec_b, "name": "c"}))
        misnamed = c.post("/models/b/load", headers=AS_ADMIN)
        assert misnamed.status_code == 422 and "named as its bundle" in misnamed.json()["error"]
        assert [m["state"] for m in c.get("/models", headers=AS_USER).json()] == [
            "ready",
            "failed",
        ]


def test_the_defaults_follow_the_loaded_set(managed, repo):
    """A route without ?model= goes to the first loaded model of its task; when that one is
    unloaded, to the next; with none, a 404 that says so."""
    with managed.client() as c:
        assert c.post("/models/b/load", headers=AS_ADMIN).status_code == 200
        body = {"inputs": "a fine film"}
        assert c.post("/classify", json=body, headers=AS_USER).status_code == 200
        served = c.get("/models", headers=AS_USER).json()
        assert [m["default_for"] for m in served] == [["classify"], []]
        assert c.post("/models/a/unload", headers=AS_ADMIN).status_code == 200
        served = c.get("/models", headers=AS_USER).json()
        assert [(m["name"], m["default_for"]) for m in served] == [("b", ["classify"])]
        assert c.post("/models/b/unload", headers=AS_ADMIN).status_code == 200
        none = c.post("/classify", json=body, headers=AS_USER)
        assert none.status_code == 404
        assert "no loaded bundle serves classify" in none.json()["error"]
        assert c.get("/health/ready").status_code == 200  # an empty set is a state, not a fault


def test_static_control_and_no_admin_keys_keep_the_api_off(bundle_dir):
    with live_server(bundles=bundle_dir, admin_keys=ADMIN) as live, live.client() as c:
        static = c.post("/models/sentiment/unload", headers=AS_ADMIN)
        assert static.status_code == 409 and "MODEL_CONTROL=explicit" in static.json()["error"]
    with live_server(bundles=bundle_dir) as live, live.client() as c:
        off = c.post("/models/sentiment/unload")
        assert off.status_code == 403 and "BERTSERVE_ADMIN_KEYS" in off.json()["error"]


def test_a_memory_budget_loads_on_demand_and_unloads_the_least_recently_used(repo, monkeypatch):
    """With model_memory_mb a request for a repository model that is not loaded waits for its
    load; the least recently used models are unloaded to fit (here a budget of one model, so
    each load unloads the others); requests that arrive together share one load."""
    from bertserve.service import control

    add_bundle(repo, repo / "a", "c")
    # A model used in the last 10 s stays, however tight the budget: here, none stays.
    monkeypatch.setattr(control, "MIN_RESIDENCE_S", 0.0)
    with live_server(
        bundles=repo,
        model_control="explicit",
        load_at_start="a",
        admin_keys=ADMIN,
        api_keys=API,
        model_memory_mb=0.001,
        # The subject is the loads: the overload bounds, estimated from the rate of a model
        # loaded a moment ago, refused one of the four requests (429) on a busy 2-core CI
        # machine, and are tested on their own (tests/runtime/test_batching.py).
        max_queue_wait_ms=0,
        max_queue_time_ms=0,
    ) as live:
        with live.client() as c:
            assert classify(c, "b").status_code == 200
            assert [m["name"] for m in c.get("/models", headers=AS_USER).json()] == ["b"]
            assert classify(c, "a").status_code == 200
            assert [m["name"] for m in c.get("/models", headers=AS_USER).json()] == ["a"]
        statuses: list[int] = []

        def ask() -> None:
            with live.client() as client:
                statuses.append(classify(client, "c").status_code)

        threads = [threading.Thread(target=ask) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        with live.client() as c:
            metrics = c.get("/metrics").text
            assert [m["name"] for m in c.get("/models", headers=AS_USER).json()] == ["c"]
            assert classify(c, "zz").status_code == 404  # not in the repository: no load
    assert statuses == [200] * 4
    assert 'bertserve_model_events_total{event="loaded",model="c"} 1.0' in metrics
    assert 'bertserve_model_events_total{event="unloaded",model="a"} 2.0' in metrics
