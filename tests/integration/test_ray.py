"""The engine pool on a real local Ray cluster (started here, bounded in time): two engine actors on the
tiny model; generation spread over both, a LoRA adapter served by both, a weight push committed on both, an actor
killed mid-stream and the pool recovering with no accepted request lost (the cut request is retried under its id)
and its replacement loading the adapter, and scaling out and in while serving."""
import os
import signal
import threading

import grpc
import psutil
import pytest
from safetensors.torch import load_file

from rollout_client import RolloutClient
from tests.ray_cluster import LocalRayCluster
from tests.integration.adapters import RANK, check, make_adapter, merged
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
                         "--max-adapters", "2", "--max-lora-rank", str(RANK), startup_timeout=600) as svc:
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


def test_turns_of_a_session_stay_on_one_engine_and_find_their_history_cached(ray_service):
    """Session routing (GenerateRequest.session_id) on two engines: two conversations start together (one per
    engine), then take turns one at a time; least-loaded routing would send every lone turn to the first engine (a
    tie), session routing sends each to its conversation's engine (GetStatus' per-engine counts), where the history
    is in the prefix cache (Sample.num_cached_tokens: vLLM's prefix caching, in the Ray actors too)."""
    svc, _ = ray_service
    histories = {"conv-a": [1] + list(range(200, 400)), "conv-b": [1] + list(range(600, 800))}   # 201 tokens

    def next_turn(key: str, s) -> None:
        histories[key] = histories[key] + s.token_ids.tolist() + [13, 14, 15, 16]     # + the next user turn

    with RolloutClient(svc.target) as c:
        before = c.status()
        # conv-a's first turn is running when conv-b's is admitted: one engine each
        first = {}
        t = threading.Thread(target=lambda: first.setdefault("a", c.generate_all(
            [histories["conv-a"]], max_tokens=250, temperature=0, ignore_eos=True, session_id="conv-a")[0][0]))
        t.start()
        wait_for(lambda: c.status().queue_depth == 1, 60, "conv-a's first turn to run")
        next_turn("conv-b", c.generate_all([histories["conv-b"]], max_tokens=8, temperature=0,
                                           session_id="conv-b")[0][0])
        t.join(120)
        next_turn("conv-a", first["a"])
        mid = c.status()
        took = [e.samples_finished - p.samples_finished for e, p in zip(mid.engines, before.engines)]
        assert took == [1, 1] and [e.sessions for e in mid.engines] == [1, 1], took
        for _ in range(3):
            for key in ("conv-a", "conv-b"):
                prompt_len = len(histories[key])
                s = c.generate_all([histories[key]], max_tokens=8, temperature=0, session_id=key)[0][0]
                assert s.num_cached_tokens >= prompt_len // 2, (key, s.num_cached_tokens, prompt_len)
                next_turn(key, s)
        after = c.status()
        took = [e.samples_finished - p.samples_finished for e, p in zip(after.engines, mid.engines)]
        assert took == [3, 3], took                           # least-loaded would have sent all 6 to engine-0
        assert after.sessions.hits - before.sessions.hits == 6
        assert after.sessions.started - before.sessions.started == 2
        with pytest.raises(grpc.RpcError) as e:
            c.generate_all([[1, 2]], max_tokens=2, session_id="x" * 257)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "session_id" in e.value.details()


@pytest.fixture(scope="module")
def alice(ray_service, tiny_model):
    """A LoRA adapter pushed once as version 1 of policy "alice"; each actor loads it from the object store into a
    folder of its own."""
    alice = make_adapter(tiny_model, 31, targets=["q_proj", "v_proj", "down_proj"])
    with RolloutClient(ray_service[0].target) as c:
        assert c.push_adapter("alice", alice, 1).version == 1
    return alice


def test_an_adapter_is_served_by_both_ray_engines(ray_service, alice, hf_model):
    """Samples of the adapter on both engines carry the log-probs of the base with the adapter merged (an
    independent forward pass)."""
    svc, _ = ray_service
    with RolloutClient(svc.target) as c:
        before = [e.samples_finished for e in c.status().engines]
        groups = c.generate_all(PROMPTS, n=2, max_tokens=8, ignore_eos=True, temperature=1.0, seed=5, policy="alice")
        assert all(s.policy == "alice" and s.version_spans == [(1, 0)] for g in groups for s in g)
        check(groups, merged(alice, hf_model), prompts=PROMPTS)
        assert all(e.samples_finished > b for e, b in zip(c.status().engines, before))      # both engines


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


def test_killed_actor_is_replaced_and_no_accepted_request_is_lost(ray_service, alice):
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
        # the new actor loaded the adapter before serving (an actor without it refuses its requests)
        before = [e.samples_finished for e in c.status().engines]
        groups = c.generate_all(PROMPTS * 2, max_tokens=4, policy="alice")
        assert all(s.version_spans == [(1, 0)] for g in groups for s in g)
        assert all(e.samples_finished > b for e, b in zip(c.status().engines, before))
    assert victim.pid not in {p.pid for p in actor_processes()} and len(actor_processes()) == 2
    assert "is dead" in log.read_text()


def test_scale_out_and_in_while_serving(ray_service):
    """In to one engine, out to two (the new actor joins at the committed version and takes work), and in again while
    that work runs (the new engine drains: its sequences finish first). Two actors at most: a third, beside the other
    pytest-xdist worker's services, once ran the machine out of memory."""
    svc, _ = ray_service
    with RolloutClient(svc.target) as c:
        version = c.status().policy_version
        assert [e.id for e in c.scale_engines(1).engines] == ["engine-0"]
        wait_for(lambda: len(actor_processes()) == 1, 60, "the removed actor to exit")
        st = c.scale_engines(2)
        assert [e.id for e in st.engines] == ["engine-0", "engine-2"] and st.ready
        assert st.engines[1].policy_version == version
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("g", c.generate_all(PROMPTS * 3, n=2, max_tokens=64)))
        t.start()
        wait_for(lambda: c.status().engines[1].running_sequences > 0, 60, "work on the new engine")
        st = c.scale_engines(1)                       # drains engine-2: its sequences finish first
        t.join(120)
        assert sum(len(g) for g in out["g"]) == 24
        assert [e.id for e in st.engines] == ["engine-0"]
    wait_for(lambda: len(actor_processes()) == 1, 60, "the removed actor to exit")
