"""One engine step on one engine (tp devices): the time of a plain or a speculative decoding step.

forward(w tokens per sequence, batch B, context n), t = B w tokens, on a GPU (hw.fit, fitted to measured H200
steps: hardware.GPU_FIT):
    GEMMs      m = weight bytes read / (mem_bw mem_eff)   (MoE: the experts t tokens route to; moe.py)
               c = 2 x active weights x t / (flops flop_eff)
               gemm = max(m, c) + (1 - overlap) min(m, c)            a gradual corner, not the sharp max(m, c)
    attention  max(KV bytes B (n + w) / (mem_bw mem_eff), attention FLOPs / (flops flop_eff)
                   [, waves of B x KV heads CTAs each sweeping its n + w keys at attn_cta_bw])
    step       = gemm + attention + all-reduces + all-to-alls + overhead + layers x (layer_s + verify_layer_s if w > 1)
    engine step adds sampling: B w rows x vocabulary x 4 bytes x sampler_passes / (mem_bw mem_eff)
On the CPU (hw.fit None: the calibrated profile) it is the roofline
    max((weight bytes + KV bytes) / bandwidth, (GEMM + attention FLOPs) / peak) + all-reduces + overhead.
    spec_step(k)  = forward(k + 1) [verify]  +  k drafter steps  (+ a calibrated per-step cost, CPU only)
A verify step reads the weights and the KV cache once for all k + 1 tokens: it costs about one plain step while
B (k + 1) tokens are few, and about k + 1 plain steps once the GEMMs are compute-bound; on a GPU the cost rises
gradually from about 64 tokens per step, not at a sharp ridge (hw.ridge() FLOPs per byte).
Parallelism: an engine is max(tp, ep) devices. tp splits attention, dense weights, KV heads and FLOPs (two
all-reduces of the activations per layer); ep > tp spreads a MoE model's experts over ep devices with attention
data-parallel over ep / tp groups of tp (each group serves batch / groups sequences): every device reads its tp share
of the dense weights and its local experts' (the busiest device's, moe.busiest_device), and each MoE layer adds an
all-to-all dispatch and combine. ep = tp > 1 (experts spread over the tensor-parallel devices) is priced as tp.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from rollout_service.perfmodel.hardware import Hardware
from rollout_service.perfmodel.model import Transformer
from rollout_service.perfmodel.moe import all_to_all_seconds, busiest_device


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
            overhead_s: float | None = None, ep: int = 1) -> StepTime:
    """One forward of `batch` sequences, `width` new tokens each, over `context` cached tokens each, sharded
    over `tp` devices (weights, KV heads and FLOPs split evenly; two all-reduces of the activations per layer), or
    for a MoE model with ep > tp over ep devices (experts by expert parallelism, attention data-parallel)."""
    tokens = batch * width
    bw, peak = hw.mem_bw * hw.mem_eff, hw.flops * hw.flop_eff
    dev, groups = devices(tp, ep, m), data_groups(tp, ep, m)
    if groups == 1:
        weight_bytes = m.weight_bytes_read(tokens, hw.bytes_per_param) / tp
        gemm_flops = 2 * m.active_params() * tokens / tp
    else:                                     # the busiest device of the expert-parallel group
        load = busiest_device(m.experts, m.experts_per_tok, tokens, ep)
        weight_bytes = (m.always_read_params() / tp + m.moe_layers() * load.experts_read * m.expert_params()) \
            * hw.bytes_per_param
        gemm_flops = 2 * (m.always_read_params() * tokens / dev + m.moe_layers() * load.rows * m.expert_params())
    kv_bytes = m.kv_bytes_per_token() * batch * (context + width) / (m.kv_shards(tp) * groups)
    attn_flops = tokens * m.layers * m.attn_flops_per_key() * (context + width / 2) / dev
    memory_s = (weight_bytes + kv_bytes) / bw
    compute_s = (gemm_flops + attn_flops) / peak
    comm_s = 0.0
    if tp > 1:                                # ring all-reduce: 2 (tp - 1) / tp of the bytes over each link
        per = 2 * (tp - 1) / tp * tokens / groups * m.hidden * 2 / hw.link_bw + hw.allreduce_latency_s
        comm_s = 2 * m.layers * per
    if groups > 1:
        comm_s += all_to_all_seconds(m.hidden, m.experts_per_tok, m.moe_layers(), tokens, ep, hw.link_bw,
                                     hw.push_bw, hw.nvlink_domain)
    over = hw.overhead_s if overhead_s is None else overhead_s
    f = hw.fit
    if f is None:                             # the plain roofline (the CPU profile's calibrated form)
        return StepTime(max(memory_s, compute_s) + comm_s + over, memory_s, compute_s, comm_s, over)
    m_s, c_s = weight_bytes / bw, gemm_flops / peak
    gemm = max(m_s, c_s) + (1 - f.overlap) * min(m_s, c_s)
    attn = max(kv_bytes / bw, attn_flops / peak)
    if f.attn_cta_bw and f.sms:               # no split-KV: one CTA per (sequence, KV head, 128 query rows)
        kv_heads = math.ceil(m.kv_heads / tp)
        ctas = math.ceil(batch / groups) * kv_heads * math.ceil(m.heads // m.kv_heads * width / ATTN_TILE_ROWS)
        sweep = m.layers * (context + width) * m.head_dim * 2 * 2 / f.attn_cta_bw    # K and V, bf16
        attn = max(attn, math.ceil(ctas / f.sms) * sweep)
    over += m.layers * (f.layer_s + (f.verify_layer_s if width > 1 else 0.0))
    return StepTime(gemm + attn + comm_s + over, memory_s, compute_s, comm_s, over)


def devices(tp: int, ep: int, m: Transformer | None = None) -> int:
    """Devices of one engine: tp, or ep where a MoE model's experts spread over more devices than tp."""
    return max(tp, ep) if (m is None or m.experts) else tp


