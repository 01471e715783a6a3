"""The EAGLE-3 head adapted online by the GRPO trainer (trainer_example/drafter.py, OnlineEagle3Head), on a tiny
random Llama and no service: the features it takes from the trainer's own padded forward passes are those of the
offline pass of `prepare-drafter --kind eagle3`, its training step (the offline one, shared) lowers the loss on a
fixed batch, what it pushes is the head's model.safetensors less d2t (names, shapes, dtypes; d2t untouched), the
background mode pushes the previous step's head, and adapting leaves the policy's update unchanged."""
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rollout_service.drafting import eagle3
from trainer_example.drafter import OnlineEagle3Head
from trainer_example.rollouts import Rollout, pack
from trainer_example.train import Trainer, parse_args

VOCAB = 96


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    d = tmp_path_factory.mktemp("tiny-policy")
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():                      # a peaked next-token distribution, as a language model's
        model.lm_head.weight.normal_(0, 1.0)
    model.save_pretrained(d)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def head_dir(policy_dir, tmp_path_factory):
    """An untrained head in vLLM's format over a draft vocabulary smaller than the target's (so it has d2t)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    aux = eagle3.default_aux_layers(model.config.num_hidden_layers)
    torch.manual_seed(1)
    head = eagle3.make_head(model.config, list(range(0, VOCAB, 2)) + [VOCAB - 1], model.get_input_embeddings().weight,
                            aux)
    return eagle3.save_head(head, policy_dir, tmp_path_factory.mktemp("head") / "eagle3", aux, {})


def rollouts(n=8, seed=1):
    g = np.random.default_rng(seed)
    out = []
    for i in range(n):
        gen = g.integers(1, VOCAB, size=int(g.integers(3, 12)))
        out.append(Rollout(group=i // 4, prompt_ids=g.integers(1, VOCAB, size=int(g.integers(2, 7))).tolist(),
                           token_ids=gen, rollout_logp=np.zeros(len(gen), np.float32), reward=float(i % 2),
                           correct=bool(i % 2), oldest_version=0, draft_version=0, num_drafted=0, num_accepted=0,
                           advantage=float(i % 2) * 2 - 1))
    return out


def policy(policy_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()


def collected(adapter, model, rs, micro=3):
    """The trainer's way: right-padded micro-batches through the policy, features kept from the same pass."""
    packed = pack(rs)
    for s in range(0, len(rs), micro):
        rows = slice(s, s + micro)
        width = int(packed.attention_mask[rows].sum(1).max())
        mb = packed.slice(rows, width)
        with torch.no_grad():
            out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, output_hidden_states=True)
        adapter.collect(out.hidden_states, out.logits, mb.input_ids, mb.attention_mask, mb.gen_mask)
    return adapter.feats


