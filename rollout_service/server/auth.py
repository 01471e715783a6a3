"""Who may call what: bearer tokens on gRPC metadata and on the HTTP port, TLS credentials from files.

Two tokens: the client token opens the data plane (Generate, GetStatus, reflection, HTTP status and
metrics); the admin token opens everything, including the control plane (PushWeights, UpdateDraft,
LoadWeights, the weight-transfer RPCs). gRPC health checks and HTTP /healthz, /health and /readyz stay open so
probes need no secret (/readyz without a token says only ready or not ready). Tokens are compared in constant time
and never logged: a client is named in logs and limits by a short hash.
"""
from __future__ import annotations

import contextvars
import hashlib
import hmac
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from rollout_service.config import ConfigError, SecurityConfig, is_loopback

log = logging.getLogger(__name__)

ADMIN_METHODS = frozenset(f"/rollout.v1.RolloutService/{m}" for m in (
    "PushWeights", "UpdateDraft", "LoadWeights", "ScaleEngines", "InitWeightTransfer", "TransferWeights",
    "CloseWeightTransfer", "UnloadAdapter"))
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
# Probes send no token. Liveness (/healthz, the vLLM dialect's /health) is open whatever is sent; readiness (/readyz)
# answers a caller without a token only "ready" or "not ready" (with a token: each engine's state; a wrong one: 401)
OPEN_HTTP_PATHS = frozenset({"/healthz", "/health"})
PROBE_HTTP_PATHS = frozenset({"/readyz"})
# HTTP dialect endpoints that change what is served or stop others' work: the admin token, as on gRPC
ADMIN_HTTP_PATHS = frozenset({
    "/update_weights", "/update_weights_from_disk", "/pause", "/resume", "/abort_requests", "/reset_prefix_cache",
    "/pause_generation", "/continue_generation", "/abort_request", "/flush_cache", "/init_weight_transfer_engine",
    "/start_weight_update", "/finish_weight_update", "/start_draft_weight_update", "/shutdown_weight_transfer_engine",
    "/init_weights_update_group", "/update_weights_from_distributed", "/update_weights_from_tensor",
    "/update_weights_from_ipc", "/destroy_weights_update_group", "/collective_rpc", "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter", "/load_lora_adapter", "/unload_lora_adapter"})


def _read_secret(path: str, env: str, what: str) -> str:
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"security.{what}: {p} is not a readable file")
        try:
            value = p.read_text().strip()
        except PermissionError:
            raise ConfigError(f"security.{what}: {p} is not readable by this process (uid {os.getuid()}); in a "
                              "container, give the mounted file (or compose secret) to that uid") from None
    else:
        value = os.environ.get(env, "").strip()
    if value and len(value) < 16:
        raise ConfigError(f"security.{what} (or {env}): a token needs at least 16 characters")
    return value


def client_id(token: str) -> str:
    """A name for a token that is safe to log."""
    return "token:" + hashlib.sha256(token.encode()).hexdigest()[:8]


@dataclass(frozen=True)
class Tenant:
    """A tenant's scope and quota (config.TenantConfig, its token read)."""
    name: str
    policies: tuple[str, ...]         # adapter names; a trailing '*' matches a prefix
    max_sequences: int                # 0: no quota beyond max_queue

    def owns(self, policy: str) -> bool:
        """Whether this tenant may sample and push adapter `policy` (never the base policy, "")."""
        return bool(policy) and any(policy == p or (p.endswith("*") and policy.startswith(p[:-1]))
                                    for p in self.policies)


TENANT_METHODS = frozenset(f"/rollout.v1.RolloutService/{m}" for m in ("PushWeights", "LoadWeights",
                                                                       "UnloadAdapter"))


