"""The standard grpc.health.v1.Health service, answering an unknown service name with a message."""
from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2


class HealthServicer(health.aio.HealthServicer):
    def __init__(self, services: tuple[str, ...]):
        super().__init__()
        self.services = services          # the names Check knows ("" is the whole server)

    async def Check(self, request: health_pb2.HealthCheckRequest, context) -> health_pb2.HealthCheckResponse:
        if request.service not in self.services:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"health: unknown service {request.service!r}; this server reports "
                                f"{', '.join(repr(s) for s in self.services)}")
        return await super().Check(request, context)
