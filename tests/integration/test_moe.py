"""A mixture-of-experts policy through the service, and routing replay proven: every route a sample returns equals an
independent transformers forward pass over the whole sequence under the weights that routed it (routes of cached
prompt tokens, streamed deltas, a push in keep mode mid-sample, a partial sample continued under new weights,
speculation with rejected drafts); expert tensors pushed, loaded and transferred under the all-or-none commit; the
dialects' spellings. Two services of their own: the tiny MoE plain, and with a dense draft model at fixed k."""
import base64
import io
import shutil
import threading
import time

import grpc
import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from rollout_client import RolloutClient
from rollout_client.transfer import WeightSync
from rollout_service.drafting.reference import processed_logprobs, routed_experts
from tests.integration.services import running_service, wait_for
from tests.tiny_models import build_tiny_moe_model, perturbed_copy

LAYERS, TOP_K, EXPERTS = 2, 2, 8
LONG = [1] + [(37 * i) % 4000 + 100 for i in range(150)]     # longer than a KV block: its prefix is cached
PROMPTS = [[1, 504, 3458, 314, 260, 77, 8, 9], [1, 1046, 2683, 77, 8, 9, 11]]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return build_tiny_moe_model(tmp_path_factory.mktemp("models") / "tiny-moe", layers=LAYERS, experts=EXPERTS,
                                top_k=TOP_K)


@pytest.fixture(scope="module")
def moe_service(moe, tmp_path_factory):
    with running_service(moe, tmp_path_factory.mktemp("moe") / "service.log",
                         "--weights-root", str(tmp_path_factory.getbasetemp())) as svc:
        yield svc


@pytest.fixture(scope="module")
def mc(moe_service):
    with RolloutClient(moe_service.target) as c:
        yield c


class Versions:
    """The weights each policy version served, as checkpoint directories the reference loads."""

    def __init__(self, base, tmp):
        self.dirs = {0: base}
        self.tmp = tmp
        self.models = {}

    def add(self, version: int, updates: dict) -> None:
        prev = self.dirs[max(self.dirs)]
        out = self.tmp / f"v{version}"
        shutil.copytree(prev, out)
        state = load_file(str(out / "model.safetensors"))
        state.update(updates)
        save_file(state, str(out / "model.safetensors"))
        self.dirs[version] = out

    def model(self, version: int):
        if version not in self.models:
            self.models[version] = AutoModelForCausalLM.from_pretrained(self.dirs[version],
                                                                        dtype=torch.float32).eval()
        return self.models[version]


@pytest.fixture(scope="module")
def versions(moe, tmp_path_factory):
    return Versions(moe, tmp_path_factory.mktemp("versions"))


