"""The one exception type the data and control planes raise toward the gRPC layer."""
from __future__ import annotations

import grpc


class ServiceError(Exception):
    """An error with the gRPC status code the client must see and a message a person can act on."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"ServiceError({self.code.name}, {self.message!r})"


def invalid(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


def unavailable(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAVAILABLE, message)
