"""GRPO's arithmetic: group-normalised advantages and the clipped, importance-weighted policy loss.

Three distributions meet in the loss, per generated token t:
  pi_rollout  the policy version the service sampled from (its returned log-probs),
  pi_old      the trainer's policy before this batch's updates (recomputed, no grad),
  pi_theta    the policy being optimised.
The PPO ratio pi_theta / pi_old is clipped to [1 - eps, 1 + eps]. The gap between the sampler and pi_old
(async lag, or numerical differences between vLLM and the trainer) is corrected by the truncated importance
weight min(pi_old / pi_rollout, cap), detached (truncated importance sampling, as in verl/slime).
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
    mean_is_weight: float       # mean truncated importance weight pi_old / pi_rollout
    truncated_fraction: float   # tokens whose importance weight hit the cap


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, rollout_logp: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, *, clip_eps: float = 0.2, is_cap: float = 2.0,
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
    raw_is = torch.exp((old_logp - rollout_logp).clamp(max=20.0)).detach()      # [B, T]
    is_weight = raw_is.clamp(max=is_cap)
    per_token = -torch.minimum(unclipped, clipped) * is_weight
    loss = (per_token * mask).sum() / n
    with torch.no_grad():
        m = mask.sum().clamp(min=1)
        stats = LossStats(
            loss=float(loss.detach()),
            clip_fraction=float(((clipped < unclipped).to(mask.dtype) * mask).sum() / m),
            mean_is_weight=float((is_weight * mask).sum() / m),
            truncated_fraction=float(((raw_is > is_cap).to(mask.dtype) * mask).sum() / m),
        )
    return loss, stats


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits [B, T, V], targets [B, T] -> log p(target) [B, T] (float32) under softmax(logits / temperature),
    the distribution the service samples from and returns log-probs of; no [B, T, V] log-softmax copy."""
    logits = logits.float() / temperature
    return logits.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
