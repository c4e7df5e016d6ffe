"""Quantised embeddings over real HTTP: int8, uint8, binary and ubinary vectors on /embed,
/v1/embeddings and Cohere's /v2/embed (through the `cohere` client's ClientV2.embed) equal to
sentence-transformers' `quantize_embeddings` of the float vectors with the bundle's
calibrated ranges (`bertserve calibrate`), and the refusals a user can act on."""

from __future__ import annotations

import base64
import json
import shutil

import numpy as np
import pytest

from bertserve.export.bundle import build_bundle
from bertserve.export.calibrate import calibrate_bundle, calibration_texts
from bertserve.runtime.bundle import BundleError, load_bundle_spec, load_quantization_ranges
from bertserve.runtime.tasks.quantize import calibration_ranges
from tests.conftest import shared_data
from tests.helpers.checkpoints import hf_checkpoint
from tests.helpers.server import live_server

pytestmark = pytest.mark.slow

TEXTS = ["the film was good", "who was the first king of france ?", "paris", "a dog " * 40]


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    checkpoint = hf_checkpoint(root.parent / "ckpt", "BertForQuestionAnswering")
    build_bundle(checkpoint, ["embed"], root / "calibrated")
    build_bundle(checkpoint, ["embed"], root / "plain")  # no calibration
    spec = json.loads((root / "calibrated" / "bundle.json").read_text())
    spec["prompts"] = {"query": "who ", "document": "the "}  # as a sentence-transformers dir's
    (root / "calibrated" / "bundle.json").write_text(json.dumps(spec))
    calibrate_bundle(root / "calibrated", shared_data("sst2", "dev.tsv"), texts=300, widths=[16])
    return root


@pytest.fixture(scope="module")
def server(bundles):
    with live_server(bundles=bundles) as live:
        yield live


def reference(vectors: np.ndarray, precision: str, ranges: np.ndarray | None) -> np.ndarray:
    from sentence_transformers.util.quantization import quantize_embeddings

    return quantize_embeddings(vectors.astype(np.float32), precision, ranges=ranges)


def test_calibration_is_the_range_of_real_texts_unit_vectors(bundles, server):
    spec = load_bundle_spec(bundles / "calibrated")
    assert spec.quantization is not None and spec.quantization.widths == [16, 32]
    assert spec.quantization.texts == 300 and "dev.tsv" in spec.quantization.data
    sst2 = shared_data("sst2", "dev.tsv")
    texts, _ = calibration_texts(sst2, 300)
    assert texts[0] == sst2.read_text().splitlines()[1].split("\t")[0]  # the header skipped
    ranges = load_quantization_ranges(bundles / "calibrated", spec)
    with server.client() as c:
        for width in (16, 32):  # each width's vectors as /embed answers them, cut and normalised
            got = c.post(
                "/embed",
                params={"model": "calibrated"},
                json={"inputs": texts, "truncate": True, "dimensions": width},
            )
            vectors = np.asarray(got.json(), dtype=np.float32)
            np.testing.assert_allclose(ranges[width][0], vectors.min(0), atol=1e-6)
            np.testing.assert_allclose(ranges[width][1], vectors.max(0), atol=1e-6)
    assert (ranges[16][1] > ranges[16][0]).all()


@pytest.mark.parametrize("precision", ["int8", "uint8", "binary", "ubinary"])
def test_embed_equals_quantize_embeddings(bundles, server, precision):
    spec = load_bundle_spec(bundles / "calibrated")
    ranges = load_quantization_ranges(bundles / "calibrated", spec)
    with server.client() as c:
        floats = c.post("/embed", params={"model": "calibrated"}, json={"inputs": TEXTS[:3]})
        quantized = c.post(
            "/embed",
            params={"model": "calibrated"},
            json={"inputs": TEXTS[:3], "embedding_type": precision},
        )
        jina = c.post(
            "/v1/embeddings",
            json={"input": TEXTS[:3], "model": "calibrated", "embedding_type": precision},
        )
    assert quantized.status_code == 200, quantized.text[:300]
    expected = reference(np.asarray(floats.json()), precision, ranges[32])
    got = np.asarray(quantized.json())
    assert got.shape == expected.shape and (got == expected).all()
    assert [d["embedding"] for d in jina.json()["data"]] == expected.tolist()
    lo, hi = (-128, 127) if precision in ("int8", "binary") else (0, 255)
    assert lo <= got.min() and got.max() <= hi


