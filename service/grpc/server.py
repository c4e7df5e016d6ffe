"""The gRPC server: one `grpc.aio` server a serving process, on `BERTSERVE_GRPC_PORT` beside
the HTTP port, in the same event loop, over the same models, batchers and limits. Several
workers bind the one port (SO_REUSEPORT), as they share the HTTP socket.

A call is admitted as an HTTP request to its JSON route is (`admitted_call`: the same caps,
429s and drain), authenticated by its `authorization` metadata (`Bearer <key>`, as HTTP),
answered by the same `handle`, and refused with the gRPC status code of its HTTP status
(`STATUS`). The standard health service (`grpc.health.v1`) says SERVING while the service is
ready; reflection is served when `BERTSERVE_GRPC_REFLECTION` is set."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bertserve.service.grpc import oip, tei
from bertserve.service.state import ServiceState

log = logging.getLogger("bertserve")


class Health(health_pb2_grpc.HealthServicer):
    """grpc.health.v1: SERVING while the service is ready (as GET /health/ready), for the
    server ("") and each service it serves."""

    def __init__(self, state: ServiceState, services: list[str]) -> None:
        self.state, self.services = state, {"", *services}

    def _status(self, service: str) -> int:
        if service not in self.services:
            return health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        if self.state.ready:
            return health_pb2.HealthCheckResponse.SERVING
        return health_pb2.HealthCheckResponse.NOT_SERVING

    async def Check(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        status = self._status(request.service)
        if status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        last = None
        while True:
            status = self._status(request.service)
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(0.5)


async def start(state: ServiceState) -> grpc.aio.Server | None:
    """The gRPC server on `grpc_port` (None: no gRPC), started; its services: the Open
    Inference Protocol's and TEI's (service.grpc.oip, service.grpc.tei), health, reflection
    if asked."""
    settings = state.settings
    if settings.grpc_port is None:
        return None
    limit = settings.max_body_bytes
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", max(settings.max_response_bytes, limit) + 65536),
            ("grpc.so_reuseport", 1),
        ],
    )
    names = [oip.add(server, state), *tei.add(server, state)]
    health_pb2_grpc.add_HealthServicer_to_server(Health(state, names), server)
    if settings.grpc_reflection:
        from grpc_reflection.v1alpha import reflection

        reflection.enable_server_reflection(
            [
                *names,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ],
            server,
        )
    address = f"{settings.host}:{settings.grpc_port}"
    state.grpc_port = server.add_insecure_port(address)
    await server.start()
    log.info("gRPC serving %s on %s:%d", ", ".join(names), settings.host, state.grpc_port)
    return server


async def stop(server: grpc.aio.Server | None, grace_s: float) -> None:
    if server is not None:
        await server.stop(grace_s)
