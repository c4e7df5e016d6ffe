"""Property-based fuzzing of every endpoint from the service's own OpenAPI schema (schemathesis):
no 5xx, every status documented, every response valid against its schema."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks

from service.app import create_app
from service.settings import Settings
from tests.helpers.server import live_server

pytestmark = pytest.mark.slow
# The promises: no 5xx, only documented statuses and content types, bodies that match the
# schema, 405 with Allow for other methods, and every body the schema forbids refused (strict
# types: no "true" for a boolean). Not "every schema-valid request is accepted": a request can
# still be refused for what depends on the loaded model, which a static schema cannot state
# (more tokens than the model takes, a token id past its vocabulary, a prompt it does not
# declare), with a documented 4xx that says so.
CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
    checks.response_headers_conformance,
    checks.unsupported_method,
    checks.negative_data_rejection,
]

# The schema comes from the app itself (no server needed to build it).
schema = schemathesis.openapi.from_dict(
    create_app(Settings(bundles=Path(tempfile.gettempdir()))).openapi()
)


@pytest.fixture(scope="module")
def server(bundle_dir):
    with live_server(bundles=bundle_dir, max_client_batch=8) as live:
        yield live


@schema.parametrize()
@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_fuzz(case, server):
    case.call_and_validate(base_url=server.url, checks=CHECKS)
