"""Property-based fuzzing of every endpoint from the service's own OpenAPI schema (schemathesis):
no 5xx, every status documented, every response valid against its schema."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import checks

from bertserve.service.http.app import create_app
from bertserve.service.settings import Settings
from tests.helpers.server import live_server

pytestmark = pytest.mark.slow
# Every check schemathesis has for a stateless run: no 5xx, only documented statuses and content
# types, bodies that match the schema, 405 with Allow for other methods, every body the schema
# forbids refused (strict types: no "true" for a boolean), and every body it allows accepted.
# The last holds because the document served is the deployment's (service.http.contract): the
# item limits, the mask token, the declared prompts and the vocabulary are written into it.
CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
    checks.response_headers_conformance,
    checks.unsupported_method,
    checks.negative_data_rejection,
    checks.positive_data_acceptance,
]


@pytest.fixture(scope="module")
def server(bundle_dir):
    with live_server(bundles=bundle_dir, max_client_batch=8) as live:
        yield live


@pytest.fixture(scope="module")
def served_schema(server):
    """The document the running service serves at /openapi.json."""
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


# The operations, from the document without a deployment (the paths and methods are the same).
OPERATIONS = [
    (op.method.upper(), op.path)
    for op in (
        result.ok()
        for result in schemathesis.openapi.from_dict(
            create_app(Settings(bundles=Path(tempfile.gettempdir()))).openapi()
        ).get_all_operations()
    )
]


def fuzz(live, schema, method: str, path: str) -> None:
    operation = schema[path][method]

    @given(case=operation.as_strategy())
    @settings(
        max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    def run(case):
        case.call_and_validate(base_url=live.url, checks=CHECKS)

    run()


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_fuzz(method, path, server, served_schema):
    fuzz(server, served_schema, method, path)


# The retrieval routes again with models behind them (above they find none and answer 404):
# where a body reaches the tokenizer, the chunker and the model, what the schema allows is
# served and what it forbids is refused.
RETRIEVAL = [
    (m, p)
    for m, p in OPERATIONS
    if p in ("/embed", "/embed/chunks", "/v1/embeddings", "/v2/embed", "/similarity")
    or p.endswith("rerank")
]


@pytest.fixture(scope="module")
def retrieval_server(checkpoints, tmp_path_factory):
    from bertserve.export.bundle import build_bundle
    from tests.helpers.checkpoints import cross_encoder

    root = tmp_path_factory.mktemp("retrieval-bundles")
    build_bundle(checkpoints["BertForPreTraining"], ["embed"], root / "embedder")
    ranker = cross_encoder(tmp_path_factory.mktemp("cross-encoder"))
    build_bundle(ranker, ["rerank"], root / "ranker")
    with live_server(bundles=root, max_client_batch=8) as live:
        yield live


@pytest.mark.parametrize(("method", "path"), RETRIEVAL, ids=[f"{m} {p}" for m, p in RETRIEVAL])
def test_fuzz_with_retrieval_models(method, path, retrieval_server):
    fuzz(
        retrieval_server,
        schemathesis.openapi.from_url(f"{retrieval_server.url}/openapi.json"),
        method,
        path,
    )


def test_the_static_document_is_the_one_without_a_deployment():
    """Before the models are loaded the document has no deployment's limits, and it is not
    kept: the first request after start-up gets the bound one."""
    app = create_app(Settings(bundles=Path(tempfile.gettempdir())))
    first = app.openapi()
    assert "maxItems" not in str(first["components"]["schemas"]["ClassifyRequest"])
    assert app.openapi_schema is None


def test_the_served_document_states_the_deployments_limits(server):
    """What decides acceptance and is known when the service runs is in the document."""
    with server.client() as c:
        doc = c.get("/openapi.json").json()["components"]["schemas"]
    listed = [v for v in doc["ClassifyRequest"]["properties"]["inputs"]["anyOf"] if "items" in v]
    assert listed[0]["maxItems"] == 8
    sentences = doc["SimilarityInputs"]["properties"]["sentences"]
    assert sentences["maxItems"] == 7  # with the source sentence, 8 inputs
    masks = doc["FillMaskRequest"]["properties"]["inputs"]["anyOf"]
    assert masks[0]["pattern"] == r"\[MASK\]" and masks[1]["items"]["pattern"] == r"\[MASK\]"
    assert doc["TokenizeRequest"]["properties"]["prompt_name"]["anyOf"] == [{"type": "null"}]
    ids = doc["DecodeRequest"]["properties"]["ids"]["anyOf"]
    assert ids[0]["items"]["maximum"] == 98 and ids[1]["items"]["items"]["maximum"] == 98
    assert "maxItems" not in ids[0] and ids[1]["maxItems"] == 8  # bare ids are one input
