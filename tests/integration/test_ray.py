"""The engine pool on a real local Ray cluster (started here, bounded in time): two engine actors on the
tiny model; generation spread over both, a weight push committed on both, an actor killed mid-stream
and the pool recovering with no accepted request lost (the cut request is retried under its id), and
scaling out and in while serving."""
import os
import signal
import threading

import grpc
import psutil
import pytest
from safetensors.torch import load_file

from rollout_client import RolloutClient
from tests.ray_cluster import LocalRayCluster
from tests.tiny_models import perturbed_copy
from tests.integration.services import running_service, wait_for

PROMPTS = [[1, 504, 3458, 314, 260], [1, 1046, 2683, 77, 8, 9], [1, 30, 31, 32], [1, 77, 78]]


@pytest.fixture(scope="module")
def ray_cluster():
    with LocalRayCluster(num_cpus=4) as cluster:
        yield cluster.address


@pytest.fixture(scope="module")
def ray_service(tiny_model, ray_cluster, tmp_path_factory):
    log = tmp_path_factory.mktemp("ray") / "service.log"
    with running_service(tiny_model, log, "--ray-address", ray_cluster, "--engines", "2", "--ray-cpus-per-engine", "1",
                         startup_timeout=600) as svc:
        yield svc, log


def actor_processes() -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        if "ray::EngineActor" in " ".join(p.info["cmdline"] or []):
            out.append(p)
    return out


def test_generation_is_spread_over_both_ray_engines(ray_service):
    svc, _ = ray_service
    with RolloutClient(svc.target) as c:
        st = c.status()
        assert [e.id for e in st.engines] == ["engine-0", "engine-1"]
        assert all("pid" in e.location for e in st.engines)          # where each actor runs
        groups = c.generate_all(PROMPTS * 2, n=2, max_tokens=8)
        assert sum(len(g) for g in groups) == 16
        st = c.status()
        assert all(e.samples_finished > 0 for e in st.engines), [e.samples_finished for e in st.engines]
    assert len(actor_processes()) == 2


def test_weight_push_commits_on_both_ray_engines(ray_service, tiny_model, tmp_path):
    svc, _ = ray_service
    pushed = load_file(str(perturbed_copy(tiny_model, tmp_path / "v1", scale=0.05, seed=5) / "model.safetensors"))
    with RolloutClient(svc.target) as c:
        v = c.status().policy_version + 1
        assert c.push_weights(pushed, v).version == v
        st = c.status()
        assert [e.policy_version for e in st.engines] == [v, v]
        groups = c.generate_all(PROMPTS * 2, n=2, max_tokens=4, seed=3)
        assert {s.policy_version for g in groups for s in g} == {v}


def test_killed_actor_is_replaced_and_no_accepted_request_is_lost(ray_service):
    svc, log = ray_service
    with RolloutClient(svc.target) as c:
        version = c.status().policy_version
        victim = actor_processes()[0]
        outcome = {}

        def long_request():
            try:
                outcome["groups"] = c.generate_all(PROMPTS * 2, n=2, max_tokens=300, ignore_eos=True,
                                                   request_id="ray-kill")
            except grpc.RpcError as e:
                outcome["error"] = e

        t = threading.Thread(target=long_request)
        t.start()
        wait_for(lambda: all(e.running_sequences > 0 for e in c.status().engines), 60, "work on both engines")
        os.kill(victim.pid, signal.SIGKILL)
        t.join(120)
        err = outcome.get("error")
        assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE and "retry" in err.details(), outcome
        def replaced():
            s = c.status()
            return s if sum(e.restarts for e in s.engines) == 1 and s.ready else None

        st = wait_for(replaced, 300, "the dead engine to be replaced")
        assert [e.policy_version for e in st.engines] == [version, version]
        retry = c.generate_all(PROMPTS * 2, n=2, max_tokens=300, ignore_eos=True, request_id="ray-kill")
        assert sorted((s.prompt_index, s.sample_index) for g in retry for s in g) == \
            sorted((p, s) for p in range(8) for s in range(2))
    assert victim.pid not in {p.pid for p in actor_processes()} and len(actor_processes()) == 2
    assert "is dead" in log.read_text()


def test_scale_out_and_in_while_serving(ray_service):
    svc, _ = ray_service
    with RolloutClient(svc.target) as c:
        version = c.status().policy_version
        st = c.scale_engines(3)
        assert len(st.engines) == 3 and st.engines[2].policy_version == version and st.ready
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("g", c.generate_all(PROMPTS * 3, n=2, max_tokens=64)))
        t.start()
        wait_for(lambda: c.status().engines[2].running_sequences > 0, 60, "work on the new engine")
        st = c.scale_engines(2)                       # drains engine-2: its sequences finish first
        t.join(120)
        assert sum(len(g) for g in out["g"]) == 24
        assert [e.id for e in st.engines] == ["engine-0", "engine-1"]
    wait_for(lambda: len(actor_processes()) == 2, 60, "the removed actor to exit")