def expert_update(moe, seed: int, experts=(0, 1, 2, 3)) -> dict:
    """New values for some experts of every layer and for the routers (so that the new version routes differently)."""
    state = load_file(str(moe / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        expert = ".mlp.experts." in name and int(name.split(".mlp.experts.")[1].split(".")[0]) in experts
        if expert or name.endswith(".mlp.gate.weight"):
            out[name] = t + torch.randn(t.shape, generator=g) * t.std() * (2.0 if "gate.weight" in name else 0.5)
    return out


def rows_of(sample) -> np.ndarray:
    r = sample.routed_experts
    assert r is not None, "the sample carries no routes"
    assert r.ids.dtype == np.uint8 and r.ids.shape[1:] == (LAYERS, TOP_K)
    return r.ids.astype(np.int64)


def assert_routes_replay(sample, prompt, versions: Versions):
    """Every row equals the reference forward pass over the whole sequence under the version that routed it, and
    every token's log-prob the reference's under the version that generated it."""
    seq = list(prompt) + sample.token_ids.tolist()
    got = rows_of(sample)
    assert got.shape[0] == len(seq) - 1 == sample.num_prompt_tokens + len(sample.token_ids) - 1
    spans = sample.routed_experts.version_spans + [(None, len(got))]
    assert spans[0][1] == 0
    for (v, start), (_, end) in zip(spans, spans[1:]):
        want = routed_experts(versions.model(v), seq)[start:end]
        bad = np.nonzero((got[start:end] != want).any(-1).any(-1))[0] + start
        assert not len(bad), (f"rows {start}-{end} (version {v}) differ from the forward pass at {len(bad)} rows: "
                              f"{bad[:10].tolist()}; versions {sample.version_spans}; "
                              f"lp diff {_lp_diffs(sample, prompt, versions)}")
    tspans = sample.version_spans + [(None, len(sample.token_ids))]
    for (v, start), (_, end) in zip(tspans, tspans[1:]):
        ref = processed_logprobs(versions.model(v), prompt, sample.token_ids.tolist(), 1.0, 0, 1.0)[start:end]
        np.testing.assert_allclose(sample.logprobs[start:end], ref.numpy(), atol=1e-3, rtol=0)


def _lp_diffs(sample, prompt, versions):
    out = []
    for v in sorted(versions.dirs):
        ref = processed_logprobs(versions.model(v), prompt, sample.token_ids.tolist(), 1.0, 0, 1.0).numpy()
        d = np.abs(ref - sample.logprobs)
        out.append((v, float(d[:5].max()), float(d[-5:].max())))
    return out


def test_routes_equal_a_forward_pass_and_cached_prompts_keep_theirs(mc, versions):
    st = mc.status()
    assert (st.moe.num_experts, st.moe.top_k, st.moe.num_layers) == (EXPERTS, TOP_K, LAYERS)
    assert st.moe.capture == "vllm_v1_patch"
    groups = mc.generate_all(PROMPTS + [LONG], n=2, max_tokens=24, seed=3, return_routed_experts=True)
    for prompt, group in zip(PROMPTS + [LONG], groups):
        for s in group:
            assert_routes_replay(s, prompt, versions)
    again = mc.generate_all([LONG], n=1, max_tokens=8, seed=4, return_routed_experts=True, session_id="s1")[0][0]
    assert again.num_cached_tokens > 0, "the long prompt's prefix should come from the prefix cache"
    assert_routes_replay(again, LONG, versions)                 # its cached rows are the ones stored at the time


def test_routes_across_the_turns_of_a_chat_episode(mc, versions):
    """An agent episode (chat prompts with the exact tokens so far): every turn's sample carries the routes of its
    whole prompt (the earlier turns included, as computed when they were cached) and its tokens, equal to a forward
    pass over the episode so far."""
    from rollout_client import Episode

    e = Episode([{"role": "user", "content": "Route me."}])
    for text in ("Again.", None):
        mc.chat_step([e], max_tokens=8, temperature=1.0, ignore_eos=True, return_routed_experts=True)
        if text:
            e.add_message({"role": "user", "content": text})
            e.done = False
    assert len(e.turns) == 2
    for s in e.turns:
        assert_routes_replay(s, s.prompt_token_ids.tolist(), versions)
    assert e.turns[1].prompt_token_ids.tolist()[:len(e.turns[0].prompt_token_ids) + len(e.turns[0].token_ids)] == \
        e.turns[0].prompt_token_ids.tolist() + e.turns[0].token_ids.tolist()


def test_without_the_flag_no_routes_and_a_dense_policy_refuses_it(mc, client):
    assert mc.generate_all(PROMPTS[:1], max_tokens=4)[0][0].routed_experts is None
    with pytest.raises(grpc.RpcError) as e:
        client.generate_all(PROMPTS[:1], max_tokens=4, return_routed_experts=True)    # the shared dense service
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "return_routed_experts" in e.value.details()
    assert not client.status().HasField("moe")


def test_streamed_deltas_carry_every_row_once(mc, versions):
    deltas, whole = [], None
    for s in mc.generate([LONG[:40]], max_tokens=30, seed=5, stream_tokens=True, return_routed_experts=True):
        if s.delta:
            if s.routed_experts is not None:
                deltas.append(s.routed_experts)
        else:
            whole = s
    assert deltas, "no delta carried routes"
    joined = np.concatenate([d.ids for d in deltas])
    assert [d.first_row for d in deltas] == list(np.cumsum([0] + [len(d.ids) for d in deltas[:-1]]))
    assert (joined == whole.routed_experts.ids[:len(joined)]).all()
    assert_routes_replay(whole, LONG[:40], versions)


def _in_background(client, prompts, max_tokens, out, **kw):
    def run():
        try:
            out["samples"] = list(client.generate(prompts, n=1, max_tokens=max_tokens, ignore_eos=True, seed=9,
                                                  return_routed_experts=True, **kw))
        except grpc.RpcError as e:
            out["error"] = e
    t = threading.Thread(target=run)
    t.start()
    wait_for(lambda: client.status().queue_depth >= len(prompts), 20, "the samples to be admitted")
    time.sleep(0.5)                                                # some tokens in
    return t


def test_a_push_of_some_experts_mid_sample_labels_each_row_with_the_version_that_routed_it(mc, moe, versions):
    v = mc.status().policy_version + 1
    update = expert_update(moe, seed=1)
    versions.add(v, update)
    out = {}
    t = _in_background(mc, PROMPTS, 300, out)
    res = mc.push_weights(update, v, mode="keep", partial=True)     # experts 0-3 and the routers of every layer
    assert res.partial and res.num_tensors == len(update)
    t.join(120)
    assert "error" not in out, out
    for s in out["samples"]:
        assert [x for x, _ in s.version_spans] == [v - 1, v], s.version_spans
        assert [x for x, _ in s.routed_experts.version_spans] == [v - 1, v]
        assert_routes_replay(s, PROMPTS[s.prompt_index], versions)
        seq = PROMPTS[s.prompt_index] + s.token_ids.tolist()
        first_new = s.routed_experts.version_spans[1][1]
        old_routes = routed_experts(versions.model(v - 1), seq)[first_new:len(seq) - 1]
        assert (rows_of(s)[first_new:] != old_routes).any(), "the new routers route like the old: a weak test"


def test_a_partial_sample_continued_under_new_weights_keeps_its_rows(mc, moe, versions):
    old = mc.status().policy_version
    v = old + 1
    update = expert_update(moe, seed=2, experts=(4, 5, 6, 7))
    versions.add(v, update)
    out = {}
    t = _in_background(mc, PROMPTS, 300, out, return_partial=True)
    mc.push_weights(update, v, mode="abort", partial=True)
    t.join(120)
    parts = [s for s in out["samples"] if len(s.token_ids)]
    assert parts and all(s.finish_reason == "abort" for s in out["samples"])
    prompts = [PROMPTS[s.prompt_index] for s in parts]
    for s, p in zip(parts, prompts):
        assert_routes_replay(s, p, versions)
    done = [g[0] for g in mc.generate_all(prompts, partials=parts, max_tokens=300, ignore_eos=True, seed=10,
                                          return_routed_experts=True)]
    for part, s, prompt in zip(parts, done, prompts):
        n = len(part.token_ids)
        keep = len(prompt) + n - 1
        assert (rows_of(s)[:keep] == rows_of(part)).all(), "the partial's own rows were not kept"
        assert s.routed_experts.version_spans == [(old, 0), (v, keep)]
        assert_routes_replay(s, prompt, versions)


def test_expert_tensors_load_from_a_path_and_over_a_transfer_group(mc, moe, versions, tmp_path):
    v = mc.status().policy_version + 1
    update = expert_update(moe, seed=3, experts=(1, 6))
    versions.add(v, update)
    save_file(update, str(tmp_path / "experts.safetensors"))
    assert mc.load_weights(str(tmp_path / "experts.safetensors"), v, partial=True).version == v
    for s in mc.generate_all(PROMPTS, max_tokens=16, seed=11, return_routed_experts=True)[0]:
        assert_routes_replay(s, PROMPTS[0], versions)
    update = expert_update(moe, seed=4, experts=(2,))
    versions.add(v + 1, update)
    sync = WeightSync(mc, timeout_s=30)
    sync.connect(timeout=60)
    try:
        assert sync.push(update, v + 1, partial=True).version == v + 1
    finally:
        sync.close()
    for s in mc.generate_all(PROMPTS, max_tokens=16, seed=12, return_routed_experts=True)[1]:
        assert_routes_replay(s, PROMPTS[1], versions)


def test_the_dialects_spell_routes_as_vllm_and_sglang_do(moe_service, mc):
    with httpx.Client(base_url=moe_service.http, timeout=120) as http:
        body = http.post("/v1/completions", json={"model": "x", "prompt": PROMPTS[0], "max_tokens": 6, "seed": 13,
                                                  "temperature": 1.0}).json()
        grpc_sample = mc.generate_all([PROMPTS[0]], max_tokens=6, seed=13, return_routed_experts=True)[0][0]
        vllm_rows = np.load(io.BytesIO(base64.b64decode(body["choices"][0]["routed_experts"])))
        assert vllm_rows.dtype == np.uint8 and (vllm_rows == grpc_sample.routed_experts.ids).all()
        body = http.post("/generate", json={"input_ids": PROMPTS[0], "return_routed_experts": True,
                                            "sampling_params": {"max_new_tokens": 6, "seed": 13}}).json()
        raw = np.frombuffer(base64.b64decode(body["meta_info"]["routed_experts"]), dtype=np.int32)
        assert (raw.reshape(len(PROMPTS[0]) + len(body["output_ids"]) - 1, LAYERS, TOP_K) ==
                grpc_sample.routed_experts.ids).all()


def test_speculation_returns_the_rows_of_accepted_tokens_only(moe, versions, tmp_path):
    """A noisy copy of the policy drafts at fixed k = 2 (some drafts accepted, most rejected): the verify pass
    computes rows for every draft; only the accepted tokens' rows come back. (A dense draft model and an EAGLE-3 head
    over an MoE target: verify-lossless, docs/speculation.md.)"""
    drafter = perturbed_copy(moe, tmp_path / "drafter", scale=0.5, seed=1)
    with running_service(moe, tmp_path / "spec.log", "--speculation", "draft_model", "--draft-model", str(drafter),
                         "--k-control", "fixed", "--num-speculative-tokens", "2") as svc:
        with RolloutClient(svc.target) as c:
            groups = c.generate_all(PROMPTS, n=3, max_tokens=24, seed=14, return_routed_experts=True)
    samples = [(p, s) for p, g in zip(PROMPTS, groups) for s in g]
    assert sum(s.num_drafted for _, s in samples) > sum(s.num_accepted for _, s in samples) > 0
    for prompt, s in samples:
        assert_routes_replay(s, prompt, versions.__class__(versions.dirs[0], tmp_path))
