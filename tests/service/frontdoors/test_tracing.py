"""OpenTelemetry traces to a real OTLP/gRPC receiver (the opentelemetry-proto service): one
request's span tree, continuing the caller's traceparent, over HTTP and gRPC; the batch span
linked both ways; the trace id in the access log; and nothing traced while it is off."""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from bertserve.service.grpc import tei_pb2, tei_pb2_grpc
from tests.helpers.server import free_port, live_server

pytestmark = pytest.mark.slow
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
CHILDREN = {"read body", "tokenize", "queue", "inference", "write answer"}


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace receiver: every span exported to it, flattened."""

    def __init__(self) -> None:
        self.spans: list = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    self.spans.extend(scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait(self, predicate, timeout: float = 15.0) -> list:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                found = [s for s in self.spans if predicate(s)]
            if found:
                return found
            time.sleep(0.05)
        raise AssertionError(f"no such span among {[s.name for s in self.spans]}")


@pytest.fixture(scope="module")
def receiver():
    collector = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    collector.port = port
    yield collector
    server.stop(0)


@pytest.fixture(scope="module")
def bundles(checkpoints, tmp_path_factory):
    from bertserve.export.bundle import build_bundle

    root = tmp_path_factory.mktemp("traced-bundles")
    build_bundle(checkpoints["BertForPreTraining"], ["embed"], root / "embedder")
    return root


def tree(spans: list, trace_hex: str) -> dict[str, list]:
    mine = [s for s in spans if s.trace_id.hex() == trace_hex]
    return {name: [s for s in mine if s.name == name] for name in {s.name for s in mine}}


def check_tree(receiver: Receiver, trace: str, name: str, parent: str, requests: int) -> None:
    """`requests` SERVER spans named `name` in `trace`, each the child of the caller's span
    `parent`, each with the five children, its inference linked to a batch span that links
    back to it."""
    found = receiver.wait(
        lambda s: s.trace_id.hex() == trace and s.name == name and len(s.attributes) > 3
    )
    deadline = time.monotonic() + 10
    while len(found) < requests and time.monotonic() < deadline:
        time.sleep(0.05)
        found = [s for s in receiver.spans if s.trace_id.hex() == trace and s.name == name]
    assert len(found) == requests
    for request in found:
        assert request.parent_span_id.hex() == parent  # the caller's span
        assert request.kind == request.SPAN_KIND_SERVER
        receiver.wait(
            lambda s, r=request: s.parent_span_id == r.span_id and s.name == "write answer"
        )
        with receiver.lock:
            children = [s for s in receiver.spans if s.parent_span_id == request.span_id]
        assert {s.name for s in children} == CHILDREN
        for child in children:
            assert request.start_time_unix_nano <= child.start_time_unix_nano
            assert child.end_time_unix_nano <= request.end_time_unix_nano
        (inference,) = [s for s in children if s.name == "inference"]
        assert len(inference.links) >= 1
        batch_id = inference.links[0].span_id
        (batch,) = receiver.wait(lambda s, b=batch_id: s.span_id == b and s.name == "batch")
        attributes = {a.key: a.value for a in batch.attributes}
        assert attributes["bertserve.model"].string_value == "embedder"
        assert attributes["bertserve.rows"].int_value >= 1
        assert any(link.span_id == request.span_id for link in batch.links)  # and back


def test_an_http_request_is_one_span_tree_under_the_callers_traceparent(receiver, bundles, caplog):
    caplog.set_level(logging.INFO, logger="bertserve.access")
    with (
        live_server(
            bundles=bundles,
            otlp_endpoint=f"http://127.0.0.1:{receiver.port}",
            otlp_export_delay_ms=50,
        ) as live,
        live.client() as c,
    ):
        headers = {"traceparent": f"00-{TRACE}-{PARENT}-01"}
        answer = c.post("/embed", json={"inputs": ["one", "two", "three"]}, headers=headers)
        assert answer.status_code == 200
        check_tree(receiver, TRACE, "POST /embed", PARENT, 1)
    logged = [r.fields for r in caplog.records if getattr(r, "fields", {}).get("endpoint")]
    assert any(f.get("trace_id") == TRACE and f["endpoint"] == "/embed" for f in logged)


def test_a_grpc_call_is_traced_the_same_way(receiver, bundles):
    trace, parent = "0af7651916cd43dd8448eb211c80319c", "a2fb4a1d1a96d312"
    with (
        live_server(
            bundles=bundles,
            grpc_port=free_port(),
            otlp_endpoint=f"http://127.0.0.1:{receiver.port}",
            otlp_export_delay_ms=50,
            max_wait_ms=50,  # the stream's three messages in one batch
        ) as live,
        grpc.insecure_channel(f"127.0.0.1:{live.state.grpc_port}") as channel,
    ):
        stub = tei_pb2_grpc.EmbedStub(channel)
        metadata = [("traceparent", f"00-{trace}-{parent}-01")]
        requests = iter(tei_pb2.EmbedRequest(inputs=t) for t in ("one", "two", "three"))
        assert len(list(stub.EmbedStream(requests, metadata=metadata))) == 3
        # A stream's messages are requests of their own: one span each, siblings.
        check_tree(receiver, trace, "grpc /embed", parent, 3)


def test_off_nothing_is_traced_and_unsampled_requests_write_no_spans(receiver, bundles):
    before = len(receiver.spans)
    with live_server(bundles=bundles) as live, live.client() as c:
        assert live.state.tracing is None
        headers = {"traceparent": f"00-{TRACE}-{PARENT}-01"}
        assert c.post("/embed", json={"inputs": "off"}, headers=headers).status_code == 200
    with (
        live_server(
            bundles=bundles,
            otlp_endpoint=f"http://127.0.0.1:{receiver.port}",
            otlp_export_delay_ms=50,
            otlp_sample_ratio=0.0,
        ) as live,
        live.client() as c,
    ):
        assert c.post("/embed", json={"inputs": "unsampled"}).status_code == 200
    time.sleep(0.3)
    assert len(receiver.spans) == before
