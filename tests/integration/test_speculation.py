"""Speculative decoding is lossless (proven per mechanism), the check has power, and drafter updates
move acceptance the way they must."""
import re

import grpc
import numpy as np
import pytest
import torch

from rollout_client import RolloutClient
from rollout_service.config import SpeculationConfig
from tests.tiny_models import perturbed_copy
from rollout_service.drafting.lossless import SampleSet, check_lossless, sample_plain_sets
from tests.integration.services import running_service

PROMPTS = [[1, 504, 3458, 314, 260], [1, 1046, 2683, 77, 8, 9]]
NGRAM_PROMPTS = [[1] + [501, 502, 503, 504, 505] * 6, [1] + [900, 901, 902] * 8]
ARGS = dict(samples=600, max_tokens=3, temperature=1.0, top_k=4)
PLAIN_ARGS = ARGS | {"top_k": 0}       # the checks on `repeats` prompts: no top-k (the draft-model checks cover it)


@pytest.fixture(scope="module")
def drafter(noisy_drafter):
    """A noisy copy of the target (conftest.py): accepts often, rejects often enough to exercise resampling."""
    return noisy_drafter


@pytest.fixture(scope="module")
def references(tiny_model):
    """The plain side of every check here, sampled by one plain engine: PROMPTS under ARGS, and prompts the
    model-free drafters (n-gram, suffix) match under PLAIN_ARGS."""
    matched = ngram_prompts(tiny_model, NGRAM_PROMPTS)
    sets = [SampleSet(prompts, a["samples"], a["max_tokens"], a["temperature"], a["top_k"])
            for prompts, a in ((PROMPTS, ARGS), (matched, PLAIN_ARGS))]
    plain, repeats = sample_plain_sets(str(tiny_model), sets)
    return plain, (matched, repeats)


@pytest.fixture(scope="module")
def plain(references):
    return references[0]


@pytest.fixture(scope="module")
def repeats(references):
    """Prompts the model-free drafters match, and their plain samples."""
    return references[1]


def spec(drafter, method="draft_model", k_control="fixed"):
    """Fixed k by default: every step drafts, the strictest test of the sampler (auto has its own test)."""
    return SpeculationConfig(method=method, model=str(drafter), num_speculative_tokens=3, k_control=k_control)


@pytest.fixture(scope="module")
def draft_model_check(tiny_model, drafter, plain):
    """The draft-model check at fixed k; the same engine also samples every prompt at temperature 0.6 in the same
    batches (report.power: the mismatch the check must reject)."""
    return check_lossless(str(tiny_model), spec(drafter), PROMPTS, plain=plain, power_temperature=0.6, **ARGS)


def test_draft_model_speculation_is_lossless(draft_model_check):
    report = draft_model_check
    print(report.render())
    assert report.passed, report.render()
    assert 0.05 < report.acceptance_rate < 0.99, "the drafter should be neither useless nor perfect"


@pytest.mark.parametrize("off", [False, True], ids=["controller", "drafter-off"])
def test_k_chosen_per_step_is_lossless(tiny_model, drafter, plain, off):
    """k_control auto (the default): the controller switches k between 0 and drafting while the check's
    sequences run (it measures k = 0, then 1, 2, ... per batch size). Samples must still follow the plain
    distribution (steps without drafts take the plain sampling path, speculation/k0_fastpath.py), and the engine
    must really have run steps with and without drafts. drafter-off: every k = 0 step runs with the drafter
    switched off, as where the controller finds that drafting loses: the draft model's pass is skipped (the first
    steps prefill the prompts), so its drafts, once the controller drafts, come from a KV cache with gaps."""
    env = {"ROLLOUT_K_CONTROL_FORCE_OFF": "1"} if off else None
    report = check_lossless(str(tiny_model), spec(drafter, k_control="auto"), PROMPTS, plain=plain, spec_env=env,
                            **ARGS)
    print(report.render())
    assert report.passed, report.render()
    assert len(report.k_steps) == 4 and report.k_steps[0] > 0 and sum(report.k_steps[1:]) > 0, report.k_steps
    if off:
        assert report.drafter_off_steps == report.k_steps[0], (report.drafter_off_steps, report.k_steps)
    # the engine's step trace (bench/speculation_repeat.py read it; retired at ed4ce89) holds every step counted
    assert len(report.k_trace) == sum(report.k_steps) < 4096, (len(report.k_trace), report.k_steps)
    assert sum(off for _, _, _, off, _, _ in report.k_trace) == report.drafter_off_steps
    assert all(seconds > 0 for *_, seconds, _ in report.k_trace)