def device_weight_bytes(m: Transformer, bytes_per_param: float, tp: int = 1, ep: int = 1) -> float:
    """Weights one device of the engine holds: all / tp; with ep > tp, the dense ones / tp and its experts."""
    if data_groups(tp, ep, m) == 1:
        return m.params() * bytes_per_param / tp
    experts = m.total_expert_params()
    return ((m.params() - experts) / tp + experts / ep) * bytes_per_param


def data_groups(tp: int, ep: int, m: Transformer | None = None) -> int:
    """Attention replicas of one engine (data parallel): ep / tp where ep > tp, else 1."""
    d = devices(tp, ep, m)
    if d % tp:
        raise SystemExit(f"expert parallelism over {ep} devices needs a multiple of tp {tp}")
    return d // tp


ATTN_TILE_ROWS = 128       # query rows of one attention tile (FlashAttention's block for head_dim 128)


def sample_seconds(m: Transformer, hw: Hardware, rows: int, tp: int = 1) -> float:
    """Sampling `rows` rows of float32 logits over the vocabulary (GPU profiles; the CPU calibration's steps
    include their sampling)."""
    if hw.fit is None:
        return 0.0
    return rows * m.vocab * 4 * hw.fit.sampler_passes / (tp * hw.mem_bw * hw.mem_eff)


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
              tp: int = 1, ep: int = 1) -> float:
    """Seconds of one engine step drafting and verifying k tokens per sequence (k = 0: a plain step). With
    attention data-parallel (ep > tp) each of its groups samples and drafts for its own share of the batch."""
    dev, groups = devices(tp, ep, m), data_groups(tp, ep, m)
    per_group = math.ceil(batch / groups)
    if k == 0 or d is None:
        plain = forward(m, hw, batch, 1, context, tp, ep=ep).seconds + sample_seconds(m, hw, batch, dev)
        if d is not None and d.method in hw.k0_overhead:          # calibrated (CPU): measured at k = 0
            return plain * (1 + hw.k0_overhead[d.method])
        return plain + (d.k0_steps * draft_step(d, hw, per_group, context, tp) if d is not None else 0.0)
    return (forward(m, hw, batch, k + 1, context, tp, ep=ep).seconds
            + sample_seconds(m, hw, batch * (k + 1), dev)
            + k * draft_step(d, hw, per_group, context, tp) + hw.spec_overhead_s)


def step_table(policy: Transformer, hw: Hardware, cells, drafter: Drafter | None = None, tp: int = 1,
               ep: int = 1) -> dict:
    """Single step times, `rollout-service simulate --step-table`'s answer and what perf/validate_perfmodel.py
    compares with measured steps: {"steps": [{batch, width, context, seconds[, draft_seconds]}]} for each
    (batch, width, context) of `cells`; seconds: one forward (its overhead included; sampling and drafting not),
    draft_seconds: one drafter step at that batch and context."""
    rows = []
    for b, w, n in cells:
        row = {"batch": b, "width": w, "context": n, "seconds": forward(policy, hw, b, w, n, tp, ep=ep).seconds}
        if drafter is not None:
            row["draft_seconds"] = draft_step(drafter, hw, math.ceil(b / data_groups(tp, ep, policy)), n, tp)
        rows.append(row)
    return {"steps": rows}
