"""Mixture of experts: which experts a step reads, how expert parallelism spreads them over devices, and what the
all-to-all between attention and experts costs.

    distinct(E, k, T)     experts that some of T tokens route to, each token to k of E (uniform routing):
                          E (1 - (1 - k/E)^T)        one token: k;  T -> infinity: E
                          T = B (k_spec + 1) under speculation: a verify pass over 4 tokens at one sequence reads
                          ~3.6x the experts of a plain step (Qwen3: E 128, top-8), so speculation gains less on an
                          MoE policy until the batch alone reads every expert
    expert parallelism    G devices hold ceil(E / G) experts each; the step waits for the busiest device: the expected
                          maximum over G devices of Binomial(ceil(E/G), 1 - (1 - k/E)^T) experts read and of
                          Binomial(T k, ceil(E/G) / E) token rows computed (routing uniform and independent; no
                          redundant experts, no load balancer)
    all-to-all            where attention is data-parallel (G = EP devices > TP), every MoE layer dispatches each token
                          to the devices of its k experts and combines their outputs back: per device
                          (T / G) x fanout x hidden x 2 bytes each way, fanout = (G - 1)(1 - (1 - 1/G)^k) other
                          devices, over A2A_EFFICIENCY of the NVLink bandwidth per direction (the NIC beyond the NVLink
                          domain), plus a latency per collective. Where EP = TP (vLLM's --enable-expert-parallel
                          without data parallelism) the layer's all-reduce combines the experts' outputs instead.
Assumptions (not measured here; sources):
    A2A_EFFICIENCY 0.95     DeepEP's intranode kernels reach 153 / 158 GB/s (dispatch / combine) of an H800's ~160 GB/s
                            NVLink at EP 8 (github.com/deepseek-ai/DeepEP, README performance table)
    A2A_LATENCY_S 20 us     per NVLink collective: above an NVLink all-reduce's ~5 us (hardware.GPU_ASSUMPTIONS), as a
                            dispatch also sorts tokens by expert; below DeepEP's low-latency RDMA kernels
    RDMA_LATENCY_S 100 us   per collective leaving the NVLink domain: DeepEP's low-latency kernels over 400 Gb/s RDMA,
                            dispatch 77 us / combine 114 us at EP 8, 173 / 314 us at EP 64 (same README)
    activations bf16 both ways (DeepEP dispatches FP8: this overstates dispatch bytes by 2x)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist

A2A_EFFICIENCY = 0.95
A2A_LATENCY_S = 20e-6
RDMA_LATENCY_S = 100e-6
ACT_BYTES = 2.0


def hit_probability(experts: int, top_k: int, tokens: float) -> float:
    """The chance that a given expert is routed to by at least one of `tokens` tokens."""
    if experts <= 0 or top_k <= 0 or tokens <= 0:
        return 0.0
    return 1.0 - (1.0 - min(top_k, experts) / experts) ** tokens


def distinct_experts(experts: int, top_k: int, tokens: float) -> float:
    """Expected number of experts that some of `tokens` tokens route to: E (1 - (1 - k/E)^T)."""
    return experts * hit_probability(experts, top_k, tokens)


@lru_cache(maxsize=256)
def normal_max(groups: int) -> float:
    """Expected maximum of `groups` independent standard normals (0 for one)."""
    if groups <= 1:
        return 0.0
    z, steps, lo, hi = NormalDist(), 2000, -8.0, 8.0
    dx = (hi - lo) / steps
    return sum(x * groups * z.pdf(x) * z.cdf(x) ** (groups - 1) * dx
               for x in (lo + (i + 0.5) * dx for i in range(steps)))


@lru_cache(maxsize=65536)
def expected_max_binomial(n: int, p: float, groups: int) -> float:
    """Expected maximum over `groups` independent Binomial(n, p) counts (exact by the CDF for small n p (1 - p),
    else mean + sd x the expected maximum of `groups` standard normals, capped at n)."""
    if groups <= 1 or n <= 0 or p <= 0.0 or p >= 1.0:
        return n * min(max(p, 0.0), 1.0)
    var = n * p * (1 - p)
    if var > 30:
        return min(float(n), n * p + math.sqrt(var) * normal_max(groups))
    pmf, cdf, total = (1 - p) ** n, 0.0, 0.0
    for m in range(n):                       # E[max] = sum over m >= 0 of P(max > m) = 1 - F(m)^groups
        cdf += pmf
        total += 1.0 - min(1.0, cdf) ** groups
        pmf *= (n - m) / (m + 1) * p / (1 - p)
    return total


def experts_per_device(experts: int, ep: int) -> int:
    return math.ceil(experts / max(1, ep))


@dataclass(frozen=True)
class DeviceLoad:
    """What the busiest of `ep` devices does in one MoE layer for `tokens` tokens."""
    experts_read: float      # distinct local experts some token routed to
    rows: float              # token x expert rows through its local experts' GEMMs


def busiest_device(experts: int, top_k: int, tokens: float, ep: int) -> DeviceLoad:
    """ep = 1: the whole layer (distinct experts, T k rows); ep > 1: the expected busiest device."""
    local = experts_per_device(experts, ep)
    p = hit_probability(experts, top_k, tokens)
    rows_total = tokens * min(top_k, experts)
    if ep <= 1:
        return DeviceLoad(experts * p, rows_total)
    n_rows = int(round(rows_total))
    return DeviceLoad(expected_max_binomial(local, round(p, 12), ep),
                      expected_max_binomial(n_rows, round(local / experts, 12), ep) if n_rows else 0.0)


def fanout(top_k: int, ep: int) -> float:
    """Expected number of other devices a token's top_k experts live on (experts placed independently)."""
    if ep <= 1:
        return 0.0
    return (ep - 1) * (1 - (1 - 1 / ep) ** top_k)


def all_to_all_seconds(hidden: int, top_k: int, moe_layers: int, tokens: float, ep: int, link_bw: float,
                       nic_bw: float, nvlink_domain: int) -> float:
    """Dispatch + combine of every MoE layer for `tokens` tokens spread over `ep` devices (attention data-parallel)."""
    if ep <= 1 or moe_layers <= 0:
        return 0.0
    inside = ep <= nvlink_domain
    bw = (link_bw if inside else nic_bw) * A2A_EFFICIENCY
    latency = A2A_LATENCY_S if inside else RDMA_LATENCY_S
    per_way = tokens / ep * fanout(top_k, ep) * hidden * ACT_BYTES
    return moe_layers * 2 * (per_way / bw + latency)
