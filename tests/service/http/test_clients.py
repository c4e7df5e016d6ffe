"""The embedding endpoints through the client libraries users point at them, unchanged: OpenAI's
`openai` package and Hugging Face's `InferenceClient`, plus text-embeddings-inference's routes
(/, /similarity, /tokenize, /decode, prompt_name) over plain HTTP. The shipped MiniLM bundle,
with two prompts declared in its bundle.json as an E5-style model declares them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.server import live_server

pytestmark = pytest.mark.slow
SHIPPED = Path(__file__).resolve().parents[3] / "bundles" / "minilm-embed"
TEXTS = ["A man is eating food.", "Paris is the capital of France.", "Short."]
PROMPTS = {"query": "query: ", "passage": "passage: "}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("client-bundles")
    bundle = shutil.copytree(SHIPPED, root / "minilm-embed")
    spec = json.loads((bundle / "bundle.json").read_text())
    (bundle / "bundle.json").write_text(json.dumps(spec | {"prompts": PROMPTS}))
    with live_server(bundles=root) as live:
        yield live


@pytest.fixture(scope="module")
def vectors(server) -> np.ndarray:
    """The service's own /embed answers: what every other route must agree with."""
    with server.client() as c:
        return np.asarray(c.post("/embed", json={"inputs": TEXTS}).json())


@pytest.fixture(scope="module")
def openai_client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


def test_openai_embeddings_dimensions_and_user(openai_client, vectors):
    full = openai_client.embeddings.create(input=TEXTS, model="minilm-embed", user="indexer-7")
    got = np.asarray([d.embedding for d in full.data])
    assert np.allclose(got, vectors, atol=1e-6)
    cut = openai_client.embeddings.create(input=TEXTS, model="minilm-embed", dimensions=64)
    short = np.asarray([d.embedding for d in cut.data])
    assert short.shape == (3, 64)
    assert np.allclose(short, unit(vectors[:, :64]), atol=1e-6)  # truncated, then renormalised
    assert full.usage.prompt_tokens == cut.usage.prompt_tokens > 0


def test_openai_token_id_inputs_equal_the_texts(openai_client, server, vectors):
    with server.client() as c:
        pieces = c.post("/tokenize", json={"inputs": TEXTS, "add_special_tokens": False}).json()
    ids = [[p["id"] for p in text] for text in pieces]
    many = openai_client.embeddings.create(input=ids, model="minilm-embed")
    one = openai_client.embeddings.create(input=ids[0], model="minilm-embed")
    assert np.allclose([d.embedding for d in many.data], vectors, atol=1e-6)
    assert len(one.data) == 1 and np.allclose(one.data[0].embedding, vectors[0], atol=1e-6)


def test_openai_refusals_name_the_limit(openai_client):
    import openai

    with pytest.raises(openai.UnprocessableEntityError, match="384 components"):
        openai_client.embeddings.create(input="x", model="minilm-embed", dimensions=1000)
    with pytest.raises(openai.UnprocessableEntityError, match="outside the model's vocabulary"):
        openai_client.embeddings.create(input=[101, 10**6], model="minilm-embed")


def test_openai_lists_the_models(openai_client):
    listed = openai_client.models.list()
    assert [m.id for m in listed.data] == ["minilm-embed"]
    assert all(m.owned_by == "bertserve" and m.created > 1.7e9 for m in listed.data)


@pytest.fixture
def inference_client(server, monkeypatch):
    """Hugging Face's client on this server. The suite runs with HF_HUB_OFFLINE=1 (no Hub
    downloads), which also blocks the client's requests to a local URL: lifted here only."""
    from huggingface_hub import InferenceClient, constants
    from huggingface_hub.utils import _http

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    _http.reset_sessions()
    yield InferenceClient(base_url=server.url)
    monkeypatch.undo()
    _http.reset_sessions()


