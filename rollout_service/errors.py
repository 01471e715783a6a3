"""The one exception type the data and control planes raise toward the gRPC layer.

An error about a field of the request carries that field as data (`field`: the contract's path, such as
"sampling.max_tokens" or "prompts[3].token_ids"), and its text as parts in which every name from the contract
(a field path, an RPC) is a `Name`. gRPC clients read `message`, the parts joined; an HTTP dialect spells each
Name its own way (server/compat/gateway.py) and never rewrites the text."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import grpc


@dataclass(frozen=True)
class Name:
    """A name from the contract inside an error's text: a field path ("sampling.max_tokens", "prompts[0]",
    "n") or an RPC ("InitWeightTransfer"). `text`: how gRPC writes it where that is not the path itself
    ("lower max_tokens" names sampling.max_tokens)."""
    path: str
    text: str | None = None

    def __str__(self) -> str:
        return self.path if self.text is None else self.text


Part = str | Name


class ServiceError(Exception):
    """An error with the gRPC status code the client must see and a message a person can act on.

    message: the text, or its parts (strings and Names). field: the contract's path of the field the error is
    about (None: not about one field); it appears in the parts as Name(field)."""

    def __init__(self, code: grpc.StatusCode, message: str | Iterable[Part], field: str | None = None):
        parts = (message,) if isinstance(message, str) else tuple(message)
        text = "".join(map(str, parts))
        super().__init__(text)
        self.code = code
        self.parts: tuple[Part, ...] = parts
        self.field = field
        self.message = text

    def __repr__(self) -> str:
        return f"ServiceError({self.code.name}, {self.message!r})"


def invalid(message: str | Iterable[Part]) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


def about_field(code: grpc.StatusCode, field: str, *detail: Part, sep: str = ": ", rpc: str = "") -> ServiceError:
    """An error about one field of the request: "[rpc: ]field{sep}detail" (sep ": ", or " " for the messages
    that read "field must be ..."). A contract name the detail mentions is given as a Name."""
    head: tuple[Part, ...] = (Name(rpc), ": ") if rpc else ()
    return ServiceError(code, (*head, Name(field), sep, *detail), field=field)


def invalid_field(field: str, *detail: Part, sep: str = ": ", rpc: str = "") -> ServiceError:
    """INVALID_ARGUMENT about `field` (the contract's path): see about_field."""
    return about_field(grpc.StatusCode.INVALID_ARGUMENT, field, *detail, sep=sep, rpc=rpc)


def unavailable(message: str | Iterable[Part]) -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAVAILABLE, message)


def refused_by_engine(exc: BaseException) -> ServiceError | None:
    """INVALID_ARGUMENT for an engine's refusal of what the client sent (vLLM's VLLMClientError family, such
    as VLLMValidationError, raised before the request is scheduled), naming the field where the engine does;
    None for any other failure. Matched by class name, so nothing here imports vLLM (a Ray actor's error
    keeps the class of its cause)."""
    if not any(c.__name__ == "VLLMClientError" for c in type(exc).__mro__):
        return None
    detail = (f"the engine refused it ({exc}); this request cannot succeed as sent, do not retry it unchanged")
    param = getattr(exc, "parameter", None)
    if param:
        return invalid_field(f"sampling.{param}", detail)
    return invalid(f"request: {detail}")
