"""LoRA adapters as policies on a real engine (one service with LoRA on, shared by this module): PEFT adapters built
with peft on the tiny model, pushed and loaded under names with their own version lines; every sample's tokens and
log-probs checked against an independent forward pass of the base model with that adapter version merged (peft's
merge_and_unload), adapters and the base mixed in one engine batch; versions kept and evicted; partial samples
continuing on their adapter; the vLLM and SGLang dialects' adapter endpoints; a base push under loaded adapters; an
adapter over the weight-transfer group (TransferWeights); adapters served again by a service restarted on its
state_dir."""
import dataclasses
import json
import threading

import grpc
import numpy as np
import pytest
import torch

from rollout_client import RolloutClient
from rollout_service.drafting.reference import processed_logprobs
from tests.integration.adapters import PROMPTS, RANK, TARGETS, check, make_adapter, merged
from tests.integration.services import running_service

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def lora_service(tiny_model, tmp_path_factory):
    """With a state_dir: the module's last test restarts it there."""
    with running_service(tiny_model, tmp_path_factory.mktemp("lora-logs") / "service.log",
                         "--max-adapters", "4", "--max-lora-rank", str(RANK), "--adapter-versions-kept", "2",
                         "--weights-root", str(tmp_path_factory.getbasetemp()),
                         "--state-dir", str(tmp_path_factory.mktemp("lora-state"))) as svc:
        yield svc


@pytest.fixture(scope="module")
def lc(lora_service):
    with RolloutClient(lora_service.target) as c:
        yield c


@pytest.fixture(scope="module")
def adapters(tiny_model, lc, tmp_path_factory):
    """alice pushed over gRPC (PushWeights, only the adapter's tensors), bob loaded from a PEFT directory."""
    alice, bob = make_adapter(tiny_model, 1), make_adapter(tiny_model, 2, targets=["q_proj", "v_proj", "down_proj"])
    bob_dir = tmp_path_factory.mktemp("bob-v1")
    bob.save_pretrained(bob_dir)
    r = lc.push_adapter("alice", alice, 1)
    assert (r.target, r.version) == ("adapter", 1) and r.num_tensors == 2 * len(TARGETS) * 2
    r = lc.load_adapter("bob", str(bob_dir), 1)
    assert (r.target, r.version, r.num_tensors) == ("adapter", 1, 2 * 3 * 2)
    return {"alice": alice, "bob": bob}


def test_adapter_samples_equal_a_merged_forward_pass_mixed_with_the_base(lc, adapters, hf_model):
    out, errors = {}, []

    def run(policy):
        try:
            out[policy] = lc.generate_all(PROMPTS, n=3, max_tokens=12, ignore_eos=True, temperature=1.0, seed=7,
                                          policy=policy)
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=run, args=(p,)) for p in ("alice", "bob", "")]   # one engine batch
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for name in ("alice", "bob"):
        assert all(s.policy == name and s.version_spans == [(1, 0)] for g in out[name] for s in g)
        check(out[name], merged(adapters[name], hf_model))
    assert all(s.policy == "" for g in out[""] for s in g)
    check(out[""], hf_model)
    # the adapters change what is sampled: same seeds, other tokens than the base's
    assert any(a.token_ids.tolist() != b.token_ids.tolist() for ga, gb in zip(out["alice"], out[""])
               for a, b in zip(ga, gb))
    st = {a.name: a for a in lc.status().adapters}
    assert set(st) == {"alice", "bob"} and st["alice"].rank == RANK and list(st["alice"].loaded_versions) == [1]
    assert st["alice"].samples_total >= 6 and sorted(st["bob"].target_modules) == ["down_proj", "q_proj", "v_proj"]
    assert lc.status().adapter_limits.max_rank == RANK


def test_an_adapter_policy_across_the_turns_of_a_chat_episode(lc, adapters, hf_model):
    """An agent episode on adapter alice: each turn runs on the adapter and its log-probs are the merged model's over
    the episode's exact tokens."""
    from rollout_client import Episode

    e = Episode([{"role": "user", "content": "Hello."}])
    for text in ("And?", None):
        lc.chat_step([e], max_tokens=8, temperature=1.0, ignore_eos=True, policy="alice")
        if text:
            e.add_message({"role": "user", "content": text})
            e.done = False
    assert [s.policy for s in e.turns] == ["alice", "alice"]
    check([[s] for s in e.turns], merged(adapters["alice"], hf_model),
          prompts=[s.prompt_token_ids.tolist() for s in e.turns])


