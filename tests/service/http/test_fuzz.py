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


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_fuzz(method, path, server, served_schema):
    operation = served_schema[path][method]

    @given(case=operation.as_strategy())
    @settings(
        max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    def fuzz(case):
        case.call_and_validate(base_url=server.url, checks=CHECKS)

    fuzz()


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
