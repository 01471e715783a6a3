"""How the clients reach the server: the channel (plaintext or TLS, optional client certificate) and the
bearer tokens sent as call metadata. Tokens default to ROLLOUT_AUTH_TOKEN / ROLLOUT_ADMIN_TOKEN."""
from __future__ import annotations

import os
from pathlib import Path

import grpc

_MB = 1024 * 1024


class Auth:
    """Call metadata: the client token for the data plane, the admin token for weight/drafter pushes."""

    def __init__(self, token: str | None, admin_token: str | None):
        self._token = token if token is not None else os.environ.get("ROLLOUT_AUTH_TOKEN", "")
        self._admin = admin_token if admin_token is not None else os.environ.get("ROLLOUT_ADMIN_TOKEN", "")

    def __repr__(self) -> str:
        return "Auth(<redacted>)"

    @staticmethod
    def _md(token: str):
        return (("authorization", f"Bearer {token}"),) if token else None

    def data(self):
        return self._md(self._token or self._admin)

    def admin(self):
        return self._md(self._admin or self._token)


def open_channel(target: str, *, max_message_mb: int = 64, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, aio: bool = False):
    """A channel to `target`; TLS when any of tls_ca / tls_cert is given (tls_ca: PEM roots to trust, e.g. a
    private CA; tls_cert + tls_key: this client's certificate for mutual TLS)."""
    options = [("grpc.max_receive_message_length", max_message_mb * _MB),
               ("grpc.max_send_message_length", max_message_mb * _MB)]
    mod = grpc.aio if aio else grpc
    if not (tls_ca or tls_cert):
        return mod.insecure_channel(target, options=options)
    read = lambda p: Path(p).read_bytes() if p else None          # noqa: E731
    creds = grpc.ssl_channel_credentials(root_certificates=read(tls_ca), private_key=read(tls_key),
                                         certificate_chain=read(tls_cert))
    return mod.secure_channel(target, creds, options=options)