def test_trainer_forward_gives_the_offline_features(policy_dir, head_dir):
    model = policy(policy_dir)
    rs = rollouts()
    adapter = OnlineEagle3Head(head_dir, model, temperature=1.0)
    online = collected(adapter, model, rs)
    offline = eagle3.target_features(model, [(r.prompt_ids, r.token_ids.tolist()) for r in rs],
                                     adapter.aux_layers, progress=False)
    assert len(online) == len(offline) == len(rs) and adapter.collect_s > 0
    for (a, ids, ti, tp, first), (a2, ids2, ti2, tp2, first2) in zip(online, offline):
        assert first == first2 and ids.tolist() == ids2.tolist() and a.shape == a2.shape
        torch.testing.assert_close(a, a2, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(tp[first:], tp2[first:], atol=1e-5, rtol=1e-4)
        assert (ti[first:] == ti2[first:]).float().mean() > 0.99     # near-ties may swap places
    capped = OnlineEagle3Head(head_dir, model, temperature=1.0, max_rows=2)    # --head-samples 2
    few = collected(capped, model, rs)
    assert len(rs) > 2 and len(few) == 2
    assert all(torch.equal(a, b[0]) for (a, *_), b in zip(few, online))        # the step's first rows
    assert capped.adapt()["head_samples"] == 2


def test_online_step_lowers_the_loss_on_a_fixed_batch(policy_dir, head_dir):
    model = policy(policy_dir)
    adapter = OnlineEagle3Head(head_dir, model, lr=3e-3, temperature=0.5, batch=4)
    feats = list(collected(adapter, model, rollouts()))
    batch = eagle3._batch(feats, list(range(len(feats))), adapter.steps, adapter.to_draft)

    def loss():
        with torch.no_grad():
            return float(eagle3.head_loss(adapter.head, batch, adapter.steps, temperature=0.5))

    before = loss()
    first = adapter.adapt()
    for _ in range(14):
        adapter.feats = list(feats)
        last = adapter.adapt()
    assert loss() < 0.8 * before, (before, loss())
    assert first["head_samples"] == len(feats) and first["head_train_s"] > 0 and first["adapt_s"] > 0
    assert sum(last["head_expected_acceptance"]) > sum(first["head_expected_acceptance"])
    assert len(first["head_expected_acceptance"]) == 3


def test_pushed_tensors_are_the_heads_safetensors_less_d2t(policy_dir, head_dir, tmp_path):
    model = policy(policy_dir)
    saved = load_file(str(head_dir / "model.safetensors"))
    adapter = OnlineEagle3Head(head_dir, model, lr=1e-2)
    assert adapter.adapt()["weights"] is None                 # nothing learnt: nothing to push
    collected(adapter, model, rollouts())
    pushed = adapter.adapt()["weights"]
    assert set(pushed) == set(saved) - {"d2t"} and "d2t" in saved
    for name, t in pushed.items():
        assert t.shape == saved[name].shape and t.dtype == saved[name].dtype == torch.float32, name
    assert any(not torch.equal(t, saved[name]) for name, t in pushed.items())     # it did learn
    assert torch.equal(adapter.head.vllm_state_dict()["d2t"], saved["d2t"])        # the mapping never moves
    # the pushed tensors over the saved head make a head the service (and load_head) reads: the same format
    out = eagle3.save_head(adapter.head, policy_dir, tmp_path / "adapted", adapter.aux_layers, {})
    back = load_file(str(out / "model.safetensors"))
    assert set(back) == set(saved)
    for name, t in pushed.items():
        torch.testing.assert_close(back[name], t, rtol=0, atol=0)


def test_background_adaptation_pushes_the_previous_steps_head(policy_dir, head_dir):
    model = policy(policy_dir)
    adapter = OnlineEagle3Head(head_dir, model, lr=1e-2, background=True)
    collected(adapter, model, rollouts(seed=1))
    step0 = adapter.adapt()                        # the job starts; nothing finished yet
    assert step0["weights"] is None and "head_train_s" not in step0
    collected(adapter, model, rollouts(seed=2))
    step1 = adapter.adapt()                        # waits for step 0's job, pushes its head, starts step 1's
    assert step1["weights"] is not None and step1["head_samples"] == 8
    snapshot = {k: v.clone() for k, v in step1["weights"].items()}
    adapter.close()                                # step 1's job has trained the head further meanwhile
    assert adapter.trained == 2
    for name, t in step1["weights"].items():
        assert torch.equal(t, snapshot[name]), name    # the pushed snapshot is not written by the next job
    assert any(not torch.equal(t, eagle3.pushable_tensors(adapter.head)[n]) for n, t in snapshot.items())


def test_trainer_adapts_the_head_without_changing_the_policys_update(policy_dir, head_dir):
    """Every row's features come from pi_old's passes (the recompute's for later minibatches, the first
    minibatch's training pass), and the policy's step is the one taken without adaptation (no shared RNG)."""
    def trainer(*extra):
        torch.manual_seed(0)
        args = parse_args(["--micro-batch", "3", "--lr", "1e-2", "--minibatches", "2", *extra])
        return Trainer(policy_dir, args, str(head_dir), "eagle3")

    packed = pack(rollouts())
    plain, adapting = trainer(), trainer("--adapt-drafter")
    assert plain.head is None and adapting.head is not None
    results = []
    for t in (plain, adapting):
        torch.manual_seed(5)
        parts = t.minibatches(8)
        results.append(t.train(packed, parts, t.recompute(packed, parts)))
    assert len(adapting.head.feats) == 8 and adapting.collect_s() > 0
    assert results[0]["loss"] == pytest.approx(results[1]["loss"], abs=1e-6)
    for p, q in zip(plain.policy.parameters(), adapting.policy.parameters()):
        assert torch.equal(p, q)
    metrics = adapting.head.adapt()
    assert metrics["head_samples"] == 8 and set(metrics["weights"]) == set(
        load_file(str(head_dir / "model.safetensors"))) - {"d2t"}


def test_the_steps_acceptance_per_position_is_its_versions_own():
    """GetStatus keeps speculation stats per (policy, drafter) version pair: the step's row(s), weighted by drafts."""
    from types import SimpleNamespace as NS

    from trainer_example.train import speculation_summary

    rs = rollouts(4)
    for r in rs:
        r.oldest_version, r.draft_version, r.num_drafted, r.num_accepted = 3, 1, 10, 5
    k = NS(acceptance=[0.9, 0.8], mode="auto", steps_by_k=[0, 0, 0])
    stats = [NS(policy_version=2, draft_version=1, num_drafted=99, per_position_acceptance=[0.1, 0.1]),
             NS(policy_version=3, draft_version=0, num_drafted=99, per_position_acceptance=[0.2, 0.2]),
             NS(policy_version=3, draft_version=1, num_drafted=30, per_position_acceptance=[0.6, 0.4]),
             NS(policy_version=3, draft_version=1, num_drafted=10, per_position_acceptance=[0.2, 0.0])]
    out = speculation_summary(rs, k, k, stats)
    assert out["acceptance_rate"] == 0.5 and out["draft_versions"] == [1]
    assert out["position_acceptance"] == pytest.approx([0.5, 0.3]) and out["draft_acceptance"] == [0.9, 0.8]
    assert speculation_summary(rs, k, k)["position_acceptance"] == []


def test_the_benchmark_report_checks_the_issues_goals():
    from bench import eagle3_adapt

    def run(acc, gen, adapt):
        return [{"step": s, "acceptance_rate": acc, "position_acceptance": [acc + 0.1, acc], "k_mean": 1.0,
                 "generate_s": gen, "generation_wall_s": gen, "step_s": 50.0, "adapt_s": adapt, "draft_push_s": 1.0,
                 "draft_pushed": s, "kl_to_start": 0.1} for s in range(12)]

    frozen = eagle3_adapt.summarise(run(0.30, 10.0, 0.0), 10)
    good = eagle3_adapt.summarise(run(0.36, 9.5, 3.0), 10)
    assert good["steps"] == list(range(2, 12)) and good["acceptance_per_position"] == pytest.approx([0.46, 0.36])
    assert good["adaptation_fraction"] == pytest.approx(4.0 / 50)
    assert all(g["met"] for g in eagle3_adapt.goals(frozen, good).values())
    bad = eagle3_adapt.goals(frozen, eagle3_adapt.summarise(run(0.33, 10.5, 5.0), 10))
    assert not any(g["met"] for g in bad.values())


def test_save_final_keeps_the_policy_and_the_head_it_followed(policy_dir, head_dir, tmp_path):
    """--save-final: the trained policy and the adapted head, for measuring one against the other afterwards."""
    import types

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer_example.train import save_final

    model = policy(policy_dir)
    adapter = OnlineEagle3Head(head_dir, model, lr=1e-2)
    collected(adapter, model, rollouts())
    pushed = adapter.adapt()["weights"]
    with torch.no_grad():
        model.lm_head.weight.add_(0.01)                                      # "trained"
    trainer = types.SimpleNamespace(policy=model, tok=AutoTokenizer.from_pretrained(policy_dir), head=adapter)
    saved = save_final(trainer, str(policy_dir), tmp_path)
    assert saved == [str(tmp_path / "policy"), str(tmp_path / "eagle3-head")]
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "policy", dtype=torch.float32)
    assert torch.equal(back.lm_head.weight, model.lm_head.weight)
    head = load_file(str(tmp_path / "eagle3-head" / "model.safetensors"))
    assert all(torch.equal(head[n], t) for n, t in pushed.items())
    assert eagle3.load_head(tmp_path / "eagle3-head", back) is not None
