"""The trainer's step on a tiny random Llama (no service): skipping the pi_old recompute for the first
minibatch gives exactly the update a full recompute gives, and later minibatches cannot go without it."""
import numpy as np
import pytest
import torch

from trainer_example.rollouts import Rollout, pack
from trainer_example.train import Trainer, parse_args


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    d = tmp_path_factory.mktemp("tiny-policy")
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(d)
    return str(d)


def batch(n=8, seed=1):
    g = np.random.default_rng(seed)
    out = []
    for i in range(n):
        gen = g.integers(1, 64, size=int(g.integers(3, 9)))
        out.append(Rollout(group=i // 4, prompt_ids=g.integers(1, 64, size=int(g.integers(2, 6))).tolist(),
                           token_ids=gen, rollout_logp=np.log(np.full(len(gen), 1 / 64, np.float32)),
                           reward=float(i % 2), correct=bool(i % 2), oldest_version=0, draft_version=0,
                           num_drafted=0, num_accepted=0, advantage=float(i % 2) * 2 - 1))
    return pack(out)


def trainer(policy_dir, *extra):
    torch.manual_seed(0)
    return Trainer(policy_dir, parse_args(["--micro-batch", "1", "--lr", "1e-2", *extra]), None)


@pytest.mark.parametrize("minibatches", [1, 2, 3])
def test_first_minibatch_uses_its_own_forward_as_pi_old(policy_dir, minibatches):
    packed = batch()
    full, short = trainer(policy_dir, "--minibatches", str(minibatches)), trainer(policy_dir, "--minibatches",
                                                                                  str(minibatches))
    parts = full.minibatches(8)
    old_full = full.recompute(packed, [torch.arange(0)] + parts)   # every row, as if no part went first
    old_short = short.recompute(packed, parts)
    assert torch.isnan(old_short[parts[0]]).all() and not torch.isnan(old_full).any()
    a, b = full.train(packed, parts, old_full), short.train(packed, parts, old_short)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    assert a["kl_to_start"] == pytest.approx(b["kl_to_start"], abs=1e-7) and a["kl_to_start"] == 0.0
    for p, q in zip(full.policy.parameters(), short.policy.parameters()):
        assert torch.allclose(p, q, atol=1e-7)   # micro-batches of one row: the same shapes, the same sums
    moved = sum(float((p - s).abs().sum()) for p, s in zip(short.policy.parameters(), short.start.parameters()))
    assert moved > 0                                        # the step did train
    # After the update the policy has left the start policy: KL now measures something.
    assert short.train(batch(seed=2), parts, short.recompute(batch(seed=2), parts))["kl_to_start"] > 0


def test_a_later_minibatch_without_pi_old_is_refused(policy_dir):
    t = trainer(policy_dir, "--minibatches", "2")
    packed = batch()
    parts = t.minibatches(8)
    with pytest.raises(ValueError, match="pi_old missing"):
        t.train(packed, parts, t.recompute(packed, parts[::-1]))   # pi_old given for the wrong part


def test_a_served_policy_other_than_the_trainers_is_reported():
    """Samples without lag must carry the trainer's own log-probs (importance weights 1): the rows of a transfer
    that served corrupt weights (runs of 2026-11-26) are flagged, lagged or matching ones are not."""
    from trainer_example.train import policy_mismatch

    ok = {"step": 3, "max_lag_used": 0, "is_weight_mean": 1.0, "is_truncated_fraction": 0.0}
    assert policy_mismatch(ok) is None
    assert policy_mismatch(ok | {"is_weight_mean": 1.007, "is_truncated_fraction": 0.002}) is None
    bad = policy_mismatch(ok | {"is_weight_mean": 0.786, "is_truncated_fraction": 0.036})
    assert bad and "step 3" in bad and "0.786" in bad and "3.6% truncated" in bad
    assert policy_mismatch(ok | {"is_weight_mean": 0.7, "max_lag_used": 1}) is None     # off-policy by design
    assert policy_mismatch({"step": 0, "max_lag_used": 0}) is None                      # nothing trained


def test_lora_trains_only_the_adapter_and_pushes_only_it(policy_dir):
    """--lora RANK: a PEFT adapter over a frozen base; the step moves only lora_A/lora_B, and the push hands the
    client the PEFT model (push_adapter sends its adapter's tensors alone) under --policy-name."""
    t = trainer(policy_dir, "--lora", "4", "--policy-name", "mine")
    base = {k: v.clone() for k, v in t.policy.base_model.model.state_dict().items() if "lora_" not in k}
    packed, parts = batch(), t.minibatches(8)
    t.train(packed, parts, t.recompute(packed, parts))
    after = t.policy.base_model.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())                  # the base never moves
    assert any(float(p.abs().sum()) > 0 for n, p in t.policy.named_parameters() if "lora_B" in n)
    sent = {}

    class Client:
        def push_adapter(self, name, adapter, version, dtype=None):
            sent.update(name=name, version=version, adapter=adapter)
            return "ok"
    assert t.push(Client(), None, 3, "wait", None) == "ok"
    assert sent["name"] == "mine" and sent["version"] == 3 and sent["adapter"] is t.policy
    from rollout_client.weights import peft_adapter

    tensors, config = peft_adapter(t.policy)
    assert tensors and all("lora_" in k for k in tensors) and '"r": 4' in config
