"""The frameworks' default calls against a real server: langchain, llama-index (OpenAI and TEI
embeddings, sync and async; TEI rerank), haystack's TEI embedder and ranker, litellm (embedding
and rerank) and chromadb's HuggingFaceEmbeddingServer, each in its own process from its own
virtualenv (`make clients`: tests/clients/requirements.txt), each with its defaults. Each job
indexes 2,000 SST-2 sentences; every vector must be the server's own /embed answer and no
request may be refused (no 413, 422, 429 or 503 in the server's metrics)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.checkpoints import cross_encoder
from tests.helpers.server import live_server

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
PYTHON = Path(os.environ.get("BERTSERVE_CLIENTS_PYTHON", ROOT / ".venv-clients" / "bin" / "python"))
JOBS = Path(__file__).with_name("jobs.py")
SST2 = ROOT.parent / "shared" / "data" / "sst2" / "train.tsv"
SAMPLE = (0, 1, 999, 1999)


@pytest.fixture(scope="module")
def clients_python() -> Path:
    if not PYTHON.exists():
        message = f"no clients' virtualenv at {PYTHON}: run `make clients`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return PYTHON


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> Path:
    """2,000 sentences: SST-2's training split where the shared data is, else made up."""
    if SST2.exists():
        lines = [ln.split("\t")[0] for ln in SST2.read_text().splitlines()[1:2001]]
    else:
        words = [
            "the",
            "river",
            "runs",
            "past",
            "old",
            "mills",
            "and",
            "quiet",
            "towns",
            "toward",
            "a",
            "grey",
            "sea",
        ]
        lines = [" ".join(words[(i * 7 + k) % 13] for k in range(4 + i % 9)) for i in range(2000)]
    path = tmp_path_factory.mktemp("texts") / "texts.txt"
    path.write_text("\n".join(lines))
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from bertserve.export.bundle import build_bundle

    root = tmp_path_factory.mktemp("framework-bundles")
    shutil.copytree(ROOT / "bundles" / "minilm-embed", root / "minilm-embed")
    encoder = cross_encoder(tmp_path_factory.mktemp("cross-encoder"))
    build_bundle(encoder, ["rerank"], root / "tiny-reranker")
    with live_server(bundles=root) as live:  # the default settings, as `make serve` has them
        yield live


@pytest.fixture(scope="module")
def expected(server, texts) -> np.ndarray:
    lines = texts.read_text().splitlines()
    with server.client() as c:
        answer = c.post("/embed", json={"inputs": [lines[i] for i in SAMPLE]})
    return np.asarray(answer.json())


def refusals(server) -> dict[str, float]:
    """Answers by status, of the refusing kinds, from the server's metrics."""
    with server.client() as c:
        text = c.get("/metrics").text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("bertserve_requests_total{"):
            status = line.split('status="')[1].split('"')[0]
            if status in ("413", "422", "429", "503"):
                out[status] = out.get(status, 0) + float(line.split()[-1])
    return out


def run_job(python: Path, job: str, server, texts: Path) -> dict:
    # The suite's HF_HUB_OFFLINE=1 (no Hub downloads; TRANSFORMERS_OFFLINE says the same to
    # huggingface_hub) also blocks its requests to a local URL: there is no network here anyway.
    offline = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    env = {k: v for k, v in os.environ.items() if k not in offline} | {"PYTHONPATH": ""}
    # langchain's default mode tokenises with tiktoken's cl100k, whose file litellm ships.
    caches = sorted(python.parent.parent.glob("lib/python*/site-packages/litellm/*/tokenizers"))
    if caches:
        env["TIKTOKEN_CACHE_DIR"] = str(caches[0])
    done = subprocess.run(
        [str(python), str(JOBS), job, server.url, str(texts)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def same_vectors(got: dict, expected: np.ndarray) -> None:
    """Every sampled vector points as the server's /embed answer does (haystack asks for
    vectors as they are, unnormalised: `normalize: false`)."""
    assert got["count"] == 2000 and got["dim"] == expected.shape[1]
    vectors = np.asarray([got["sample"][str(i)] for i in SAMPLE])
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    assert np.allclose(vectors, expected, atol=1e-5)


@pytest.mark.parametrize(
    "job", ["langchain", "llama-openai", "llama-tei", "haystack", "chroma", "litellm"]
)
def test_an_indexing_job_with_the_frameworks_defaults(job, clients_python, server, texts, expected):
    before = refusals(server)
    got = run_job(clients_python, job, server, texts)
    same_vectors(got, expected)
    if "async" in got:
        same_vectors(got["async"], expected)
    if job == "langchain":  # the default mode's tiktoken ids: refused, saying what to do
        assert "check_embedding_ctx_length=False" in got["default_mode"]
        before["422"] = before.get("422", 0) + 1
    assert refusals(server) == before


def test_the_rerank_clients(clients_python, server, texts):
    from tests.clients.jobs import DOCS, QUERY

    with server.client() as c:
        ranked = c.post("/rerank", json={"query": QUERY, "texts": DOCS}).json()
    best = [r["index"] for r in ranked][:2]
    before = refusals(server)
    got = run_job(clients_python, "rerank", server, texts)
    assert got == {"litellm": best, "haystack": best, "llama_index": best}
    assert refusals(server) == before


def test_huggingface_hub_2_sends_truncation_direction_in_lower_case(clients_python, server, texts):
    """huggingface_hub 2.4 sends `truncation_direction: "left"`: read as TEI's "Left"."""
    got = run_job(clients_python, "hub", server, texts)
    with server.client() as c:
        want = {
            side: c.post(
                "/embed",
                json={"inputs": got["text"], "truncate": True, "truncation_direction": side},
            ).json()[0]
            for side in ("Left", "Right")
        }
    assert np.allclose(got["left"], want["Left"], atol=1e-6)
    assert np.allclose(got["right"], want["Right"], atol=1e-6)
    assert not np.allclose(got["left"], got["right"], atol=1e-2)  # the text is past the window
