"""vLLM's CPU LoRA ops apply an adapter to rows that have none.

The PyTorch-native punica ops CPUs use (vllm/lora/ops/torch_ops/lora_ops.py: bgmv_shrink, bgmv_expand,
bgmv_expand_slice, and the sgmv_* prefill ops built on them) select each row's adapter as
`lora_weights[lora_indices]`, and a row without an adapter has index -1: Python indexing takes the last LoRA slot
(max_loras - 1). Whenever that slot holds an adapter, every base-policy request in the batch runs on it: with
max_loras 1, a base request batched with any adapter request samples the adapter's policy (found by verify-lossless
with an adapter: the base samples in its batches matched the adapter merged, 0.0 nats, and the base 1-3 nats away).
The GPU kernels skip rows of index -1. Here each op is wrapped so rows of index -1 keep the output they had, as on
GPU. vLLM's punica_cpu imported the ops by name, so its names are replaced too; the sgmv ops call the bgmv ones
through lora_ops' globals.
"""
from __future__ import annotations

import functools

OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")


def keep_rows_without_adapter(op):
    """`op(inputs, weights, output, indices, ...)` with rows whose index is negative left as they were."""
    if getattr(op, "rollout_masked", False):
        return op

    @functools.wraps(op)
    def masked(inputs, weights, output, indices, *args, **kwargs):
        none = indices < 0
        if not bool(none.any()):
            return op(inputs, weights, output, indices, *args, **kwargs)
        rows = none.nonzero().squeeze(1)
        if output.shape[0] != indices.shape[0]:          # vLLM's broadcasting cases: leave them to it
            return op(inputs, weights, output, indices, *args, **kwargs)
        kept = output.index_select(0, rows)
        result = op(inputs, weights, output, indices, *args, **kwargs)
        output.index_copy_(0, rows, kept)
        return result

    masked.rollout_masked = True
    return masked


def install() -> bool:
    from vllm.lora.ops import torch_ops
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for name in OPS:
        fixed = keep_rows_without_adapter(getattr(lora_ops, name))
        for module in (lora_ops, torch_ops, punica_cpu):
            if hasattr(module, name):
                setattr(module, name, fixed)
    return True
