"""One engine step on one engine (tp devices): roofline time of a plain or a speculative decoding step.

    forward(w tokens per sequence, batch B, context n) = max(bytes / bandwidth, FLOPs / peak) + all-reduces + overhead
        bytes = weights read (MoE: the experts B w tokens route to) + KV cache read (B n) + KV written (B w)
        FLOPs = 2 x active weights x B w + attention (4 x layers x heads x head_dim x n per query token)
    spec_step(k)  = forward(k + 1) [verify]  +  k drafter steps  (+ a calibrated per-step cost, CPU only)
A verify step reads the weights and the KV cache once for all k + 1 tokens: it costs about one plain step while
B (k + 1) tokens stay below the ridge (hw.ridge() FLOPs per byte), and about k + 1 plain steps well above it.
"""
from __future__ import annotations

from dataclasses import dataclass

from rollout_service.perfmodel.hardware import Hardware
from rollout_service.perfmodel.model import Transformer


@dataclass(frozen=True)
class StepTime:
    seconds: float
    memory_s: float
    compute_s: float
    comm_s: float
    overhead_s: float

    @property
    def bound(self) -> str:
        return "memory" if self.memory_s >= self.compute_s else "compute"


def forward(m: Transformer, hw: Hardware, batch: int, width: int, context: float, tp: int = 1,
            overhead_s: float | None = None) -> StepTime:
    """One forward of `batch` sequences, `width` new tokens each, over `context` cached tokens each, sharded
    over `tp` devices (weights, KV heads and FLOPs split evenly; two all-reduces of the activations per layer)."""
    tokens = batch * width
    bytes_ = (m.weight_bytes_read(tokens, hw.bytes_per_param)
              + m.kv_bytes_per_token() * batch * (context + width)) / tp
    flops = m.flops(tokens, context + width / 2) / tp
    memory_s = bytes_ / (hw.mem_bw * hw.mem_eff)
    compute_s = flops / (hw.flops * hw.flop_eff)
    comm_s = 0.0
    if tp > 1:                                # ring all-reduce: 2 (tp - 1) / tp of the bytes over each link
        per = 2 * (tp - 1) / tp * tokens * m.hidden * 2 / hw.link_bw + hw.allreduce_latency_s
        comm_s = 2 * m.layers * per
    over = hw.overhead_s if overhead_s is None else overhead_s
    return StepTime(max(memory_s, compute_s) + comm_s + over, memory_s, compute_s, comm_s, over)


@dataclass(frozen=True)
class Drafter:
    """How drafts are made: method ("eagle3", "draft_model", "ngram") and, for model drafters, the model."""
    method: str
    model: Transformer | None = None
    k0_steps: int = 0     # drafter steps run even at k = 0 (vLLM keeps an EAGLE-3 head's KV cache in sync)


def draft_step(d: Drafter, hw: Hardware, batch: int, context: float, tp: int = 1) -> float:
    """Seconds of one drafter step (one token per sequence)."""
    if d.method in hw.draft_steps:                       # calibrated (CPU): fixed + per sequence
        fixed, per_seq = hw.draft_steps[d.method]
        return fixed + per_seq * batch
    if d.model is None:                                  # n-gram: a host-side lookup
        return hw.draft_overhead_s
    return forward(d.model, hw, batch, 1, context, tp, overhead_s=hw.draft_overhead_s).seconds


def spec_step(m: Transformer, d: Drafter | None, hw: Hardware, batch: int, k: int, context: float,
              tp: int = 1) -> float:
    """Seconds of one engine step drafting and verifying k tokens per sequence (k = 0: a plain step)."""
    if k == 0 or d is None:
        plain = forward(m, hw, batch, 1, context, tp).seconds
        if d is not None and d.method in hw.k0_overhead:          # calibrated (CPU): measured at k = 0
            return plain * (1 + hw.k0_overhead[d.method])
        return plain + (d.k0_steps * draft_step(d, hw, batch, context, tp) if d is not None else 0.0)
    return (forward(m, hw, batch, k + 1, context, tp).seconds + k * draft_step(d, hw, batch, context, tp)
            + hw.spec_overhead_s)
