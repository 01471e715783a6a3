"""Faults survived, on real vLLM over real sockets: an engine process killed mid-stream, a client that
does not read its stream, SIGTERM with streams and a weight push in flight. The kill and SIGTERM tests run their own
service (in this order: the last one ends it), with engine.weight_reload = in_place, so real vLLM covers that commit
path too (the shared service prepares beside the served weights: test_weights.py)."""
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import psutil
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rollout_client import RolloutClient
from rollout_client.weights import push_stream
from rollout_service.api import pb
from tests.tiny_models import perturbed_copy
from rollout_service.drafting.reference import processed_logprobs
from tests.integration.services import running_service, wait_for

PROMPT = [[1, 504, 3458, 314, 260]]


def engine_cores(pid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if "EngineCore" in " ".join(p.cmdline()) or "EngineCore" in p.name():
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("state")


@pytest.fixture(scope="module")
def own(tiny_model, tmp_path_factory, state_dir):
    log = tmp_path_factory.mktemp("faults") / "service.log"
    with running_service(tiny_model, log, "--weight-reload", "in_place", "--state-dir", str(state_dir),
                         clean_exit=False) as svc:
        yield svc, log


def test_killed_engine_is_restarted_at_the_committed_version(own, tiny_model, tmp_path):
    svc, log = own
    v1 = perturbed_copy(tiny_model, tmp_path / "v1", scale=0.05, seed=3)
    pushed = load_file(str(v1 / "model.safetensors"))
    with RolloutClient(svc.target) as c:
        res = c.push_weights(pushed, 1)
        assert res.version == 1 and res.prepare_s == 0 and res.apply_s > 0     # loaded in place, paused
        before = c.generate_all(PROMPT, n=2, max_tokens=12, seed=7, temperature=1.0)[0]
        reference = AutoModelForCausalLM.from_pretrained(v1, dtype=torch.float32).eval()
        for s in before:                                 # the in-place load serves the pushed weights
            ref = processed_logprobs(reference, PROMPT[0], s.token_ids.tolist(), 1.0, 0, 1.0)
            np.testing.assert_allclose(s.logprobs, ref.numpy(), atol=2e-3, rtol=0)
        [core] = engine_cores(svc.proc.pid)
        errors = []

        def long_stream():
            try:
                list(c.generate(PROMPT * 2, n=2, max_tokens=450, ignore_eos=True, request_id="in-flight-at-kill"))
            except grpc.RpcError as e:
                errors.append(e)

        t = threading.Thread(target=long_stream)
        t.start()
        wait_for(lambda: c.status().queue_depth >= 4, 30, "the long stream to be admitted")
        os.kill(core.pid, signal.SIGKILL)
        t.join(60)
        assert len(errors) == 1 and errors[0].code() == grpc.StatusCode.UNAVAILABLE, errors
        assert "retry" in errors[0].details()
        def restarted():
            s = c.status()
            return s if s.engines[0].restarts == 1 and s.ready else None

        st = wait_for(restarted, 240, "the engine to come back")
        assert st.policy_version == 1 and st.engines[0].policy_version == 1
        assert st.queue_depth == 0
        [new_core] = engine_cores(svc.proc.pid)
        assert new_core.pid != core.pid
        after = c.generate_all(PROMPT, n=2, max_tokens=12, seed=7, temperature=1.0)[0]
        for a, b in zip(before, after):                  # same seed, same committed weights: same samples
            assert list(a.token_ids) == list(b.token_ids) and a.policy_version == b.policy_version == 1
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
        # the request that was cut runs again under its id
        retry = c.generate_all(PROMPT * 2, n=2, max_tokens=450, ignore_eos=True, request_id="in-flight-at-kill")
        assert sum(len(g) for g in retry) == 4
    code, metrics = svc.http_get("/metrics")
    assert code == 200 and 'rollout_engine_restarts_total{engine="engine-0"} 1.0' in metrics
    assert "engine core died" in log.read_text()


def test_slow_reader_is_buffered_boundedly_and_loses_nothing(service, client):
    """A client that stops reading: generation finishes anyway (the engine is not held up), the finished
    samples wait in the request's record (bounded by the request's size limits), and are all delivered
    when it reads again. Three rounds: the service's memory does not grow round over round."""
    proc = psutil.Process(service.proc.pid)
    rss = []
    for r in range(3):
        done_before = client.status().samples_total
        stream = client.generate(PROMPT * 4, n=8, max_tokens=200, ignore_eos=True, request_id=f"slow-{r}")
        first = next(stream)                                      # then read nothing for a while
        wait_for(lambda d=done_before: client.status().samples_total >= d + 32, 120, "generation to finish")
        assert client.status().queue_depth == 0                  # engine work is done while unread
        rest = list(stream)
        got = sorted((s.prompt_index, s.sample_index) for s in [first, *rest])
        assert got == sorted((p, s) for p in range(4) for s in range(8))
        assert all(len(s.token_ids) == 200 for s in [first, *rest])
        rss.append(proc.memory_info().rss)
    assert (rss[2] - rss[0]) / 2**20 < 32, f"memory grew round over round: {[x // 2**20 for x in rss]} MB"


def test_sigterm_with_streams_and_a_push_in_flight_exits_cleanly(own, tiny_model):
    """SIGTERM while generation streams run and a trainer hangs mid-push: the streams end UNAVAILABLE saying the
    server is shutting down, the push fails, the process exits 0, and neither an engine process nor the staging
    folder (RAM on /dev/shm) outlives it."""
    svc, _ = own
    weights = load_file(str(tiny_model / "model.safetensors"))
    msgs = list(push_stream(weights, 99, target=pb.TARGET_POLICY, chunk_bytes=1 << 16))
    stall = threading.Event()
    push_errors, stream_errors = [], []

    def stalled():
        yield from msgs[: len(msgs) // 2]
        stall.set()
        time.sleep(120)                                       # the trainer hangs mid-push
        yield from msgs[len(msgs) // 2:]

    def push():
        with RolloutClient(svc.target) as c:
            try:
                c.stub.PushWeights(stalled(), timeout=180)
            except grpc.RpcError as e:
                push_errors.append(e)

    def stream():
        with RolloutClient(svc.target) as c:
            try:
                list(c.generate([[1, 2, 3]] * 2, n=2, max_tokens=450, ignore_eos=True))
            except grpc.RpcError as e:
                stream_errors.append(e)

    children = psutil.Process(svc.proc.pid).children(recursive=True)
    assert children, "vLLM's engine core should run in a child process"
    staging = [base / f"rollout-service-{svc.proc.pid}" for base in (Path("/dev/shm"), Path(tempfile.gettempdir()))]
    assert any(p.is_dir() for p in staging), "the server keeps weight pushes in a staging folder"
    threads = [threading.Thread(target=push, daemon=True), threading.Thread(target=stream, daemon=True)]
    for t in threads:
        t.start()
    assert stall.wait(60)
    with RolloutClient(svc.target) as c:
        wait_for(lambda: c.status().queue_depth >= 4, 20, "the stream's 4 samples to be under way")
    time.sleep(0.5)
    svc.proc.send_signal(signal.SIGTERM)
    assert svc.proc.wait(60) == 0
    for t in threads:
        t.join(30)
    assert push_errors and push_errors[0].code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), \
        push_errors
    assert len(stream_errors) == 1 and stream_errors[0].code() == grpc.StatusCode.UNAVAILABLE, stream_errors
    assert "shutting down" in stream_errors[0].details()
    wait_for(lambda: not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], 30,
             "engine processes to exit")
    assert not any(p.exists() for p in staging), "the staging folder (RAM on /dev/shm) outlived the server"


def test_a_restarted_service_comes_back_at_the_committed_version(own, tiny_model, state_dir, tmp_path):
    """After the service above ended (its last commit: version 1, from the first test), a new service on the same
    state_dir serves version 1's weights before it says ready, labelled 1; SIGKILLed, its engines follow it."""
    v1 = perturbed_copy(tiny_model, tmp_path / "v1", scale=0.05, seed=3)      # the first test's version 1
    reference = AutoModelForCausalLM.from_pretrained(v1, dtype=torch.float32).eval()
    with running_service(tiny_model, tmp_path / "again.log", "--state-dir", str(state_dir), clean_exit=False) as svc:
        with RolloutClient(svc.target) as c:
            st = c.status()
            assert st.ready and st.policy_version == 1 and st.engines[0].policy_version == 1
            assert st.durability.state_dir == str(state_dir) and st.durability.restored_policy_version == 1
            for s in c.generate_all(PROMPT, n=2, max_tokens=12, seed=7, temperature=1.0)[0]:
                assert s.policy_version == 1
                ref = processed_logprobs(reference, PROMPT[0], s.token_ids.tolist(), 1.0, 0, 1.0)
                np.testing.assert_allclose(s.logprobs, ref.numpy(), atol=2e-3, rtol=0)
        children = psutil.Process(svc.proc.pid).children(recursive=True)
        svc.proc.send_signal(signal.SIGKILL)
        svc.proc.wait(30)
        wait_for(lambda: not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], 30,
                 "engine processes to follow the killed front end")