def test_versions_kept_evicted_and_refusals(lc, adapters, tiny_model, hf_model):
    v2, v3 = make_adapter(tiny_model, 12), make_adapter(tiny_model, 13)
    lc.push_adapter("alice", v2, 2)
    latest = lc.generate_all(PROMPTS, n=2, max_tokens=8, ignore_eos=True, temperature=1.0, seed=3, policy="alice")
    assert all(s.version_spans == [(2, 0)] for g in latest for s in g)
    check(latest, merged(v2, hf_model))
    old = lc.generate_all(PROMPTS, n=2, max_tokens=8, ignore_eos=True, temperature=1.0, seed=3, policy="alice",
                          policy_version=1)
    assert all(s.version_spans == [(1, 0)] for g in old for s in g)
    check(old, merged(adapters["alice"], hf_model))
    lc.push_adapter("alice", v3, 3)
    with pytest.raises(grpc.RpcError) as e:                      # version 1 evicted (2 kept)
        lc.generate_all(PROMPTS, max_tokens=4, policy="alice", policy_version=1)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "evicted" in e.value.details()
    assert [list(a.loaded_versions) for a in lc.status().adapters if a.name == "alice"] == [[2, 3]]
    with pytest.raises(grpc.RpcError) as e:
        lc.generate_all(PROMPTS, max_tokens=4, policy="carol")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "policy" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:                      # rank above the server's max: nothing changes
        lc.push_adapter("alice", make_adapter(tiny_model, 14, r=16), 4)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_rank" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        lc.push_adapter("alice", v3, 3)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    again = lc.generate_all(PROMPTS, n=2, max_tokens=8, ignore_eos=True, temperature=1.0, seed=3, policy="alice")
    assert all(s.version_spans == [(3, 0)] for g in again for s in g)
    check(again, merged(v3, hf_model))


def test_partial_sample_continues_on_its_adapter(lc, adapters):
    whole = lc.generate_all(PROMPTS[:1], max_tokens=12, ignore_eos=True, temperature=0, policy="bob")[0][0]
    cut = dataclasses.replace(whole, token_ids=whole.token_ids[:5], logprobs=whole.logprobs[:5])
    cont = lc.generate_all(PROMPTS[:1], partials=[cut], max_tokens=12, ignore_eos=True, temperature=0,
                           policy="bob")[0][0]
    assert cont.token_ids.tolist() == whole.token_ids.tolist() and cont.policy == "bob"
    np.testing.assert_allclose(cont.logprobs, whole.logprobs, atol=1e-4)
    with pytest.raises(grpc.RpcError) as e:                      # on another policy: refused
        lc.generate_all(PROMPTS[:1], partials=[cut], max_tokens=12, policy="alice")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "partial.policy" in e.value.details()


def test_dialects_load_sample_list_and_unload_adapters(lora_service, lc, tiny_model, tmp_path_factory, hf_model):
    import httpx

    carol = make_adapter(tiny_model, 21)
    d = tmp_path_factory.mktemp("carol")
    carol.save_pretrained(d)
    with httpx.Client(base_url=lora_service.http, timeout=120) as http:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "carol", "lora_path": str(d)})
        assert r.status_code == 200 and "carol" in r.text and r.headers["x-rollout-adapter-version"] == "1"
        ids = [m["id"] for m in http.get("/v1/models").json()["data"]]
        assert "carol" in ids and "alice" in ids
        body = {"model": "carol", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "logprobs": 0,
                "ignore_eos": True, "return_token_ids": True}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert r.json()["model"] == "carol"
        grpc_greedy = lc.generate_all(PROMPTS[:1], max_tokens=8, ignore_eos=True, temperature=0, policy="carol")
        assert choice["token_ids"] == grpc_greedy[0][0].token_ids.tolist()
        ref = processed_logprobs(merged(carol, hf_model), PROMPTS[0], choice["token_ids"], 0.0, 0, 1.0)
        np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], ref.numpy(), atol=1e-3)
        r = http.post("/generate", json={"input_ids": PROMPTS[0], "lora_path": "carol", "return_logprob": True,
                                         "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                             "ignore_eos": True}})
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == choice["token_ids"]
        r = http.post("/v1/completions", json=body | {"model": "nobody"})
        assert r.status_code == 404 and "nobody" in r.text
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "carol"})
        assert r.status_code == 200
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 404
        assert "carol" not in [m["id"] for m in http.get("/v1/models").json()["data"]]


