"""Authentication, mutual TLS and per-client limits on a real service (tiny model, real vLLM, real sockets).

One service serves mutual TLS with a client token and an admin token read from files, and tight limits
(max_new_tokens, max_streams_per_client) so that each one can be hit."""
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from safetensors.torch import load_file

from rollout_client import RolloutClient
from tests.integration.services import running_service
from tests.pki import make_pki

TOKEN = "client-token-0123456789abcdef"
ADMIN = "admin-token-fedcba9876543210"
PROMPT = [[1, 504, 3458, 314, 260]]


@pytest.fixture(scope="module")
def secure(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("secure")
    pki = make_pki(d / "pki")
    (d / "token").write_text(TOKEN + "\n")
    (d / "admin").write_text(ADMIN + "\n")
    log = d / "service.log"
    with running_service(tiny_model, log, "--token-file", str(d / "token"), "--admin-token-file", str(d / "admin"),
                         "--tls-cert", pki["server"], "--tls-key", pki["server_key"], "--tls-client-ca", pki["ca"],
                         "--max-new-tokens", "256", "--max-streams-per-client", "2", "--max-message-mb", "1",
                         http_token=TOKEN, tls_ca=pki["ca"], client_cert=(pki["client"], pki["client_key"])) as svc:
        yield svc, pki, log


def connect(svc, pki, **kw) -> RolloutClient:
    tls = dict(tls_ca=pki["ca"], tls_cert=pki["client"], tls_key=pki["client_key"])
    tls.update({k: kw.pop(k) for k in list(kw) if k.startswith("tls_")})
    return RolloutClient(svc.target, **tls, **kw)


def code_of(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code(), e.value.details()


def test_calls_without_the_right_token_are_unauthenticated(secure):
    svc, pki, _ = secure
    for token in ("", "wrong-token-0123456789"):
        with connect(svc, pki, token=token, admin_token="") as c:
            code, msg = code_of(c.status)
            assert code == grpc.StatusCode.UNAUTHENTICATED and "bearer token" in msg
            code, _ = code_of(lambda: c.generate_all(PROMPT, max_tokens=4))
            assert code == grpc.StatusCode.UNAUTHENTICATED


def test_client_token_serves_data_but_not_weight_pushes(secure, tiny_model):
    svc, pki, _ = secure
    with connect(svc, pki, token=TOKEN, admin_token="") as c:
        before = c.status().policy_version
        assert len(c.generate_all(PROMPT, n=2, max_tokens=4)[0]) == 2
        weights = load_file(str(tiny_model / "model.safetensors"))
        code, msg = code_of(lambda: c.push_weights(weights, before + 1))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "admin token" in msg
        code, _ = code_of(lambda: c.load_weights(str(tiny_model), before + 1))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert c.status().policy_version == before
    with connect(svc, pki, token=TOKEN, admin_token=ADMIN) as c:
        # The service runs with --max-message-mb 1: the client's default 4 MiB chunks are refused, naming
        # the limit and changing nothing; smaller chunks go through.
        code, msg = code_of(lambda: c.push_weights(weights, before + 1))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_message_mb=1" in msg and "chunk_bytes" in msg
        assert c.status().policy_version == before
        assert c.push_weights(weights, before + 1, chunk_bytes=512 << 10).version == before + 1
        assert c.generate_all(PROMPT, max_tokens=4)[0][0].policy_version == before + 1


def test_health_checks_need_no_token(secure):
    svc, pki, _ = secure
    with connect(svc, pki, token="", admin_token="") as c:
        reply = health_pb2_grpc.HealthStub(c.channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_http_needs_a_token_except_the_probes(secure):
    svc, _, _ = secure
    assert svc.http_get("/healthz", token="")[0] == 200
    # a readiness probe sends no token: ready / not ready, nothing more; a wrong token is refused
    assert svc.http_get("/readyz", token="") == (200, '{"status":"ready"}')
    assert svc.http_get("/readyz", token="not-the-token-at-all")[0] == 401
    assert svc.http_get("/readyz", token=TOKEN)[0] == 200
    for path in ("/v1/status", "/metrics"):
        assert svc.http_get(path, token="")[0] == 401
        assert svc.http_get(path, token="not-the-token-at-all")[0] == 401
        assert svc.http_get(path, token=TOKEN)[0] == 200


def test_tls_refuses_clients_without_a_trusted_certificate(secure):
    svc, pki, _ = secure
    cases = [dict(tls_cert=None, tls_key=None),                 # no client certificate (mutual TLS)
             dict(tls_ca=pki["other-ca"])]                      # does not trust the server's CA
    for tls in cases:
        with connect(svc, pki, token=TOKEN, **tls) as c:
            code, _ = code_of(lambda: c.status(timeout=10))
            assert code == grpc.StatusCode.UNAVAILABLE
    with RolloutClient(svc.target, token=TOKEN) as plain:      # plaintext to a TLS port
        code, _ = code_of(lambda: plain.status(timeout=10))
        assert code == grpc.StatusCode.UNAVAILABLE


def test_limits_answer_with_their_name(secure):
    svc, pki, _ = secure
    with connect(svc, pki, token=TOKEN) as c:
        code, msg = code_of(lambda: c.generate_all(PROMPT, max_tokens=257))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "max_new_tokens=256" in msg
        code, msg = code_of(lambda: c.generate_all(["x" * (3 << 19)], max_tokens=4))    # 1.5 MiB > 1 MiB
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_message_mb=1" in msg
        # Two long streams open for this client; a third is refused, naming the limit.
        streams = [c.generate(PROMPT * 4, n=4, max_tokens=256, ignore_eos=True) for _ in range(2)]
        readers = [threading.Thread(target=lambda s=s: _drain(s), daemon=True) for s in streams]
        for r in readers:
            r.start()
        deadline = time.monotonic() + 60
        while c.status().queue_depth < 32 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert c.status().queue_depth >= 32, "both streams should be admitted"
        code, msg = code_of(lambda: c.generate_all(PROMPT, max_tokens=4))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_streams_per_client=2" in msg
        with connect(svc, pki, token=ADMIN) as other:           # another client is not affected
            assert len(other.generate_all(PROMPT, max_tokens=4)[0]) == 1
            # The queue bound (max_queue=64 in SERVICE_ARGS) is named too: 68 sequences never fit.
            code, msg = code_of(lambda: other.generate_all(PROMPT * 17, n=4, max_tokens=4))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queue is 64" in msg
        for r in readers:
            r.join(120)
        assert len(c.generate_all(PROMPT, max_tokens=4)[0]) == 1     # slots are released


def _drain(stream):
    for _ in stream:
        pass


def test_tokens_never_reach_the_log(secure):
    _, _, log = secure
    text = log.read_text()
    assert "bearer tokens" in text                      # the log does talk about authentication
    assert TOKEN not in text and ADMIN not in text


def test_non_loopback_bind_without_auth_is_refused(tiny_model):
    out = subprocess.run([sys.executable, "-m", "rollout_service.cli", "serve", "--model", str(tiny_model),
                          "--host", "0.0.0.0", "--grpc-port", "0", "--http-port", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "without authentication" in out.stderr and "allow_insecure_remote" in out.stderr
