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


def refused_by_engine(exc: BaseException) -> ServiceError | None:
    """INVALID_ARGUMENT for an engine's refusal of what the client sent (vLLM's VLLMClientError family, such
    as VLLMValidationError, raised before the request is scheduled), naming the field where the engine does;
    None for any other failure. Matched by class name, so nothing here imports vLLM (a Ray actor's error
    keeps the class of its cause)."""
    if not any(c.__name__ == "VLLMClientError" for c in type(exc).__mro__):
        return None
    param = getattr(exc, "parameter", None)
    return invalid(f"{f'sampling.{param}' if param else 'request'}: the engine refused it ({exc}); this request "
                   "cannot succeed as sent, do not retry it unchanged")
