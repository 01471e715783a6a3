"""GRPO's arithmetic: group-normalised advantages and the clipped, importance-weighted policy loss.

Three distributions meet in the loss, per generated token t:
  pi_rollout  the policy version the service sampled from (its returned log-probs),
  pi_old      the trainer's policy before this batch's updates (recomputed, no grad),
  pi_theta    the policy being optimised.
The PPO ratio pi_theta / pi_old is clipped to [1 - eps, 1 + eps]. The gap between the sampler and pi_old
(async lag, a quantized rollout policy, or numerical differences between vLLM and the trainer) is corrected by a
detached importance weight on r = pi_old / pi_rollout per token (rollout correction, as in verl and slime):
  tis   truncated importance sampling: min(r, cap)
  mis   masked importance sampling: r where 1/cap <= r <= cap, else 0 (the token is dropped from the gradient:
        verl's rejection "mask" mode, with its default lower bound 1/cap)
  none  1: the samples are treated as on-policy
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rewards: [groups, n] -> advantages [groups, n]: (r - group mean) / (group std + eps).
    A group whose samples all scored the same carries no signal and gets zeros."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)


@dataclass
class LossStats:
    loss: float
    clip_fraction: float        # tokens where the clip is active (the clipped term won: no gradient)
    mean_is_weight: float       # mean importance weight applied (after truncation or masking)
    truncated_fraction: float   # tokens whose pi_old / pi_rollout left the cap (tis: truncated, mis: masked)
    logp_mismatch: float        # mean |log pi_old - log pi_rollout|: the rollout policy's distance per token
    kl_k3: float                # KL(pi_rollout || pi_old), k3 estimator: mean(r - 1 - log r)


CORRECTIONS = ("tis", "mis", "none")


def correction_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, correction: str, cap: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """old_logp, rollout_logp: [B, T] -> (detached weights [B, T], out-of-range bool [B, T]) for r = pi_old/pi_rollout
    under `correction` (module docstring); out of range: r > cap (tis), r outside [1/cap, cap] (mis, none)."""
    if correction not in CORRECTIONS:
        raise ValueError(f"rollout correction {correction!r}: one of {', '.join(CORRECTIONS)}")
    log_r = (old_logp - rollout_logp).detach().clamp(max=20.0)
    r = torch.exp(log_r)
    if correction == "tis":
        return r.clamp(max=cap), r > cap
    outside = (r > cap) | (r < 1.0 / cap)
    if correction == "mis":
        return torch.where(outside, torch.zeros_like(r), r), outside
    return torch.ones_like(r), outside


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, rollout_logp: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, *, clip_eps: float = 0.2, is_cap: float = 2.0, correction: str = "tis",
              num_tokens: int | None = None) -> tuple[torch.Tensor, LossStats]:
    """logp, old_logp, rollout_logp, mask: [B, T] over generated tokens; advantages: [B] (one per sample).
    Returns the loss summed over masked tokens / num_tokens (default: masked tokens in this call), so that
    micro-batches of one batch add up to the token-mean over the whole batch."""
    mask = mask.to(logp.dtype)
    n = float(num_tokens if num_tokens is not None else mask.sum().clamp(min=1))
    ratio = torch.exp(logp - old_logp)                                           # [B, T]
    adv = advantages[:, None].to(logp.dtype)                                     # [B, 1]
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv
    is_weight, outside = correction_weights(old_logp, rollout_logp, correction, is_cap)     # [B, T]
    per_token = -torch.minimum(unclipped, clipped) * is_weight
    loss = (per_token * mask).sum() / n
    with torch.no_grad():
        m = mask.sum().clamp(min=1)
        stats = LossStats(
            loss=float(loss.detach()),
            clip_fraction=float(((clipped < unclipped).to(mask.dtype) * mask).sum() / m),
            mean_is_weight=float((is_weight * mask).sum() / m),
            truncated_fraction=float((outside.to(mask.dtype) * mask).sum() / m),
            logp_mismatch=float(((old_logp - rollout_logp).abs() * mask).sum() / m),
            kl_k3=float(((torch.expm1(old_logp - rollout_logp) - (old_logp - rollout_logp)) * mask).sum() / m),
        )
    return loss, stats


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits [B, T, V], targets [B, T] -> log p(target) [B, T] (float32) under softmax(logits / temperature),
    the distribution the service samples from and returns log-probs of; no [B, T, V] log-softmax copy."""
    logits = logits.float() / temperature
    return logits.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
