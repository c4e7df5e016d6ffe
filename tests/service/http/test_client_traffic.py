"""The traffic clients send by default, over real HTTP on the shipped bundles: OpenAI-sized
client batches, a burst of concurrent client batches past the in-flight cap, the fields TEI's,
Cohere's and huggingface_hub's clients add, OpenAI's error shape and models.retrieve, truncation
at either end and by the server's setting, and token ids from another tokenizer."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.helpers.server import live_server

pytestmark = pytest.mark.slow
BUNDLES = Path(__file__).resolve().parents[3] / "bundles"
WORDS = "the river runs past old mills and quiet towns toward a grey sea".split()  # noqa: SIM905


def sentence(i: int) -> str:
    """A different sentence for each i, of 4 to 12 words."""
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(4 + i % 9)) + f" {i}."


@pytest.fixture(scope="module")
def embed_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("embed-bundles")
    shutil.copytree(BUNDLES / "minilm-embed", root / "minilm-embed")
    return root


@pytest.fixture(scope="module")
def server(embed_dir):
    with live_server(bundles=embed_dir, max_in_flight=8) as live:
        yield live


@pytest.fixture(scope="module")
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def embed(server, texts: list[str], **fields) -> np.ndarray:
    with server.client() as c:
        answer = c.post("/embed", json={"inputs": texts, **fields})
    assert answer.status_code == 200, answer.text
    return np.asarray(answer.json())


def test_an_openai_sized_batch_is_one_request(openai_client, server):
    """2,048 inputs (OpenAI's limit; langchain sends 1,000) in one request: answered in order,
    each vector the one a request of its own gets."""
    texts = [sentence(i) for i in range(2048)]
    got = openai_client.embeddings.create(input=texts, model="text-embedding-3-small")
    assert [d.index for d in got.data] == list(range(2048))
    vectors = np.asarray([d.embedding for d in got.data])
    picks = [0, 1, 977, 2047]
    assert np.allclose(vectors[picks], embed(server, [texts[i] for i in picks]), atol=1e-5)
    with server.client() as c:
        over = c.post("/v1/embeddings", json={"input": ["x"] * 2049})
    assert over.status_code == 413
    assert "2049 inputs in one request; the limit is 2048" in over.json()["error"]["message"]


def test_a_burst_of_client_batches_queues_instead_of_refusing(server):
    """llama-index's TEI embedder sends every batch of a job at once: 200 requests of 10
    sentences against 8 in-flight slots are all answered; requests of one input past the cap
    are still refused, with Retry-After."""

    async def burst():
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as c:
            batches = [
                c.post("/embed", json={"inputs": [sentence(10 * i + k) for k in range(10)]})
                for i in range(200)
            ]
            singles = [c.post("/embed", json={"inputs": sentence(i)}) for i in range(100)]
            return await asyncio.gather(*batches, *singles)

    answers = asyncio.run(burst())
    batches, singles = answers[:200], answers[200:]
    assert [r.status_code for r in batches] == [200] * 200
    assert all(len(r.json()) == 10 for r in batches)
    refused = [r for r in singles if r.status_code != 200]  # past the cap (503), or past
    assert {r.status_code for r in refused} <= {429, 503}  # their queue's bound (429)
    assert all(r.headers["retry-after"] == "1" for r in refused)
    first = embed(server, [sentence(10 * 57 + k) for k in range(10)])
    assert np.allclose(batches[57].json(), first, atol=1e-6)


def test_openai_errors_in_openai_shape(openai_client, server):
    import openai

    with pytest.raises(openai.UnprocessableEntityError) as caught:
        openai_client.embeddings.create(input="x", model="minilm-embed", dimensions=1000)
    error = caught.value
    assert error.code == "invalid_input" and error.type == "invalid_request_error"
    assert "384 components" in error.message
    with server.client() as c:
        tei = c.post("/embed", json={"inputs": "x", "dimensions": 1000})
        unknown = c.post("/v1/embeddings", json={"input": "x", "colour": "red"})
    assert tei.status_code == 422 and tei.json()["error_type"] == "invalid_input"
    assert unknown.status_code == 422  # OpenAI refuses fields it does not know: so does /v1
    assert "colour" in unknown.json()["error"]["message"]


def test_models_retrieve(openai_client):
    import openai

    assert openai_client.models.retrieve("minilm-embed").id == "minilm-embed"
    with pytest.raises(openai.NotFoundError, match="no model 'gpt-4'"):
        openai_client.models.retrieve("gpt-4")


def test_tei_fields_that_clients_send(server):
    """truncation_direction both ways, dimensions, and fields nobody here reads (ignored, as
    text-embeddings-inference ignores them)."""
    long = " ".join(sentence(i) for i in range(80))  # well over 256 tokens
    with server.client() as c:
        refused = c.post("/embed", json={"inputs": long})
        right = c.post("/embed", json={"inputs": long, "truncate": True})
        left = c.post(
            "/embed",
            json={"inputs": long, "truncate": True, "truncation_direction": "Left", "x": 1},
        )
        pieces = c.post("/tokenize", json={"inputs": long, "add_special_tokens": False}).json()[0]
    assert refused.status_code == 413 and "truncat" in refused.json()["error"]
    assert right.status_code == left.status_code == 200
    # The last 254 pieces (256 less [CLS] and [SEP]), from the start of a word.
    tail = long[pieces[-254]["start"] :]
    assert np.allclose(left.json(), embed(server, [tail]), atol=1e-5)
    assert np.allclose(right.json(), embed(server, [long], truncate=True), atol=1e-6)
    assert not np.allclose(left.json(), right.json(), atol=1e-2)
    short = embed(server, ["a river"], dimensions=32)
    assert short.shape == (1, 32) and abs(np.linalg.norm(short) - 1) < 1e-5


def test_auto_truncate_is_the_default_a_request_can_override(embed_dir, server):
    long = " ".join(sentence(i) for i in range(80))
    with server.client() as c:
        assert c.post("/v1/embeddings", json={"input": long}).status_code == 413
        cut = c.post("/v1/embeddings", json={"input": long, "truncate": True})
    assert cut.status_code == 200
    with live_server(bundles=embed_dir, auto_truncate=True) as auto, auto.client() as c:
        same = c.post("/v1/embeddings", json={"input": long})
        refused = c.post("/embed", json={"inputs": long, "truncate": False})
    assert same.status_code == 200 and refused.status_code == 413
    assert np.allclose(same.json()["data"][0]["embedding"], cut.json()["data"][0]["embedding"])


def test_token_ids_of_another_tokenizer_are_refused_and_our_own_taken_as_sent(
    openai_client, server
):
    """langchain's OpenAIEmbeddings sends tiktoken's cl100k ids by default: "The quick brown fox
    jumps over the lazy dog." is these. Read as WordPiece ids they embed nonsense; the service
    tells them apart ([unused] pieces) and says what to do."""
    import openai

    cl100k = [791, 4062, 14198, 39935, 35308, 927, 279, 16053, 5679, 13]
    with pytest.raises(openai.UnprocessableEntityError, match="outside the model's vocab"):
        openai_client.embeddings.create(input=[cl100k], model="minilm-embed")
    within = [i for i in cl100k if i < 30522]  # all inside WordPiece's vocabulary
    with pytest.raises(openai.UnprocessableEntityError, match="check_embedding_ctx_length"):
        openai_client.embeddings.create(input=[within], model="minilm-embed")
    with server.client() as c:
        pieces = c.post("/tokenize", json={"inputs": "the quick brown fox"}).json()[0]
    ours = [p["id"] for p in pieces if not p["special"]]
    got = openai_client.embeddings.create(input=[ours], model="minilm-embed")
    assert np.allclose(got.data[0].embedding, embed(server, ["the quick brown fox"])[0], atol=1e-6)
    # Ids as a tokenizer returns them, [CLS] ... [SEP] (/tokenize's default): used as they are,
    # as text-embeddings-inference embeds the ids it is given, not framed twice.
    framed = [p["id"] for p in pieces]
    assert framed[0] == 101 and framed[-1] == 102 and framed[1:-1] == ours
    both = openai_client.embeddings.create(input=[framed, ours], model="minilm-embed")
    want = embed(server, ["the quick brown fox"])[0]
    assert np.allclose(both.data[0].embedding, want, atol=1e-6)
    assert np.allclose(both.data[1].embedding, want, atol=1e-6)
    with server.client() as c:  # [PAD]: no text makes it
        padded = c.post("/v1/embeddings", json={"input": [[*framed, 0]]})
    assert padded.status_code == 422 and "'[PAD]'" in padded.json()["error"]["message"]


@pytest.fixture(scope="module")
def classify_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("classify-bundles")
    shutil.copytree(BUNDLES / "sst2-distilled-2x192", root / "sst2-distilled-2x192")
    # InferenceClient(base_url=...) posts every task to the base URL: the root task answers it
    with live_server(bundles=root, root_task="/classify") as live:
        yield live


def test_huggingface_hub_reads_top_k_labels(classify_server, monkeypatch):
    """InferenceClient.text_classification takes element 0 of the answer (the Inference API
    nests one text's labels); the pipeline's flat list stays the answer for other clients."""
    from huggingface_hub import InferenceClient, constants
    from huggingface_hub.utils import _http

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    _http.reset_sessions()
    try:
        labels = InferenceClient(base_url=classify_server.url).text_classification(
            "a charming and often affecting journey", top_k=2
        )
    finally:
        monkeypatch.undo()
        _http.reset_sessions()
    assert len(labels) == 2 and labels[0].score >= labels[1].score
    with classify_server.client() as c:
        flat = c.post(
            "/classify",
            json={"inputs": "a charming and often affecting journey", "parameters": {"top_k": 2}},
        ).json()
    assert [x["label"] for x in flat] == [x.label for x in labels]


def test_jina_fields_on_the_openai_route(server):
    """langchain's JinaEmbeddings posts Jina's fields to /v1/embeddings: `normalized` and
    `embedding_type` are honoured, `task` accepted and ignored (`late_chunking` is tested in
    tests/service/test_long_inputs.py)."""
    texts = ["a river runs past the mill", "the sea is grey"]
    body = {
        "input": texts,
        "model": "jina-embeddings-v3",
        "task": "retrieval.passage",
        "late_chunking": False,
        "embedding_type": "float",
        "dimensions": 64,
    }
    with server.client() as c:
        unit = c.post("/v1/embeddings", json=body)
        raw = c.post("/v1/embeddings", json=body | {"normalized": False, "dimensions": None})
        binary = c.post("/v1/embeddings", json=body | {"embedding_type": "binary"})
    assert unit.status_code == 200 and raw.status_code == 200
    vectors = np.asarray([d["embedding"] for d in unit.json()["data"]])
    full = embed(server, texts, normalize=False)
    expected = full[:, :64] / np.linalg.norm(full[:, :64], axis=1, keepdims=True)
    assert np.allclose(vectors, expected, atol=1e-5)
    assert np.allclose([d["embedding"] for d in raw.json()["data"]], full, atol=1e-5)
    # Jina's binary type: a bit a component, eight to a byte, less 128
    packed = np.packbits(vectors > 0, axis=1).astype(np.int16) - 128
    assert binary.status_code == 200, binary.text[:300]
    assert [d["embedding"] for d in binary.json()["data"]] == packed.tolist()
