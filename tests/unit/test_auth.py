"""Token loading, loopback refusal and role checks (no server needed; the wire is tested in
tests/integration/test_security.py)."""
import pytest

from rollout_client.connection import Auth
from rollout_service.config import ConfigError, SecurityConfig, load_config
from rollout_service.server.auth import Credentials, client_id, load_credentials

T, A = "t" * 20, "a" * 20


@pytest.fixture(autouse=True)
def no_env_tokens(monkeypatch):
    monkeypatch.delenv("ROLLOUT_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("ROLLOUT_ADMIN_TOKEN", raising=False)


def files(tmp_path, token=T, admin=A) -> SecurityConfig:
    (tmp_path / "t").write_text(token + "\n")
    (tmp_path / "a").write_text(admin)
    return SecurityConfig(token_file=str(tmp_path / "t"), admin_token_file=str(tmp_path / "a"))


def test_no_tokens_on_loopback_means_no_auth():
    assert load_credentials(SecurityConfig(), "127.0.0.1") is None
    assert load_credentials(SecurityConfig(), "::1") is None


def test_non_loopback_without_auth_is_refused_unless_allowed():
    with pytest.raises(ConfigError, match="not loopback.*allow_insecure_remote"):
        load_credentials(SecurityConfig(), "0.0.0.0")
    assert load_credentials(SecurityConfig(allow_insecure_remote=True), "0.0.0.0") is None


def test_tokens_from_files_and_env(tmp_path, monkeypatch):
    creds = load_credentials(files(tmp_path), "0.0.0.0")
    assert (creds.token, creds.admin_token) == (T, A)
    monkeypatch.setenv("ROLLOUT_AUTH_TOKEN", T)
    monkeypatch.setenv("ROLLOUT_ADMIN_TOKEN", A)
    assert load_credentials(SecurityConfig(), "10.0.0.1").admin_token == A


@pytest.mark.parametrize("token,admin,match", [(T, "", "both"), ("short", A, "16 characters"), (T, T, "differ")])
def test_bad_token_setups_are_refused(tmp_path, token, admin, match):
    sec = files(tmp_path, token, admin)
    if not admin:
        sec = SecurityConfig(token_file=sec.token_file)
    with pytest.raises(ConfigError, match=match):
        load_credentials(sec, "127.0.0.1")


def test_missing_token_file_names_the_field(tmp_path):
    with pytest.raises(ConfigError, match="token_file.*not a readable file"):
        load_credentials(SecurityConfig(token_file=str(tmp_path / "nope"), admin_token_file=str(tmp_path / "x")),
                         "127.0.0.1")


def test_roles_and_redaction():
    c = Credentials(T, A)
    assert c.role(f"Bearer {A}") == "admin" and c.role(f"Bearer {T}") == "client"
    assert c.role(f"Bearer {T}x") is None and c.role(T) is None and c.role(None) is None
    assert T not in repr(c) and A not in repr(c) and T not in client_id(T)
    assert T not in repr(Auth(T, A))


def test_client_sends_the_admin_token_only_for_admin_calls():
    a = Auth(T, A)
    assert a.data() == (("authorization", f"Bearer {T}"),) and a.admin() == (("authorization", f"Bearer {A}"),)
    assert Auth("", "").data() is None


def test_security_config_rules():
    with pytest.raises(ConfigError, match="tls_cert and tls_key"):
        load_config(**{"security.tls_cert": "/x.pem"})
    with pytest.raises(ConfigError, match="tls_client_ca needs"):
        load_config(**{"security.tls_client_ca": "/ca.pem"})
    with pytest.raises(ConfigError, match="max_streams_per_client"):
        load_config(max_streams_per_client=0)


def test_readyz_answers_a_probe_without_a_token_and_says_no_more():
    """An orchestrator's readiness probe sends no token: /readyz answers it with ready / not ready only; a token
    adds each engine's state; a wrong token is refused; everything else still needs a token."""
    import asyncio

    import httpx

    from rollout_service.pool.pool import EnginePool
    from rollout_service.server.http_app import build_http_app
    from tests.fake_engine import FakeEngine

    async def main():
        pool = EnginePool([FakeEngine("e0", vocab_size=100)], max_queue=4)
        servicer = type("Servicer", (), {"pool": pool})()
        servicer.service = servicer                  # the service layer the HTTP dialects call (only its pool here)
        app = build_http_app(servicer, Credentials(T, A))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.get("/readyz")
            assert (r.status_code, r.json()) == (503, {"status": "not ready"})      # nothing about the engines
            r = await c.get("/readyz", headers={"Authorization": f"Bearer {T}"})
            assert r.status_code == 503 and r.json()["engines"] == {"e0": pool.engines[0].state.name}
            assert (await c.get("/readyz", headers={"Authorization": "Bearer wrong-token-0123456789"})).status_code \
                == 401
            assert (await c.get("/healthz", headers={"Authorization": "Bearer wrong"})).status_code == 200
            await pool.start()
            try:
                r = await c.get("/readyz")
                assert (r.status_code, r.json()) == (200, {"status": "ready"})
                for path in ("/v1/status", "/metrics", "/v1/models"):
                    assert (await c.get(path)).status_code == 401, path
            finally:
                await pool.shutdown()
    asyncio.run(main())


def test_unreadable_token_file_names_the_uid(tmp_path, monkeypatch):
    """A mounted secret the image's user cannot read (owned by another uid on the host) is named, not a traceback."""
    import os
    from pathlib import Path

    sec = files(tmp_path)

    def denied(self, *a, **kw):
        raise PermissionError(13, "Permission denied", str(self))
    monkeypatch.setattr(Path, "read_text", denied)
    with pytest.raises(ConfigError, match=f"token_file.*not readable by this process \\(uid {os.getuid()}\\)"):
        load_credentials(sec, "127.0.0.1")
