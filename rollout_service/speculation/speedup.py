"""What speculation can gain: the analytical speedup bound (Leviathan et al., 2023), in one place for the
status report and the benchmark.

A drafter proposes k tokens per step; each is accepted with probability a given that the ones before it
were (a: the per-token acceptance). A step then emits on average L = (1 - a^(k+1)) / (1 - a) tokens (the
mean acceptance length, counting the token the target adds) and costs 1 + c k target steps, where c is one
drafter step over one target step. The speedup is at most L / (1 + c k), reached when a verify step costs
what a plain decoding step does.

vLLM's acceptance rate (accepted / drafted) is not a when k > 1: later draft positions are only reached
after every earlier one was accepted, so it averages a, a^2, ... a^k. Put into the formula it understates L
and the bound; a is solved from the measured L instead.
"""
from __future__ import annotations


def mean_acceptance_length(a: float, k: int) -> float:
    """L = 1 + a + a^2 + ... + a^k: tokens per verify step at per-token acceptance a with k drafts."""
    return sum(a ** i for i in range(k + 1))


def measured_mean_acceptance_length(accepted: int, steps: int) -> float:
    """L as measured: 1 + accepted drafts / verify steps (1.0 before any step). The one definition the service
    reports: it holds however k varied from step to step (the controller chooses k per step), where
    1 + k x acceptance rate would need one k for every step."""
    return 1.0 + accepted / steps if steps else 1.0


def per_token_acceptance(mean_len: float, k: int) -> float:
    """The a in [0, 1] whose mean_acceptance_length(a, k) is `mean_len` (clamped to [1, k + 1])."""
    if mean_len <= 1.0:
        return 0.0
    if mean_len >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):                  # L is increasing in a: bisection to ~1e-18
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_acceptance_length(mid, k) < mean_len else (lo, mid)
    return (lo + hi) / 2


def expected_speedup(mean_len: float, k: int, c: float) -> float:
    """L / (1 + c k): the speedup at a measured mean acceptance length L and drafter cost c."""
    return mean_len / (1 + c * k)


def speedup_bound(a: float, k: int, c: float) -> float:
    """(1 - a^(k+1)) / ((1 - a)(1 + c k)): the speedup at per-token acceptance a and drafter cost c."""
    return expected_speedup(mean_acceptance_length(a, k), k, c)


def step_cost(mean_len: float, plain_tok_s: float, spec_tok_s: float) -> float:
    """A speculative step's measured time over a plain decoding step's: L tokens per step at spec_tok_s
    against one per step at plain_tok_s. The bound assumes 1 + c k; what it is above that is what drafting
    and verifying cost in the engine beyond the drafter's own forward passes."""
    return mean_len * plain_tok_s / spec_tok_s