def test_cohere_client_v2_embed(bundles, server):
    cohere = pytest.importorskip("cohere")
    spec = load_bundle_spec(bundles / "calibrated")
    ranges = load_quantization_ranges(bundles / "calibrated", spec)
    client = cohere.ClientV2(api_key="unused", base_url=server.url)
    got = client.embed(
        texts=TEXTS,
        model="embed-v4.0",  # a provider's name: the default embedding model answers
        input_type="search_document",
        embedding_types=["float", "int8", "ubinary", "base64"],
        output_dimension=16,
    )
    with server.client() as c:
        floats = c.post(
            "/embed",
            params={"model": "calibrated"},
            json={"inputs": TEXTS, "dimensions": 16, "truncate": True, "prompt_name": "document"},
        ).json()
    floats = np.asarray(floats, dtype=np.float32)
    assert np.abs(np.asarray(got.embeddings.float_) - floats).max() <= 1e-6
    assert got.embeddings.int8 == reference(floats, "int8", ranges[16]).tolist()
    assert got.embeddings.ubinary == reference(floats, "ubinary", None).tolist()
    assert len(got.embeddings.ubinary[0]) == 2  # 16 bits
    decoded = [np.frombuffer(base64.b64decode(b), "<f4") for b in got.embeddings.base64]
    assert np.abs(np.asarray(decoded) - floats).max() <= 1e-6
    assert got.embeddings.uint8 is None and got.texts == TEXTS
    assert got.meta.billed_units.input_tokens > len(TEXTS)
    assert got.id and got.response_type == "embeddings_by_type"
    # input_type: the bundle's prompts; 12 components: two bytes of bits, the last half empty
    query = client.embed(
        texts=TEXTS[:2],
        model="calibrated",
        input_type="search_query",
        embedding_types=["float", "binary"],
        output_dimension=12,
    )
    with server.client() as c:
        prompted = c.post(
            "/embed",
            params={"model": "calibrated"},
            json={"inputs": TEXTS[:2], "prompt_name": "query", "dimensions": 12},
        ).json()
    assert np.abs(np.asarray(query.embeddings.float_) - np.asarray(prompted)).max() <= 1e-6
    assert query.embeddings.binary == reference(np.asarray(prompted), "binary", None).tolist()
    assert all(len(b) == 2 for b in query.embeddings.binary)
    with pytest.raises(cohere.core.api_error.ApiError) as refused:
        client.embed(texts=["x"], model="calibrated", input_type="image")
    assert refused.value.status_code == 422 and "search_query" in refused.value.body["message"]


def test_cohere_truncation_and_max_tokens(server):
    long = "the dog and the fox " * 40  # past the tiny model's 64 positions
    with server.client() as c:

        def v2(**body):
            return c.post("/v2/embed", params={"model": "calibrated"}, json=body)

        refused = v2(texts=[long], truncate="NONE")
        cut_none = v2(texts=[long], truncate="NONE", max_tokens=6)
        end = v2(texts=[long], truncate="END", max_tokens=6)
        start = v2(texts=[long], truncate="START", max_tokens=6)
        first = c.post(
            "/embed", params={"model": "calibrated"}, json={"inputs": "the dog and the fox the"}
        )
        last = c.post(
            "/embed", params={"model": "calibrated"}, json={"inputs": "fox the dog and the fox"}
        )
    assert refused.status_code == 413 and '"truncate": "END"' in refused.json()["error"]
    assert cut_none.status_code == 413 and "max_tokens 6" in cut_none.json()["error"]
    assert end.status_code == 200, end.text[:300]
    ends = (end.json()["embeddings"]["float"][0], start.json()["embeddings"]["float"][0])
    assert np.abs(np.asarray(ends[0]) - np.asarray(first.json()[0])).max() <= 1e-6
    assert end.json()["meta"]["billed_units"]["input_tokens"] == 8  # 6 pieces and two marks
    assert np.abs(np.asarray(ends[1]) - np.asarray(last.json()[0])).max() <= 1e-6


