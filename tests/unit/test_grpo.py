"""GRPO arithmetic, batch packing, staleness filtering and the plot command (no service needed)."""
import json

import numpy as np
import pytest
import torch

from trainer_example.grpo import group_advantages, grpo_loss, token_logprobs
from trainer_example.plot import main as plot_main
from trainer_example.rollouts import Batch, Rollout, assign_advantages, drop_stale, micro_batches, pack


def test_group_advantages_normalise_within_each_group():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.1, 0.1, 0.1, 0.1], [1.0, 0.1, 0.0, 0.1]])
    a = group_advantages(r)
    assert torch.allclose(a[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-4)
    assert torch.equal(a[1], torch.zeros(4))                     # no signal in a uniform group
    assert abs(float(a[2].mean())) < 1e-6 and abs(float(a[2].std(unbiased=False)) - 1) < 1e-4
    assert a[2, 0] > a[2, 1] > a[2, 2]


def _loss(logp, old, roll, adv, **kw):
    mask = torch.ones_like(logp, dtype=torch.bool)
    return grpo_loss(logp, old, roll, adv, mask, **kw)


def test_on_policy_loss_is_the_policy_gradient():
    logp = torch.log(torch.tensor([[0.5, 0.25], [0.5, 0.5]])).requires_grad_()
    adv = torch.tensor([1.0, -1.0])
    loss, st = _loss(logp, logp.detach(), logp.detach(), adv)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(0.0, abs=1e-6)           # ratio 1, advantages cancel over 4 tokens
    assert torch.allclose(logp.grad, torch.tensor([[-0.25, -0.25], [0.25, 0.25]]))   # -adv / num_tokens
    assert st.clip_fraction == 0 and st.mean_is_weight == pytest.approx(1.0)


def test_ratio_is_clipped_in_the_direction_the_advantage_pushes():
    old = torch.zeros(1, 2)
    logp = torch.tensor([[0.5, -0.5]]).requires_grad_()         # ratios e^0.5 = 1.65, e^-0.5 = 0.61
    loss, st = _loss(logp, old, old, torch.tensor([1.0]), clip_eps=0.2)
    loss.backward()
    assert logp.grad[0, 0] == 0          # positive advantage, ratio above 1 + eps: clipped, no gradient
    assert logp.grad[0, 1] < 0           # ratio below 1 - eps with a positive advantage is not clipped
    assert st.clip_fraction == pytest.approx(0.5)


def test_importance_weight_corrects_the_rollout_gap_and_is_truncated():
    logp = torch.zeros(1, 3, requires_grad=True)
    roll = torch.tensor([[0.0, np.log(2.0), -np.log(10.0)]])    # sampler gave 1x, 2x, 0.1x the probability
    loss, st = _loss(logp, logp.detach(), roll, torch.tensor([1.0]), is_cap=2.0)
    loss.backward()
    w = -logp.grad[0] * 3
    assert torch.allclose(w, torch.tensor([1.0, 0.5, 2.0]))      # pi_old/pi_rollout = 1, 0.5, 10 -> capped at 2
    assert st.truncated_fraction == pytest.approx(1 / 3)


@pytest.mark.parametrize("correction, weights, outside", [
    ("tis", [1.0, 0.5, 2.0, 1.0 / 3], 1 / 4),     # truncated above the cap only
    ("mis", [1.0, 0.5, 0.0, 0.0], 2 / 4),         # r = 10 and r = 1/3 are outside [1/2, 2]: dropped
    ("none", [1.0, 1.0, 1.0, 1.0], 2 / 4)])       # weight 1; the fraction out of range is still reported
def test_rollout_corrections_weigh_each_token_by_pi_old_over_pi_rollout(correction, weights, outside):
    logp = torch.zeros(1, 4, requires_grad=True)
    roll = torch.tensor([[0.0, np.log(2.0), -np.log(10.0), np.log(3.0)]])   # r = pi_old / pi_rollout: 1, 1/2, 10, 1/3
    loss, st = _loss(logp, logp.detach(), roll, torch.tensor([1.0]), is_cap=2.0, correction=correction)
    loss.backward()
    assert torch.allclose(-logp.grad[0] * 4, torch.tensor(weights))
    assert st.truncated_fraction == pytest.approx(outside)
    d = -roll[0].double()                                                   # log r
    assert st.logp_mismatch == pytest.approx(float(d.abs().mean()))
    assert st.kl_k3 == pytest.approx(float((torch.expm1(d) - d).mean()), rel=1e-5) and st.kl_k3 > 0
    with pytest.raises(ValueError, match="rollout correction 'ppo'"):
        _loss(logp, logp.detach(), roll, torch.tensor([1.0]), correction="ppo")


def test_masked_tokens_do_not_count():
    logp = torch.zeros(1, 3, requires_grad=True)
    mask = torch.tensor([[True, False, True]])
    loss, _ = grpo_loss(logp, logp.detach(), logp.detach(), torch.tensor([2.0]), mask)
    loss.backward()
    assert logp.grad[0, 1] == 0 and logp.grad[0, 0] == pytest.approx(-1.0)


def test_token_logprobs_match_log_softmax():
    logits = torch.randn(2, 5, 11)
    tgt = torch.randint(0, 11, (2, 5))
    ref = torch.log_softmax(logits, -1).gather(-1, tgt[..., None]).squeeze(-1)
    assert torch.allclose(token_logprobs(logits, tgt), ref, atol=1e-5)


def _rollout(group, prompt, gen, version=3, reward=0.0):
    return Rollout(group=group, prompt_ids=prompt, token_ids=np.array(gen), rollout_logp=-np.arange(1, len(gen) + 1,
                   dtype=np.float32), reward=reward, correct=reward == 1.0, oldest_version=version, draft_version=0,
                   num_drafted=0, num_accepted=0)


def test_pack_aligns_targets_and_rollout_logprobs_with_generated_tokens():
    rs = [_rollout(0, [5, 6, 7], [8, 9]), _rollout(0, [5], [10, 11, 12])]
    rs[0].advantage, rs[1].advantage = 0.5, -0.5
    p = pack(rs)
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 10, 11, 12, 0]]
    assert p.targets[p.gen_mask].tolist() == [8, 9, 10, 11, 12]
    assert p.rollout_logp[p.gen_mask].tolist() == [-1, -2, -1, -2, -3]
    assert p.num_tokens == 5 and p.advantages.tolist() == [0.5, -0.5]
    parts = list(micro_batches(p, 1))
    assert [w for _, w in parts] == [5, 4]
    assert p.slice(*parts[1]).input_ids.tolist() == [[5, 10, 11, 12]]


