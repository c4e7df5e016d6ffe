"""OpenTelemetry traces, off unless `BERTSERVE_OTLP_ENDPOINT` is set (the `otel` extra brings
the SDK and the OTLP gRPC exporter; the serving install has neither).

A request (HTTP or gRPC) is one SERVER span, continuing the caller's W3C `traceparent`, sampled
at `BERTSERVE_OTLP_SAMPLE_RATIO` (parent-based: a caller's sampled flag is kept). Its children,
written once it is answered from the times the handler measured anyway: `read body` (arrival to
the handler), `tokenize`, `queue` (until its first model call began), `inference` (linked to the
batch span that ran its rows) and `write answer` (decoding and the response). A batch is a span
of its own, in a trace of its own (a batch serves many requests), with the model, its rows and
tokens, and a link to every sampled request it served. The trace id goes into the access log
line (`trace_id`).

Off, nothing here is imported: each hook is a `None` check."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from bertserve.service.settings import Settings

NS = 1_000_000_000


def wall_ns(perf_s: float) -> int:
    """A `time.perf_counter()` reading as wall-clock nanoseconds (what spans take)."""
    return time.time_ns() - int((time.perf_counter() - perf_s) * NS)


class Tracing:
    """The tracer of one serving process, and the spans the service writes."""

    def __init__(self, settings: Settings) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
            from opentelemetry.trace import Link, SpanKind, Status, StatusCode
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError as exc:
            raise RuntimeError(
                "BERTSERVE_OTLP_ENDPOINT is set but the OpenTelemetry SDK is not installed: "
                "pip install 'bertserve[otel]' (opentelemetry-sdk and its OTLP gRPC exporter)"
            ) from exc
        self.Link, self.SpanKind, self.Status, self.StatusCode = Link, SpanKind, Status, StatusCode
        self.propagator = TraceContextTextMapPropagator()
        sampler = ParentBased(TraceIdRatioBased(settings.otlp_sample_ratio))
        resource = Resource.create({"service.name": settings.otlp_service_name})
        self.provider = TracerProvider(resource=resource, sampler=sampler)
        exporter = OTLPSpanExporter(endpoint=settings.otlp_endpoint, insecure=True)
        self.provider.add_span_processor(
            BatchSpanProcessor(exporter, schedule_delay_millis=settings.otlp_export_delay_ms)
        )
        self.tracer = self.provider.get_tracer("bertserve")

    def start(
        self, name: str, carrier: Mapping[str, str], attributes: dict[str, Any], at: float
    ) -> Any:
        """A request's SERVER span from `at` (its arrival, a perf_counter reading), the child
        of the caller's `traceparent` if it sent one."""
        parent = self.propagator.extract(carrier) if "traceparent" in carrier else None
        return self.tracer.start_span(
            name,
            context=parent,
            kind=self.SpanKind.SERVER,
            attributes=attributes,
            start_time=wall_ns(at),
        )

    def end(self, span: Any, status: int, code: str | None = None) -> None:
        span.set_attribute("http.response.status_code", status)
        if code is not None:
            span.set_attribute("rpc.grpc.status_code", code)
        if status >= 500 or (code not in (None, "OK") and status >= 400):
            span.set_status(self.Status(self.StatusCode.ERROR))
        span.end()

    def child(
        self, parent: Any, name: str, start_ns: int, end_ns: int, links: Iterable[Any] = ()
    ) -> None:
        from opentelemetry import trace

        context = trace.set_span_in_context(parent)
        span = self.tracer.start_span(
            name, context=context, start_time=start_ns, links=[self.Link(c) for c in links]
        )
        span.end(end_time=max(end_ns, start_ns))

    def batch(self, requests: list[Any], start_ns: int, end_ns: int, attributes: dict) -> Any:
        """A model call's span, linked to the sampled requests it served; its context (what
        each request's `inference` span links to)."""
        from opentelemetry.context import Context

        span = self.tracer.start_span(
            "batch",
            context=Context(),  # a root: a batch serves many requests' traces
            start_time=start_ns,
            attributes=attributes,
            links=[self.Link(c) for c in requests],
        )
        span.end(end_time=end_ns)
        return span.get_span_context()

    def shutdown(self) -> None:
        self.provider.shutdown()  # exports what is left


class RowTrace:
    """What a traced request's rows carry into the batcher (runtime.batching.Row.trace)."""

    __slots__ = ("context", "tracing")

    def __init__(self, tracing: Tracing, context: Any) -> None:
        self.tracing, self.context = tracing, context


def request_spans(stats: dict[str, Any], t0: float, t1: float, results: list[Any]) -> None:
    """A traced request's `tokenize`, `queue` and `inference` spans (service.handler)."""
    span, tracing = stats["span"], stats["tracing"]
    tracing.child(span, "tokenize", wall_ns(t0), wall_ns(t1))
    queue_s = max((r.queue_s for r in results), default=0.0)
    inference_s = max((r.inference_s for r in results), default=0.0)
    queued = wall_ns(t1)
    ran = queued + int(queue_s * NS)
    tracing.child(span, "queue", queued, ran)
    batches = list({id(r.batch): r.batch for r in results if r.batch is not None}.values())
    tracing.child(span, "inference", ran, ran + int(inference_s * NS), batches)


def edge_spans(stats: dict[str, Any], arrived: float, done: float) -> None:
    """A traced request's `read body` (arrival to the handler) and `write answer` (the
    decoding and the response) spans, where the handler ran (the adapters write them)."""
    span, tracing = stats["span"], stats["tracing"]
    if "handler_at" in stats:
        tracing.child(span, "read body", wall_ns(arrived), wall_ns(stats["handler_at"]))
    if "answered_at" in stats:
        tracing.child(span, "write answer", wall_ns(stats["answered_at"]), wall_ns(done))


def start_tracing(settings: Settings) -> Tracing | None:
    return Tracing(settings) if settings.otlp_endpoint else None
