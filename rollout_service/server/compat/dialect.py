"""The words every HTTP dialect shares, with nothing below them in server/compat/: a refusal (DialectError, its
HTTP status from the gRPC code), how a dialect spells the contract's names (Spelling), typed reads of a JSON body
(Fields). gateway.py (the service layer's calls) and vllm_transfer.py (vLLM's weight-transfer endpoints) both
build on this module; neither imports the other's callers."""
from __future__ import annotations

from collections.abc import Mapping

import grpc
import msgspec
from fastapi.responses import JSONResponse

from rollout_service.errors import Name, ServiceError

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.FAILED_PRECONDITION: 409, grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPE = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
              404: "NotFoundError", 409: "ConflictError", 429: "RateLimitError", 501: "NotImplementedError",
              503: "ServiceUnavailableError"}

# How a dialect spells the contract's names (field paths, RPCs): each key is a whole name or a leading part of
# one that ends where a path component does ("sampling." or "prompts[", or "prompts" before a "." or "["); the
# longest key that fits is replaced by its value. {"sampling.max_tokens": "max_tokens", "sampling.": ""} spells
# sampling.max_tokens "max_tokens" and sampling.top_p "top_p"; {"prompts": "prompt"} spells prompts[3].token_ids
# "prompt[3].token_ids". A name no key fits is spelled as gRPC spells it.
Spelling = Mapping[str, str]


def spell(path: str, spelling: Spelling) -> str | None:
    """`path` (a contract name) as the dialect spells it; None where no key of `spelling` fits it."""
    best = None
    for key in spelling:
        fits = path == key or (path.startswith(key) and (key[-1:] in (".", "[") or path[len(key)] in ".["))
        if fits and (best is None or len(key) > len(best)):
            best = key
    return None if best is None else spelling[best] + path[len(best):]


class DialectError(Exception):
    """A request a dialect cannot serve as sent: an HTTP status, a message naming the field, and the field
    (OpenAI's error.param) as the dialect spells it."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def from_service_error(e: ServiceError, spelling: Spelling | None = None) -> DialectError:
    """The error gRPC gives, its contract names (the field at fault, the fields and RPCs it mentions) spelled
    as the dialect spells them; param: the field at fault. The rest of the text is gRPC's, unchanged."""
    spelling = spelling or {}

    def text(part) -> str:
        if isinstance(part, Name):
            theirs = spell(part.path, spelling)
            return str(part) if theirs is None else theirs
        return part
    param = None if e.field is None else spell(e.field, spelling) or e.field
    return DialectError(HTTP_STATUS.get(e.code, 500), "".join(map(text, e.parts)), param)


class FastJSONResponse(JSONResponse):
    """A JSON answer encoded by msgspec: 4-10x faster than the json module on log-prob-heavy answers (the same JSON
    but for a non-finite float, which is null here and an error (500) in JSONResponse)."""

    def render(self, content) -> bytes:
        return msgspec.json.encode(content)


def sse_event(obj) -> str:
    """One server-sent event carrying `obj` as JSON (msgspec, as FastJSONResponse)."""
    return f"data: {msgspec.json.encode(obj).decode()}\n\n"


def error_response(e: DialectError) -> JSONResponse:
    """OpenAI's error shape (vLLM and SGLang answer in it; the openai client raises its typed errors from it)."""
    body = {"object": "error", "message": e.message,
            "error": {"message": e.message, "type": ERROR_TYPE.get(e.status, "InternalServerError"),
                      "param": e.param, "code": e.status}}
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    return JSONResponse(body, status_code=e.status, headers=headers)


def json_body(raw: bytes) -> dict:
    import json

    try:
        body = json.loads(raw or b"{}")
    except ValueError as e:
        raise DialectError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise DialectError(400, "the request body must be a JSON object")
    return body


class Fields:
    """Typed reads of a JSON object; a wrong type is a 400 naming the field (prefix: where it sits)."""

    def __init__(self, body: dict, prefix: str = ""):
        self.body, self.prefix = body, prefix

    def _bad(self, key: str, what: str, value) -> DialectError:
        return DialectError(400, f"{self.prefix}{key}: must be {what}, got {value!r:.80}", self.prefix + key)

    def get(self, key: str, default=None):
        v = self.body.get(key)
        return default if v is None else v

    def bool(self, key: str, default: bool = False) -> bool:
        v = self.get(key, default)
        if not isinstance(v, bool):
            raise self._bad(key, "true or false", v)
        return v

    def int(self, key: str, default=None):
        v = self.get(key, default)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise self._bad(key, "an integer", v)
        return v

    def float(self, key: str, default=None):
        v = self.get(key, default)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise self._bad(key, "a number", v)
        return None if v is None else float(v)

    def str_list(self, key: str) -> list[str]:
        v = self.get(key, [])
        v = [v] if isinstance(v, str) else v
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise self._bad(key, "a string or a list of strings", v)
        return v

    def int_list(self, key: str) -> list[int]:
        v = self.get(key, [])
        if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            raise self._bad(key, "a list of integers", v)
        return v

    def unsupported(self, key: str, default, why: str) -> None:
        """A parameter this service does not implement: fine at its default value, a 400 otherwise."""
        v = self.body.get(key)
        if v is not None and v != default:
            raise DialectError(400, f"{self.prefix}{key}: {why} (got {v!r:.80})", self.prefix + key)
