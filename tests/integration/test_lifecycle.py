"""Cancellation, idempotent retries, queue bound, health, reflection and the HTTP port."""
import json
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

LONG = dict(max_tokens=400, ignore_eos=True, temperature=1.0)


def wait_idle(client, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = client.status()
        if st.queue_depth == 0 and all(e.running_sequences == 0 for e in st.engines):
            return st
        time.sleep(0.1)
    raise AssertionError(f"service still busy after {timeout} s: queue_depth={client.status().queue_depth}")


def test_client_cancellation_aborts_engine_work(client):
    wait_idle(client)
    call = client.stub.Generate(__import__("rollout_client").build_request([[1, 2, 3]] * 4, n=4, **LONG))
    deadline = time.monotonic() + 20
    while client.status().queue_depth < 16 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.status().queue_depth == 16
    call.cancel()
    st = wait_idle(client, timeout=15)
    # The aborted sequences never finished: the finished-sample count did not move by 16.
    tokens_then = st.tokens_total
    time.sleep(1.0)
    assert client.status().tokens_total == tokens_then, "engine kept generating after cancellation"


def test_retry_with_same_request_id_returns_the_same_samples(client):
    kwargs = dict(n=3, max_tokens=12, ignore_eos=True, temperature=1.0, request_id="idem-1")  # no seed
    first = client.generate_all([[1, 5, 9], [1, 7]], **kwargs)
    again = client.generate_all([[1, 5, 9], [1, 7]], **kwargs)
    fresh = client.generate_all([[1, 5, 9], [1, 7]], **{**kwargs, "request_id": "idem-2"})
    tokens = lambda g: [[s.token_ids.tolist() for s in group] for group in g]  # noqa: E731
    assert tokens(first) == tokens(again)
    assert tokens(first) != tokens(fresh), "unseeded fresh request should sample anew"
    with pytest.raises(grpc.RpcError) as e:
        client.generate_all([[1, 2]], **kwargs)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "idem-1" in e.value.details()


def test_retry_after_cancelled_attempt_runs_to_completion(client):
    from rollout_client import build_request

    req = build_request([[1, 2, 3]], n=2, request_id="idem-cancel", **{**LONG, "max_tokens": 60})
    call = client.stub.Generate(req)
    time.sleep(0.3)
    call.cancel()
    wait_idle(client)
    samples = list(client.stub.Generate(req))
    assert len(samples) == 2 and all(len(s.token_ids) == 60 for s in samples)


def test_full_queue_answers_resource_exhausted_then_recovers(client):
    from rollout_client import build_request

    wait_idle(client)
    big = client.stub.Generate(build_request([[1, 2, 3]] * 15, n=4, **LONG))   # 60 of max_queue 64
    deadline = time.monotonic() + 20
    while client.status().queue_depth < 60 and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate([[4, 5, 6]] * 2, n=4, max_tokens=4))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queue is 64" in e.value.details()
    big.cancel()
    wait_idle(client)
    assert len(list(client.generate([[4, 5, 6]] * 2, n=4, max_tokens=4))) == 8


def test_concurrent_streams_each_get_exactly_their_samples(client):
    results, errors = {}, []

    def worker(i):
        try:
            got = client.generate_all([[1, 100 + i], [1, 200 + i]], n=2, max_tokens=8, seed=i)
            results[i] = [(s.prompt_index, s.sample_index) for g in got for s in g]
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert not errors and len(results) == 6
    assert all(sorted(v) == [(0, 0), (0, 1), (1, 0), (1, 1)] for v in results.values())


def test_health_and_reflection(client):
    health = health_pb2_grpc.HealthStub(client.channel)
    for name in ("", "rollout.v1.RolloutService"):
        assert health.Check(health_pb2.HealthCheckRequest(service=name)).status == \
            health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert {"rollout.v1.RolloutService", "grpc.health.v1.Health"} <= names


def test_http_port(service, client):
    assert service.http_get("/healthz") == (200, '{"status":"ok"}')
    assert service.http_get("/readyz")[0] == 200
    list(client.generate([[1, 2]], n=2, max_tokens=3))
    with pytest.raises(grpc.RpcError):
        list(client.generate([[1, 2]], n=1, max_tokens=0))
    code, text = service.http_get("/metrics")
    assert code == 200
    assert "rollout_samples_total" in text and "rollout_generated_tokens_total" in text
    assert 'rollout_generate_requests_total{code="OK"}' in text
    assert 'rollout_generate_requests_total{code="INVALID_ARGUMENT"}' in text
    code, text = service.http_get("/v1/status")
    status = json.loads(text)
    assert code == 200 and status["ready"] is True and status["engines"][0]["state"] == "ENGINE_STATE_READY"
    # proto3 JSON mapping: int64 fields are strings
    assert int(status["samples_total"]) >= 2 and status["vocab_size"] == 49152