def test_what_is_refused_says_what_to_do(server):
    with server.client() as c:
        plain = c.post(
            "/embed", params={"model": "plain"}, json={"inputs": "x", "embedding_type": "int8"}
        )
        plain_bits = c.post(
            "/embed", params={"model": "plain"}, json={"inputs": "x", "embedding_type": "binary"}
        )
        width = c.post(
            "/v2/embed",
            params={"model": "calibrated"},
            json={"texts": ["x"], "embedding_types": ["uint8"], "output_dimension": 20},
        )
        raw = c.post(
            "/embed",
            params={"model": "calibrated"},
            json={"inputs": "x", "embedding_type": "int8", "normalize": False},
        )
        images = c.post("/v2/embed", json={"texts": ["x"], "images": ["data:image/png;base64,"]})
        unknown = c.post("/v2/embed", json={"texts": ["x"], "embedding_types": ["int4"]})
    assert plain.status_code == 422 and "bertserve calibrate" in plain.json()["error"]
    assert plain_bits.status_code == 200  # packed bits need no calibration
    assert width.status_code == 422 and "[16, 32]" in width.json()["error"]
    assert raw.status_code == 422 and "normalize" in raw.json()["error"]
    assert images.status_code == 422 and "texts" in images.json()["error"]
    assert unknown.status_code == 422


def test_a_changed_ranges_file_is_a_bundle_error(bundles, tmp_path):
    copy = tmp_path / "calibrated"
    shutil.copytree(bundles / "calibrated", copy)
    spec = load_bundle_spec(copy)
    path = copy / spec.quantization.file
    path.write_bytes(path.read_bytes()[:-1] + b"\1")
    with pytest.raises(BundleError, match="sha256"):
        load_quantization_ranges(copy, spec)


def test_the_quantized_rankings_of_the_retrieval_evaluation():
    from bertserve.model.training.retrieval import quantized_rankings
    from bertserve.runtime.tasks.quantize import quantize

    rng = np.random.default_rng(0)
    docs = rng.normal(size=(150, 64)).astype(np.float32)
    docs /= np.linalg.norm(docs, axis=1, keepdims=True)
    queries = docs[:20] + 0.05 * rng.normal(size=(20, 64)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    ranges = {64: calibration_ranges(docs, [64])[0]}

    def kind(vectors, precision):
        return np.stack([quantize(v, precision, ranges) for v in vectors])

    got = quantized_rankings(
        queries,
        kind(queries, "int8"),
        kind(queries, "ubinary"),
        kind(docs, "int8"),
        kind(docs, "ubinary"),
    )
    signs_q, signs_d = queries > 0, docs > 0
    hamming = (signs_q[:, None, :] != signs_d[None, :, :]).sum(-1)
    assert (hamming[np.arange(20), got["dense_binary"][:, 0]] == hamming.min(1)).all()
    assert (got["dense_int8"][:, 0] == np.arange(20)).all()  # each query's own document
    assert (got["dense_binary_int8_rescored"][:, 0] == np.arange(20)).all()
    first = got["dense_binary"][:, :100]
    assert all(
        set(a) == set(b) for a, b in zip(first, got["dense_binary_int8_rescored"], strict=True)
    )


def test_the_served_schema_offers_int8_only_where_every_model_has_ranges(bundles, tmp_path):
    def offered(server) -> list[str]:
        with server.client() as c:
            doc = c.get("/openapi.json").json()["components"]["schemas"]
        items = doc["CohereEmbedRequest"]["properties"]["embedding_types"]
        return (items.get("items") or items["anyOf"][0]["items"])["enum"]

    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copytree(bundles / "calibrated", alone / "calibrated")
    with live_server(bundles=bundles) as both, live_server(bundles=alone) as calibrated:
        assert "int8" not in offered(both) and "binary" in offered(both)  # "plain" has none
        assert {"int8", "uint8"} <= set(offered(calibrated))
