"""A rollout batch on the engines: throughput and speedup by concurrency and k, and the batch draining.

Acceptance is per draft position (a_1, a_2, ...: the chance draft i is accepted once drafts 1..i-1 were), so k
drafts yield L(k) = 1 + a_1 + a_1 a_2 + ... + a_1...a_k tokens per sequence-step (positions past the list reuse its
last value). Speedup at batch B = (L(k) / T(B, k)) / (1 / T(B, 0)). The best k per batch is the argmax, as the
service's controller (speculation/k_controller.py) picks it per step.

An RL rollout batch is not served at one batch size: all its sequences start together and the batch drains as they
finish, down to the long tail's last few (output lengths here: a log-normal with a cap, evaluated at evenly spaced
quantiles, so runs are deterministic). `drain` walks that: between two sequences finishing, the batch is constant.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from rollout_service.perfmodel.hardware import Hardware
from rollout_service.perfmodel.model import Transformer
from rollout_service.perfmodel.step import Drafter, forward, spec_step


def mean_length(acceptance: list[float], k: int) -> float:
    """L(k) = 1 + a_1 + a_1 a_2 + ...; positions beyond the list reuse its last value."""
    total, prod = 1.0, 1.0
    for i in range(k):
        prod *= acceptance[min(i, len(acceptance) - 1)] if acceptance else 0.0
        total += prod
    return total


@dataclass
class Engine:
    """One engine serving `policy` with `drafter` on tp devices of `hw` (a MoE policy: max(tp, ep), step.py)."""
    policy: Transformer
    hw: Hardware
    drafter: Drafter | None = None
    acceptance: list[float] = field(default_factory=list)
    tp: int = 1
    ep: int = 1

    def step(self, batch: int, k: int, context: float) -> float:
        return spec_step(self.policy, self.drafter, self.hw, batch, k, context, self.tp, self.ep)

    def rate(self, batch: int, k: int, context: float) -> float:
        """Tokens per second of the engine at `batch` sequences drafting k."""
        return batch * mean_length(self.acceptance, k) / self.step(batch, k, context)

    def speedup(self, batch: int, k: int, context: float) -> float:
        return self.rate(batch, k, context) / self.rate(batch, 0, context)

    def best_k(self, batch: int, context: float, k_max: int) -> int:
        if self.drafter is None:
            return 0
        return max(range(k_max + 1), key=lambda k: self.rate(batch, k, context))

    def bound(self, batch: int, context: float) -> str:
        return forward(self.policy, self.hw, batch, 1, context, self.tp, ep=self.ep).bound


def lognormal_lengths(n: int, mean: float, sigma: float, cap: int) -> list[int]:
    """n output lengths: the log-normal with this mean and sigma at quantiles (i + 0.5) / n, capped at `cap`
    (the long tail: with sigma 1, the longest 1% are ~5x the median)."""
    from statistics import NormalDist

    if sigma <= 0:
        return [min(cap, max(1, round(mean)))] * n
    mu = math.log(mean) - sigma ** 2 / 2
    z = NormalDist()
    return [min(cap, max(1, round(math.exp(mu + sigma * z.inv_cdf((i + 0.5) / n))))) for i in range(n)]


@dataclass
class Drain:
    seconds: float
    tokens: int
    steps: int
    k_steps: dict          # k -> engine steps run at that k

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def drain(eng: Engine, lengths: list[int], prompt_len: int, concurrency: int, k: int | str,
          k_max: int = 7, max_chunk: int = 256) -> Drain:
    """One engine generates every sequence of `lengths` with at most `concurrency` in flight (a finished one is
    replaced by the next waiting one). k: a fixed k, or "auto" (the best k for each batch size and context).
    Prefill of each admitted group is one forward over its prompts. Expected-value walk: every sequence gains
    L(k) tokens per step."""
    waiting = list(lengths)[::-1]
    active: list[list[float]] = []        # [remaining tokens, context]
    t, steps, k_steps = 0.0, 0, {}
    while waiting or active:
        new = []
        while waiting and len(active) < concurrency:
            new.append([float(waiting.pop()), float(prompt_len)])
        if new:
            t += forward(eng.policy, eng.hw, len(new), prompt_len, prompt_len / 2, eng.tp, ep=eng.ep).seconds
            active += new
        b = len(active)
        ctx = sum(a[1] for a in active) / b
        kk = eng.best_k(b, ctx, k_max) if k == "auto" else int(k)
        ln = mean_length(eng.acceptance, kk)
        n = max(1, min(math.ceil(min(a[0] for a in active) / ln), math.ceil(max_chunk / ln)))
        t += n * eng.step(b, kk, ctx + n * ln / 2)
        steps += n
        k_steps[kk] = k_steps.get(kk, 0) + n
        for a in active:
            a[0] -= n * ln
            a[1] += n * ln
        active = [a for a in active if a[0] > 1e-9]
    return Drain(t, sum(lengths), steps, k_steps)


def steady_context(lengths: list[int], prompt_len: int) -> float:
    """Token-weighted mean context while generating: prompt + E[n^2] / (2 E[n])."""
    return prompt_len + sum(x * x for x in lengths) / (2 * sum(lengths))
