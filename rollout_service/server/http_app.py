"""The HTTP side port: liveness, readiness, Prometheus metrics and a JSON status (FastAPI)."""
from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request, Response
from google.protobuf.json_format import MessageToDict
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

router = APIRouter()


@router.get("/healthz")
def healthz() -> dict:
    """The process is alive and answering."""
    return {"status": "ok"}


@router.get("/readyz")
def readyz(request: Request, response: Response) -> dict:
    """Every engine is ready to serve (503 while starting, shutting down or with an unhealthy engine).

    Open to readiness probes, which send no token: without one the answer is only ready / not ready. With a
    token (or without authentication) a 503 also names each engine's state."""
    pool = request.app.state.servicer.pool
    if not pool.ready:
        response.status_code = 503
        if request.app.state.creds is not None and getattr(request.state, "role", None) is None:
            return {"status": "not ready"}
        return {"status": "not ready", "engines": {e.id: e.state.name for e in pool.engines}}
    return {"status": "ready"}


@router.get("/metrics")
def metrics(request: Request) -> Response:
    """Prometheus text format."""
    servicer = request.app.state.servicer
    t = servicer.pool.telemetry
    t.m_policy.set(servicer.pool.policy_version)
    t.m_draft.set(servicer.pool.draft_version)
    return Response(generate_latest(t.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/status")
def status(request: Request) -> dict:
    """The same content as the GetStatus RPC, as JSON."""
    creds = request.app.state.creds
    tenant = creds.tenant(getattr(request.state, "role", None)) if creds is not None else None
    return MessageToDict(request.app.state.servicer.status(tenant), preserving_proto_field_name=True,
                         always_print_fields_with_no_presence=True)


def build_http_app(servicer, creds=None, session_key_from=None, tokens_as_ids: bool = False) -> FastAPI:
    """creds: server.auth.Credentials; with them every path but the probes' (/healthz, /health; /readyz, which
    without a token answers only ready / not ready) needs a bearer token. session_key_from: where the dialects read
    a request's session key (config.SessionConfig.key_from; None: its default). tokens_as_ids: the vLLM dialect's
    default for return_tokens_as_token_ids (config.ServerConfig.return_tokens_as_token_ids)."""
    app = FastAPI(title="rollout-service", docs_url=None, redoc_url=None)
    app.state.servicer = servicer
    app.state.creds = creds
    if creds is not None:
        from rollout_service.server.auth import http_middleware

        app.middleware("http")(http_middleware(creds))
    app.include_router(router)
    # vLLM's and SGLang's HTTP dialects, translated onto the same pool (server/compat/, docs/http-dialects.md)
    from rollout_service.server.compat.gateway import Gateway
    from rollout_service.server.compat import sglang_api, vllm_api, vllm_chat, vllm_extras

    # the service layer, as gRPC calls it
    app.state.gateway = Gateway(servicer.service, session_key_from, tokens_as_ids)
    app.include_router(vllm_api.router)
    app.include_router(vllm_chat.router)
    app.include_router(vllm_extras.router)
    app.include_router(sglang_api.router)
    return app