@dataclass(frozen=True, repr=False)
class Credentials:
    token: str
    admin_token: str
    tenants: tuple[tuple[str, Tenant], ...] = ()     # (token, tenant)

    def __repr__(self) -> str:          # never print the secrets
        return "Credentials(<redacted>)"

    def role(self, authorization: str | None) -> str | None:
        """'admin', 'client', 'tenant:<name>' or None for an `authorization` header value."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        given = authorization[len("Bearer "):].strip().encode()
        if hmac.compare_digest(given, self.admin_token.encode()):
            return "admin"
        if hmac.compare_digest(given, self.token.encode()):
            return "client"
        for token, tenant in self.tenants:
            if hmac.compare_digest(given, token.encode()):
                return f"tenant:{tenant.name}"
        return None

    def tenant(self, role: str | None) -> Tenant | None:
        if role and role.startswith("tenant:"):
            return next(t for _, t in self.tenants if t.name == role[len("tenant:"):])
        return None


def load_credentials(sec: SecurityConfig, host: str) -> Credentials | None:
    """The server's tokens (None: no authentication). Refuses a non-loopback bind without them unless
    security.allow_insecure_remote is set."""
    token = _read_secret(sec.token_file, "ROLLOUT_AUTH_TOKEN", "token_file")
    admin = _read_secret(sec.admin_token_file, "ROLLOUT_ADMIN_TOKEN", "admin_token_file")
    if bool(token) != bool(admin):
        raise ConfigError("security: set both a client token and a separate admin token (token_file and "
                          "admin_token_file, or ROLLOUT_AUTH_TOKEN and ROLLOUT_ADMIN_TOKEN), or neither")
    if token and hmac.compare_digest(token, admin):
        raise ConfigError("security: the admin token must differ from the client token")
    tenants = []
    for i, t in enumerate(sec.tenants):
        value = _read_secret(t.token_file, t.token_env or "-", f"tenants[{i}].token_file")
        if not value:
            raise ConfigError(f"security.tenants[{i}] ({t.name}): no token (token_file empty or {t.token_env} unset)")
        if value in (token, admin) or any(value == v for v, _ in tenants):
            raise ConfigError(f"security.tenants[{i}] ({t.name}): its token must differ from every other token")
        tenants.append((value, Tenant(t.name, tuple(t.policies), t.max_sequences)))
    if not token and not is_loopback(host):
        if not sec.allow_insecure_remote:
            raise ConfigError(f"refusing to serve {host} (not loopback) without authentication: set "
                              "security.token_file and security.admin_token_file (and TLS), or set "
                              "security.allow_insecure_remote = true if the network is trusted")
        log.warning("serving %s without authentication (security.allow_insecure_remote)", host)
    return Credentials(token, admin, tuple(tenants)) if token else None


def server_credentials(sec: SecurityConfig) -> grpc.ServerCredentials | None:
    if not sec.tls_cert:
        return None
    key, cert = Path(sec.tls_key).read_bytes(), Path(sec.tls_cert).read_bytes()
    ca = Path(sec.tls_client_ca).read_bytes() if sec.tls_client_ca else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def _denying_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str):
    async def deny(_request, context):
        await context.abort(code, message)

    kind = ("stream" if handler.request_streaming else "unary") + "_" + \
           ("stream" if handler.response_streaming else "unary")
    make = getattr(grpc, f"{kind}_rpc_method_handler")
    return make(deny, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, creds: Credentials):
        self.creds = creds

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        auth = next((v for k, v in (details.invocation_metadata or ()) if k == "authorization"), None)
        role = self.creds.role(auth if isinstance(auth, str) else None)
        if role is None:
            return _denying_handler(handler, grpc.StatusCode.UNAUTHENTICATED,
                                    f"{method}: missing or wrong bearer token; send metadata "
                                    "'authorization: Bearer <token>' (RolloutClient(token=...))")
        if method in ADMIN_METHODS and role != "admin" and not (role.startswith("tenant:") and
                                                                method in TENANT_METHODS):
            return _denying_handler(handler, grpc.StatusCode.PERMISSION_DENIED,
                                    f"{method} changes what the service serves and needs the admin token "
                                    "(RolloutClient(admin_token=...))")
        return handler


# The tenant of the HTTP request being served (set by http_middleware; gRPC passes it to service.admit instead).
CALLER_TENANT: contextvars.ContextVar[Tenant | None] = contextvars.ContextVar("caller_tenant", default=None)


def tenant_of(context, creds: Credentials | None) -> Tenant | None:
    """The tenant whose token made this call (None: admin, client or no authentication)."""
    if creds is None or not creds.tenants:
        return None
    auth = dict(context.invocation_metadata() or ()).get("authorization")
    return creds.tenant(creds.role(auth if isinstance(auth, str) else None))


def check_scope(tenant: Tenant | None, role: str | None, policy: str, what: str, field: str = "policy") -> None:
    """PERMISSION_DENIED unless the caller may `what` (sample, push) `policy`: a tenant only its own adapters; the
    base policy ("") the admin or the client token (with tenants configured); anything else as before."""
    from rollout_service.errors import about_field

    if tenant is not None and not tenant.owns(policy):
        target = f"adapter {policy!r}" if policy else "the base policy"
        raise about_field(grpc.StatusCode.PERMISSION_DENIED, field,
                          f"tenant {tenant.name!r} may not {what} {target} (its policies: "
                          f"{', '.join(tenant.policies) or 'none'}); the base policy needs the admin token")


def caller_id(context, creds: Credentials | None) -> str:
    """Whom a call counts against for per-client limits: its token (hashed), else its peer address."""
    if creds is not None:
        auth = dict(context.invocation_metadata() or ()).get("authorization", "")
        return client_id(auth)
    peer = context.peer() or "unknown"              # "ipv4:127.0.0.1:53412"
    return peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer


def http_middleware(creds: Credentials):
    """FastAPI middleware: a bearer token (client or admin) on every path except the probes'. OPEN_HTTP_PATHS take any
    request; PROBE_HTTP_PATHS one without a token too (request.state.role None: the handler says less)."""
    from fastapi.responses import JSONResponse

    def refuse(status: int, message: str, **headers):
        return JSONResponse({"object": "error", "message": message,
                             "error": {"message": message, "type": "AuthenticationError" if status == 401 else
                                       "PermissionDeniedError", "param": None, "code": status}},
                            status_code=status, headers=headers or None)

    async def check(request, call_next):
        path = request.url.path
        if path in OPEN_HTTP_PATHS:
            return await call_next(request)
        sent = request.headers.get("authorization")
        role = request.state.role = creds.role(sent)
        CALLER_TENANT.set(creds.tenant(role))        # the dialects' admission reads it (service.admit)
        if path in PROBE_HTTP_PATHS and not sent:
            return await call_next(request)
        if role is None:
            return refuse(401, "missing or wrong bearer token: send 'Authorization: Bearer <token>'",
                          **{"WWW-Authenticate": "Bearer"})
        if path in ADMIN_HTTP_PATHS and role != "admin":
            return refuse(403, f"{path} changes what the service serves and needs the admin token "
                               "('Authorization: Bearer <admin token>')")
        return await call_next(request)
    return check