def test_stale_groups_are_dropped_whole():
    rs = [_rollout(0, [1], [2], version=5), _rollout(0, [1], [2], version=3),
          _rollout(1, [1], [2], version=4), _rollout(1, [1], [2], version=5)]
    kept, dropped = drop_stale(rs, version=5, max_lag=1)
    assert dropped == 2 and {r.group for r in kept} == {1}
    assert drop_stale(rs, version=5, max_lag=2) == (rs, 0)


def test_advantages_come_from_whole_groups():
    rs = [_rollout(0, [1], [2], reward=1.0), _rollout(0, [1], [2], reward=0.0),
          _rollout(1, [1], [2], reward=0.1), _rollout(1, [1], [2], reward=0.1)]
    rewards = assign_advantages(Batch(rs, 2, 0.0), group_size=2)
    assert rewards.shape == (2, 2)
    assert [round(r.advantage, 4) for r in rs] == [1.0, -1.0, 0.0, 0.0]


def test_plot_command_writes_pngs(tmp_path):
    rows = [{"step": i, "elapsed_s": 60.0 * i, "reward_mean": 0.1 * i, "eval_accuracy": 0.05 * i if i % 2 else None,
             "generate_s": 3.0, "recompute_s": 1.0, "train_s": 2.0, "push_s": 0.5, "kl_to_start": 0.01 * i,
             "acceptance_rate": 0.3 + 0.01 * i} for i in range(5)]
    for name in ("sync", "async"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "plots"
    assert plot_main([str(tmp_path / "sync" / "metrics.jsonl"), str(tmp_path / "async" / "metrics.jsonl"),
                      "--out", str(out)]) == 0
    for name in ("accuracy", "step_time", "acceptance", "kl"):
        data = (out / f"{name}.png").read_bytes()
        assert data[:4] == b"\x89PNG" and len(data) > 5000


def test_mcnemar_pairs_the_same_problems():
    from bench.grpo_table import accuracy_change, mcnemar

    assert mcnemar("0000", "0000") == (0, 0, 1.0)
    assert mcnemar("0011", "1100") == (2, 2, 1.0)                 # accuracy unchanged: no evidence
    gained, lost, p = mcnemar("0" * 10 + "1" * 10, "1" * 10 + "1" * 10)
    assert (gained, lost) == (10, 0) and p == pytest.approx(2 / 2 ** 10)
    assert mcnemar("01" * 20, "11" * 20)[2] < 0.05 < mcnemar("0101", "1111")[2]
    with pytest.raises(ValueError, match="different sizes"):
        mcnemar("01", "011")
    rows = [{"eval_before": 0.5, "eval_before_correct": "0011", "step": 0},
            {"eval_accuracy": 1.0, "eval_correct": "1111", "step": 1}]
    assert accuracy_change(rows) == "0.500 -> 1.000 (+2 / -0 problems, McNemar p = 0.5, n = 4)"


def test_correction_table_summarises_quantized_runs():
    from bench.grpo_table import correction_table

    rows = [{"quantization": "int8", "rollout_correction": "tis", "reward_mean": 0.1, "rollout_logp_mismatch": 0.2,
             "rollout_kl_k3": 0.1, "is_weight_mean": 0.9, "is_truncated_fraction": 0.1, "eval_before": 0.25, "step": 0},
            {"quantization": "int8", "rollout_correction": "tis", "reward_mean": 0.3, "rollout_logp_mismatch": 0.4,
             "rollout_kl_k3": 0.3, "is_weight_mean": 0.7, "is_truncated_fraction": 0.3, "eval_accuracy": 0.5,
             "step": 1}]
    row = correction_table({"int8-tis": rows}).splitlines()[-1]
    assert row == ("| int8-tis | int8 | tis | 0.100 -> 0.300 | 0.200 | 0.300 | 0.200 | 0.800 | 20.0% "
                   "| 0.250 -> 0.500 |")