def test_a_base_push_under_loaded_adapters(lc, adapters, tiny_model, hf_model):
    """New base weights: adapter samples are the new base with the adapter merged."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in base.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05 * p.std())
    v = lc.status().policy_version + 1
    lc.push_weights(base, v)
    try:
        out = lc.generate_all(PROMPTS, n=2, max_tokens=8, ignore_eos=True, temperature=1.0, seed=4, policy="bob")
        check(out, merged(adapters["bob"], base))
        check(lc.generate_all(PROMPTS, n=2, max_tokens=8, ignore_eos=True, temperature=1.0, seed=4), base)
    finally:
        lc.push_weights(hf_model, v + 1)


def test_an_adapter_transferred_over_the_weight_transfer_group(lc, tiny_model, hf_model):
    """TransferWeights with TARGET_ADAPTER: the trainer broadcasts only the adapter's tensors over the gloo group and
    they are committed as a version of the name on every engine; its samples carry the log-probs of the base with
    that version merged. A refused transfer (a version not newer) moves nothing and leaves the group usable."""
    from rollout_client.transfer import WeightSync

    dave = [make_adapter(tiny_model, s, targets=["q_proj", "o_proj", "up_proj"]) for s in (41, 42)]
    sync = WeightSync(lc, timeout_s=20)
    sync.connect(timeout=60)
    try:
        r = sync.push_adapter("dave", dave[0], 1)
        assert (r.target, r.version, r.num_tensors) == ("adapter", 1, 2 * 3 * 2)
        with pytest.raises(grpc.RpcError) as e:
            sync.push_adapter("dave", dave[1], 1)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not newer" in e.value.details()
        assert sync.push_adapter("dave", dave[1], 2).version == 2
    finally:
        sync.close()
    for version in (1, 2):
        out = lc.generate_all(PROMPTS, n=2, max_tokens=8, ignore_eos=True, temperature=1.0, seed=9, policy="dave",
                              policy_version=version)
        assert all(s.policy == "dave" and s.version_spans == [(version, 0)] for g in out for s in g)
        check(out, merged(dave[version - 1], hf_model))
    lc.unload_adapter("dave")                                  # room for the trainers' two adapters


def test_two_lora_trainers_share_the_service(lora_service, lc, tiny_model, tmp_path):
    """The bundled trainer with --lora, twice at once against this service: each trains its own adapter on its own
    reward (arithmetic, sync; brevity, async), pushes only the adapter each step, and samples exactly the adapter it
    holds (importance weights 1 on samples without lag); the base policy is untouched."""
    import subprocess
    import sys
    from pathlib import Path

    base_version = lc.status().policy_version
    procs = {}
    for name, reward, mode in (("arith", "arithmetic", "sync"), ("brief", "brevity", "async")):
        out = tmp_path / name
        out.mkdir()
        cmd = [sys.executable, "-m", "trainer_example.train", "--target", lora_service.target, "--model",
               str(tiny_model), "--lora", "8", "--policy-name", name, "--reward", reward, "--mode", mode,
               "--steps", "2", "--prompts", "2", "--group-size", "3", "--max-tokens", "16", "--eval-size", "2",
               "--eval-every", "100", "--micro-batch", "3", "--kl-samples", "2", "--no-save-final", "--lr", "1e-3",
               "--out", str(out)]
        log = open(out / "trainer.log", "w")
        procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                        cwd=Path(__file__).resolve().parents[2]), out, log)
    for name, (proc, out, log) in procs.items():
        code = proc.wait(timeout=600)
        log.close()
        assert code == 0, (out / "trainer.log").read_text()[-4000:]
    st = {a.name: a for a in lc.status().adapters}
    for name, (_, out, _) in procs.items():
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [0, 1] and [r["policy_version"] for r in rows] == [1, 2]
        for r in rows:
            if r["max_lag_used"] == 0 and "is_weight_mean" in r:
                assert abs(r["is_weight_mean"] - 1) < 0.02 and r["is_truncated_fraction"] == 0, r
        assert st[name].version == 3 and st[name].samples_total >= 12     # initial push + one per step
    assert lc.status().policy_version == base_version


def test_adapters_are_served_again_after_a_restart_on_the_state_dir(lora_service, adapters):
    """Last in this module: it restarts the module's service (a new process on the same --state-dir). Every adapter
    comes back at the versions it served (an unloaded one stays unloaded), and a seeded request, over gRPC and
    with the vLLM dialect's model = the adapter, gets the tokens and log-probs it got before the restart."""
    import httpx

    body = {"model": "alice", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 1.0, "seed": 11, "logprobs": 0,
            "ignore_eos": True, "return_token_ids": True}

    def served():
        with RolloutClient(lora_service.target) as c:
            st = {a.name: (a.version, list(a.loaded_versions), a.rank, sorted(a.target_modules), a.tenant)
                  for a in c.status().adapters}
            kept = st["alice"][1]
            grpc_out = [c.generate_all(PROMPTS, n=2, max_tokens=8, ignore_eos=True, temperature=1.0, seed=11,
                                       policy="alice", policy_version=v) for v in kept]
            bob = c.generate_all(PROMPTS[:1], max_tokens=8, ignore_eos=True, temperature=0, policy="bob")
        with httpx.Client(base_url=lora_service.http, timeout=120) as http:
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
        return st, grpc_out + [bob], r.json()["choices"][0]

    before = served()
    assert lora_service.stop() == 0
    lora_service.start()
    after = served()
    assert after[0] == before[0] and "carol" not in after[0]       # carol was unloaded (the dialects' test)
    for g_before, g_after in zip(before[1], after[1]):
        for a, b in zip((s for g in g_before for s in g), (s for g in g_after for s in g)):
            assert b.token_ids.tolist() == a.token_ids.tolist() and b.version_spans == a.version_spans
            np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5, rtol=0)
    assert after[2]["token_ids"] == before[2]["token_ids"]
    np.testing.assert_allclose(after[2]["logprobs"]["token_logprobs"], before[2]["logprobs"]["token_logprobs"],
                               atol=1e-5, rtol=0)
    assert "restored from" in lora_service.log_path.read_text()