def test_check_fails_without_the_cpu_sampling_fix(tiny_model, drafter, repeats):
    """Unfixed, the rejection sampler reads garbage temperature (and top-k, top-p): wrong samples and log-probs. The
    check must complete and reject: an engine crash would show nothing about its power. Without top-k (garbage top-k
    out of range crashes the engine: 'selected index k out of range') the unfixed engine runs and samples wrongly."""
    prompts, plain = repeats
    report = check_lossless(str(tiny_model), spec(drafter), prompts, plain=plain,
                            spec_env={"ROLLOUT_DISABLE_CPU_SPEC_FIX": "1"}, **PLAIN_ARGS | {"samples": 200})
    print(report.render())
    assert report.completed, report.render()
    assert not report.passed and report.outcome == "NOT LOSSLESS"


def test_check_fails_on_a_temperature_mismatch(draft_model_check):
    """Samples at temperature 0.6 from the engine that passed the check at 1.0, in the same batches: rejected."""
    power = draft_model_check.power
    print(power.render())
    assert power.completed, power.render()
    assert not power.passed_distribution


def test_k_by_batch_size_is_lossless_by_the_verify_lossless_command(tiny_model, drafter, tmp_path):
    """vLLM's dynamic speculative decoding, checked by the command as a user runs it: k changes from step to step
    with the batch (2 while the check's 64 sequences run, 0 and then 3 as they drain) and samples must still follow
    the plain distribution: exit 0, the G-test table, drafts accepted; a drafter update committed mid-run
    (--update-draft, another noisy copy) is covered by the same check. A schedule beyond num_speculative_tokens, or an
    --update-draft that is not a drafter: exit 2 naming the problem."""
    import subprocess
    import sys

    other = perturbed_copy(tiny_model, tmp_path / "other", scale=0.1, seed=2)
    cmd = [sys.executable, "-m", "rollout_service.cli", "verify-lossless", "--model", str(tiny_model),
           "--method", "draft_model", "--draft-model", str(drafter), "-k", "3"]
    r = subprocess.run(cmd + ["--k-by-batch-size", "1-16:3,17-40:0,41-:2", "--samples", "300", "--max-tokens", "3",
                              "--top-k", "4", "--update-draft", str(other)],
                       check=False, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "RESULT: LOSSLESS" in r.stdout and "p-value" in r.stdout, r.stdout + r.stderr[-3000:]
    assert float(re.search(r"acceptance rate ([0-9.]+)", r.stdout)[1]) > 0.05, r.stdout
    assert int(re.search(r"(\d+) of 600 samples ended under the new drafter", r.stdout)[1]) > 300, r.stdout
    r = subprocess.run(cmd + ["--update-draft", str(tmp_path / "nothing")], check=False, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "--update-draft" in r.stderr and "no such drafter" in r.stderr, r.stderr[-2000:]
    r = subprocess.run(cmd + ["--k-by-batch-size", "1-8:4"], check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "[1, 8, 4]" in r.stderr and "num_speculative_tokens=3" in r.stderr, r.stderr[-2000:]


def test_lora_speculation_is_lossless_by_the_verify_lossless_command(tiny_model):
    """Requests on a LoRA adapter under n-gram speculation (k 3 every step): `verify-lossless --lora-rank 8` builds a
    random adapter, both engines sample on it (the drafter drafts for the base; the target's verify pass applies the
    adapter), log-probs against the base with it merged. Its power: the speculative engine also samples every prompt
    on the base in the same batches; those samples must be rejected, and their log-probs be the base's."""
    import subprocess
    import sys

    ids = [",".join(map(str, p)) for p in ngram_prompts(tiny_model, NGRAM_PROMPTS)]
    r = subprocess.run([sys.executable, "-m", "rollout_service.cli", "verify-lossless", "--model", str(tiny_model),
                        "--method", "ngram", "-k", "3", "--prompt-lookup-min", "1", "--prompt-lookup-max", "3",
                        "--k-control", "fixed", "--lora-rank", "8", "--lora-scale", "4", "--prompt-ids", *ids,
                        "--samples", "300", "--max-tokens", "3", "--top-k", "0", "--logprob-samples", "8"],
                       check=False, capture_output=True, text=True, timeout=600)
    out = r.stdout
    assert r.returncode == 0 and "RESULT: LOSSLESS" in out and "LoRA adapter" in out, out + r.stderr[-3000:]
    power = re.search(r"without the adapter .* -> rejected \(it must be rejected\); their log-probs ([0-9.e+-]+) "
                      r"nats from the base's forward pass", out)
    # base requests batched with adapter requests sample the base (engine/cpu_lora.py: vLLM's CPU LoRA ops gave
    # them the adapter in the last LoRA slot)
    assert power and float(power[1]) < 2e-3, out
    assert "proposed nothing" not in out, "the prompts must make the n-gram drafter propose"


def test_k_by_batch_size_drafts_by_batch(tiny_model, drafter):
    """One sequence drafts k = 3 per step; twelve at once fall in the k = 0 range and draft (almost) nothing."""
    import asyncio

    from rollout_service.config import OPEN_BATCH, EngineConfig
    from rollout_service.engine.types import SeqRequest
    from rollout_service.engine.vllm_engine import VllmEngine

    sp = SpeculationConfig(method="draft_model", model=str(drafter), num_speculative_tokens=3,
                           k_by_batch_size=[(1, 1, 3), (2, 6, 1), (7, OPEN_BATCH, 0)])

    async def run():
        eng = VllmEngine("ksched", str(tiny_model), EngineConfig(max_model_len=256, kv_cache_gb=1, dtype="float32",
                                                                  speculation=sp))
        await eng.start()
        try:
            def req(i):
                return SeqRequest(seq_id=f"k-{i}", prompt_token_ids=PROMPTS[i % 2], max_tokens=32, ignore_eos=True,
                                  seed=i)
            one = await eng.generate(req(0))
            many = await asyncio.gather(*(eng.generate(req(1 + i)) for i in range(12)))
            return one, many
        finally:
            await eng.shutdown()

    one, many = asyncio.run(run())
    assert one.spec_steps > 5 and one.num_drafted >= 2.5 * one.spec_steps, (one.num_drafted, one.spec_steps)
    drafted = sum(r.num_drafted for r in many)
    assert drafted <= 0.1 * sum(len(r.token_ids) for r in many), [(r.num_drafted, r.spec_steps) for r in many]


@pytest.fixture(scope="module")
def adapted_head(tiny_model, eagle3_head, tmp_path_factory):
    """The head after a step of the trainer's online adaptation (trainer_example/drafter.py OnlineEagle3Head) on
    the policy's own samples, saved whole in the served head's format: what a trainer pushes with UpdateDraft
    mid-run (`--adapt-drafter`)."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from trainer_example.drafter import OnlineEagle3Head

    policy = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    head = OnlineEagle3Head(eagle3_head, policy, lr=1e-3, batch=8, seed=1)
    torch.manual_seed(1)
    for prompt in PROMPTS:
        ids = policy.generate(torch.tensor([prompt] * 8), do_sample=True, max_new_tokens=8, min_new_tokens=8,
                              top_k=ARGS["top_k"], temperature=1.0)
        mask = torch.ones_like(ids)
        with torch.no_grad():
            out = policy(ids, attention_mask=mask, output_hidden_states=True)
        generated = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool)
        generated[:, len(prompt) - 1:] = True                  # targets ids[:, t + 1] past the prompt
        head.collect(out.hidden_states, out.logits, ids, mask, generated)
    step = head.adapt()
    assert step["weights"] and step["head_samples"] > 0, step
    out_dir = tmp_path_factory.mktemp("drafters") / "eagle3-adapted"
    shutil.copytree(eagle3_head, out_dir)
    tensors = load_file(str(out_dir / "model.safetensors"))
    moved = {k: v for k, v in step["weights"].items() if not torch.equal(v, tensors[k])}
    assert moved, "the adaptation changed nothing"
    save_file(tensors | {k: v.contiguous() for k, v in step["weights"].items()}, str(out_dir / "model.safetensors"))
    return out_dir


@pytest.mark.parametrize("k_control", ["fixed", "auto"])
def test_eagle3_speculation_is_lossless(tiny_model, eagle3_head, adapted_head, plain, k_control):
    """auto: the controller switches k between 0 and drafting, and at k = 0 the head's pass is skipped
    (k0_fastpath._skip_idle_eagle), so later drafts read a KV cache with gaps: samples must still follow the plain
    distribution. fixed: the head the trainer adapted online is committed mid-run (keep mode, as UpdateDraft), so
    the samples before, across and after the update are all checked."""
    update = str(adapted_head) if k_control == "fixed" else None
    report = check_lossless(str(tiny_model), spec(eagle3_head, "eagle3", k_control), PROMPTS, plain=plain,
                            update_draft=update, **ARGS)
    print(report.render())
    assert report.passed, report.render()
    assert report.acceptance_rate > 0.05, "the trained head should be accepted some of the time"
    if k_control == "auto":
        assert report.k_steps[0] > 0 and sum(report.k_steps[1:]) > 0, report.k_steps
    else:
        assert any("drafter updated mid-run" in n for n in report.notes), report.notes
        after = int(re.search(r"(\d+) of \d+ samples ended under the new drafter", report.render())[1])
        assert after > 0.5 * ARGS["samples"] * len(PROMPTS), report.render()     # two thirds were in flight or to come


def test_eagle3_head_update_moves_acceptance(tiny_model, eagle3_head, tmp_path):
    """UpdateDraft into a running EAGLE-3 head (its float tensors, as named in the head's safetensors; the
    draft vocabulary mapping d2t stays): a degraded head is accepted less, per drafter version."""
    from safetensors.torch import load_file

    with running_service(tiny_model, tmp_path / "eagle3.log", "--speculation", "eagle3", "--draft-model",
                         str(eagle3_head), "--num-speculative-tokens", "3", "--k-control", "fixed") as svc:
        with RolloutClient(svc.target) as c:
            gen = dict(n=32, max_tokens=ARGS["max_tokens"], top_k=ARGS["top_k"], temperature=1.0, ignore_eos=True)
            assert all(s.num_drafted > 0 and s.draft_version == 0 for s in c.generate(PROMPTS, **gen))
            st = c.status()
            assert st.speculation_method == "eagle3"
            trained = acceptance(st, 0)
            assert trained.acceptance_rate > 0.1, trained
            head = {k: v for k, v in load_file(str(eagle3_head / "model.safetensors")).items() if k != "d2t"}
            g = torch.Generator().manual_seed(0)
            worse = {k: v + torch.randn(v.shape, generator=g) * 2 * v.std() for k, v in head.items()}
            res = c.update_draft(worse, 1, partial=True)
            assert res.version == 1 and res.target == "drafter"
            assert all(s.draft_version == 1 for s in c.generate(PROMPTS, **gen))
            degraded = acceptance(c.status(), 1)
            assert degraded.acceptance_rate < trained.acceptance_rate - 0.1, (degraded, trained)


def ngram_prompts(model_dir, bases):
    """Prompts that already contain every likely first token (the model's top-4 after the prompt), so the
    n-gram drafter finds a match right after the first generated token and proposes what followed it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for base in bases:
        prompt = list(base)
        for _ in range(8):
            with torch.no_grad():
                top = model(torch.tensor([prompt])).logits[0, -1].topk(4).indices.tolist()
            missing = [t for t in top if t not in prompt[:-1]]
            if not missing:
                break
            prompt = prompt[:1] + [x for t in missing for x in (t, 700 + t % 50, 800 + t % 60)] + prompt[1:]
        out.append(prompt)
    return out


def test_ngram_speculation_is_lossless(tiny_model, repeats):
    prompts, plain = repeats
    report = check_lossless(str(tiny_model), SpeculationConfig(method="ngram", num_speculative_tokens=3,
                                                               prompt_lookup_min=1, prompt_lookup_max=3,
                                                               k_control="fixed"),
                            prompts, plain=plain, **PLAIN_ARGS)
    print(report.render())
    assert report.passed, report.render()
    assert "proposed nothing" not in report.render(), "the prompts must make the n-gram drafter propose"


@pytest.mark.parametrize("per_step", [False, True], ids=["fixed", "k-per-step"])
def test_suffix_decoding_is_lossless(tiny_model, repeats, per_step):
    """Suffix decoding (Arctic Inference's suffix trees, vLLM method "suffix") on prompts whose repeats it
    matches. k-per-step: vLLM's dynamic path tells the proposer a k for each step (3, then 0, then 2 as the check's
    sequences drain; the controller does the same through that path), which vLLM's proposer refused before
    speculation/suffix_k.py; at k = 0 it must still record the sampled tokens it drafts from later."""
    from rollout_service.config import OPEN_BATCH

    prompts, plain = repeats
    schedule = [(1, 16, 3), (17, 40, 0), (41, OPEN_BATCH, 2)] if per_step else []
    report = check_lossless(str(tiny_model), SpeculationConfig(method="suffix", num_speculative_tokens=3,
                                                               k_control="fixed", k_by_batch_size=schedule),
                            prompts, plain=plain, **PLAIN_ARGS)
    print(report.render())
    assert report.passed, report.render()
    assert report.acceptance_rate > 0.05, "the prompts must make the suffix drafter propose and be accepted"


# ---- a speculative service (conftest.py's spec_service, shared): telemetry and drafter updates ----------------

def acceptance(status, draft_version):
    rows = [s for s in status.speculation if s.draft_version == draft_version]
    assert rows, f"no speculation stats for drafter version {draft_version}: {status.speculation}"
    return rows[-1]


def test_identical_drafter_accepts_nearly_everything_and_worse_drafter_less(spec_service, tiny_model, drafter):
    """The drafter identical to the target: version 0 as the shared service starts (pushed first where a test before
    left another serving), then the noisy drafter pushed as the next version."""
    svc, c = spec_service.svc, spec_service.client
    v = spec_service.serve(spec_service.identical)
    samples = list(c.generate(PROMPTS, n=4, max_tokens=24, ignore_eos=True, temperature=1.0))
    assert all(s.num_drafted > 0 and s.draft_version == v for s in samples)
    st = c.status()
    assert st.speculation_method == "draft_model" and st.num_speculative_tokens == 3
    same = acceptance(st, v)
    assert same.acceptance_rate > 0.9 and same.mean_acceptance_length > 3.0
    assert len(same.per_position_acceptance) == 3 and same.per_position_acceptance[0] >= same.per_position_acceptance[2]

    from transformers import AutoModelForCausalLM
    worse = AutoModelForCausalLM.from_pretrained(drafter, dtype=torch.float32)
    res = c.update_draft(worse, v + 1)
    spec_service.pushed(drafter, v + 1)
    assert res.version == v + 1 and res.target == "drafter"
    assert c.status().draft_version == v + 1 and c.status().policy_version == 0
    samples = list(c.generate(PROMPTS, n=4, max_tokens=24, ignore_eos=True, temperature=1.0))
    assert all(s.draft_version == v + 1 for s in samples)
    lower = acceptance(c.status(), v + 1)
    assert lower.acceptance_rate < same.acceptance_rate - 0.1, (lower, same)
    code, text = svc.http_get("/metrics")
    assert f'rollout_spec_accepted_tokens_total{{draft_version="{v + 1}",policy_version="0"}}' in text

    with pytest.raises(grpc.RpcError) as e:
        c.update_draft(worse, v + 1)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_speculative_service_logprobs_match_reference(spec_service, tiny_model):
    from transformers import AutoModelForCausalLM

    from rollout_service.drafting.reference import processed_logprobs

    c = spec_service.client
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for group in c.generate_all(PROMPTS, n=2, max_tokens=16, ignore_eos=True, temperature=0.9, top_p=0.95, seed=2):
        for s in group:
            ref = processed_logprobs(model, PROMPTS[s.prompt_index], s.token_ids.tolist(), 0.9, 0, 0.95)
            np.testing.assert_allclose(s.logprobs, ref.numpy(), atol=2e-3, rtol=0)


def test_a_speculative_chat_episode_keeps_exact_tokens(spec_service, tiny_model):
    """A two-turn chat episode with tools on the speculative service (drafting k = 3 every step): turn 2 continues
    turn 1's exact tokens (prefix_token_ids) and its served log-probs are the forward pass's over the whole episode:
    speculation changes nothing across turns. A tool_choice that constrains sampling (required, named) is refused
    under speculation, naming tool_choice: measured here, vLLM's CPU engine under speculation dropped tokens its
    structural tag requires."""
    from transformers import AutoModelForCausalLM

    from rollout_client import Episode

    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    c = spec_service.client
    drafted = sum(x.num_drafted for x in c.status().speculation)
    group = Episode.group([{"role": "user", "content": "Look it up."}], n=2, tools=[tool])
    c.chat_step(group, max_tokens=16, temperature=1.0, ignore_eos=True)
    for e in group:
        e.add_message({"role": "user", "content": "And then?"})
        e.done = False
    c.chat_step(group, max_tokens=16, temperature=1.0, ignore_eos=True)
    for e in group:
        first = e.turns[0].prompt_token_ids.tolist() + e.turns[0].token_ids.tolist()
        assert e.turns[1].prompt_token_ids.tolist()[:len(first)] == first
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([e.token_ids])).logits[0].float(), -1)
        sampled = [i for i, m in enumerate(e.mask) if m]
        np.testing.assert_allclose(np.asarray(e.logprobs)[sampled],
                                   [lp[i - 1, e.token_ids[i]].item() for i in sampled], atol=2e-3, rtol=0)
    assert sum(x.num_drafted for x in c.status().speculation) > drafted
    forced = Episode([{"role": "user", "content": "x"}], tools=[tool], tool_choice="required")
    with pytest.raises(grpc.RpcError) as err:
        c.chat_step([forced], max_tokens=4)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("prompts[0].chat.tool_choice: 'required' constrains sampling")


def test_k_controller_follows_the_drafter(tiny_model, tmp_path):
    """A service choosing k itself (the default): with a drafter identical to the policy it drafts and its
    measured acceptance is near 1; after UpdateDraft to a useless drafter it forgets that acceptance, re-measures
    it (drafting steps again) and reports the new drafter's, in GetStatus and /metrics."""
    identical = perturbed_copy(tiny_model, tmp_path / "identical", scale=0.0)
    useless = perturbed_copy(tiny_model, tmp_path / "useless", scale=3.0, seed=3)
    with running_service(tiny_model, tmp_path / "auto.log", "--speculation", "draft_model", "--draft-model",
                         str(identical), "--num-speculative-tokens", "3") as svc:
        with RolloutClient(svc.target) as c:
            def run_and_status():
                list(c.generate(PROMPTS, n=8, max_tokens=48, ignore_eos=True, temperature=1.0))
                import time
                time.sleep(2.5)                 # the supervisor copies the engines' controller state every second
                return c.status().k_control
            k1 = run_and_status()
            assert k1.mode == "auto" and k1.draft_version == 0
            assert sum(k1.steps_by_k[1:]) > 0 and k1.acceptance[0] > 0.9, k1
            assert k1.choices and all(len(ch.step_ms) == 4 for ch in k1.choices)
            from transformers import AutoModelForCausalLM
            c.update_draft(AutoModelForCausalLM.from_pretrained(useless, dtype=torch.float32), 1)
            k2 = run_and_status()
            assert k2.draft_version == 1 and k2.acceptance[0] < 0.5, k2
            # it drafted again to measure the new drafter (and ran k = 0 steps as well)
            assert sum(k2.steps_by_k[1:]) > sum(k1.steps_by_k[1:]) and k2.steps_by_k[0] > k1.steps_by_k[0], (k1, k2)
            code, text = svc.http_get("/metrics")
            assert code == 200 and 'rollout_spec_k_chosen_bucket{engine="engine-0",le="3"}' in text, text[-3000:]
            assert "rollout_spec_step_seconds{" in text