def test_inference_client_on_the_base_url(inference_client, vectors):
    client = inference_client
    got = client.feature_extraction(TEXTS[0])
    assert got.shape == (1, 384) and np.allclose(got[0], vectors[0], atol=1e-6)
    scores = client.sentence_similarity(TEXTS[0], other_sentences=TEXTS[1:])
    assert np.allclose(scores, vectors[1:] @ vectors[0], atol=1e-5)
    raw = client.feature_extraction(TEXTS[0], normalize=False)
    assert abs(np.linalg.norm(raw[0]) - 1) > 1e-3 and np.allclose(
        unit(raw[0]), vectors[0], atol=1e-5
    )


def test_similarity_route(server, vectors):
    body = {"inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS}}
    with server.client() as c:
        scores = c.post("/similarity", json=body).json()
        empty = c.post("/similarity", json={"inputs": {"source_sentence": "x", "sentences": []}})
    assert np.allclose(scores, vectors @ vectors[0], atol=1e-5) and abs(scores[0] - 1) < 1e-5
    assert empty.status_code == 422


def test_prompt_name_puts_the_bundles_prompt_first(server):
    with server.client() as c:
        prompted = c.post("/embed", json={"inputs": "rivers", "prompt_name": "query"}).json()
        spelled = c.post("/embed", json={"inputs": "query: rivers"}).json()
        plain = c.post("/embed", json={"inputs": "rivers"}).json()
        unknown = c.post("/embed", json={"inputs": "rivers", "prompt_name": "title"})
        models = c.get("/models").json()
        pieces = c.post("/tokenize", json={"inputs": "rivers", "prompt_name": "passage"}).json()
    assert np.allclose(prompted, spelled, atol=1e-6) and not np.allclose(prompted, plain, atol=1e-3)
    assert unknown.status_code == 422
    assert unknown.json()["error"] == "prompt_name 'title': model minilm-embed has prompts " + str(
        sorted(PROMPTS)
    )
    assert models[0]["prompts"] == PROMPTS
    assert [p["text"] for p in pieces[0]] == ["[CLS]", "passage", ":", "rivers", "[SEP]"]


def test_tokenize_and_decode_round_trip(server):
    with server.client() as c:
        (pieces,) = c.post("/tokenize", json={"inputs": "Héllo, world"}).json()
        ids = [p["id"] for p in pieces]
        texts = c.post("/decode", json={"ids": [ids, ids[1:3]]}).json()
        kept = c.post("/decode", json={"ids": ids, "skip_special_tokens": False}).json()
        bad = c.post("/decode", json={"ids": [30522]})
    assert pieces[0] == {"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None}
    assert pieces[1] == {"id": 7592, "text": "Héllo", "special": False, "start": 0, "stop": 5}
    assert pieces[2]["text"] == "," and (pieces[2]["start"], pieces[2]["stop"]) == (5, 6)
    assert texts == ["hello, world", "hello,"]
    assert kept == ["[CLS] hello, world [SEP]"]
    assert bad.status_code == 422 and "vocabulary" in bad.json()["error"]


def test_types_are_strict(server):
    with server.client() as c:
        as_text = c.post("/embed", json={"inputs": "x", "normalize": "false"})
        as_float = c.post("/v1/embeddings", json={"input": "x", "dimensions": 8.5})
        as_int = c.post("/embed", json={"inputs": "x", "truncate": 1})
    assert [r.status_code for r in (as_text, as_float, as_int)] == [422, 422, 422]


def test_inference_client_truncates_at_either_end(inference_client, server):
    """feature_extraction's truncate and truncation_direction reach the model: a text past
    the model's 256 tokens cut at its start is embedded as its tail is."""
    long = " ".join(f"river {i} runs past the mill." for i in range(120))
    client = inference_client
    right = client.feature_extraction(long, truncate=True)
    left = client.feature_extraction(long, truncate=True, truncation_direction="Left")
    with server.client() as c:
        pieces = c.post("/tokenize", json={"inputs": long, "add_special_tokens": False}).json()[0]
        tail = c.post("/embed", json={"inputs": long[pieces[-254]["start"] :]}).json()
    assert np.allclose(left[0], tail[0], atol=1e-5)
    assert not np.allclose(left[0], right[0], atol=1e-2)
