"""Hardware profiles: what one device can move and compute per second, and what a step costs regardless.

Published peaks are the datasheets' (B200: to check the model against figures published for it). How a GPU's
step time follows from them (step.py) is a form fitted to measured
H200 steps (GPU_FIT below, the one place its constants live, with their source); what vLLM adds outside the GPU's
kernels is this model's assumption (GPU_ASSUMPTIONS). The CPU profile keeps the plain roofline
max(bytes / (mem_bw * mem_eff), FLOPs / (flops * flop_eff)) + overhead, every field fitted to a calibration file
(perf/calibrate_cpu.py). `from_probe` (perfmodel/fit.py) fits a profile to any GPU's perf/gpu_step_probe.py file.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path


@dataclass(frozen=True)
class StepFit:
    """How a GPU's decode step departs from the roofline (step.py): what was fitted to measured steps.

    layer_s          seconds per layer of every step beyond its bytes and FLOPs: the layer's kernels' launch and
                     tail latencies inside a CUDA graph (a small model pays it too: a 1-layer EAGLE-3 head once)
    verify_layer_s   seconds per layer more when a step has more than one new token per sequence (a verify step
                     runs other kernel variants: the small extra cost of a wider step at small batch)
    overlap          how much of the smaller of a GEMM's memory and compute time its larger one hides: 1 is the
                     sharp roofline max(m, c), 0 their sum; between, the corner is gradual as tiles and waves make it
    sampler_passes   passes over float32 logits (batch x width rows x vocabulary) that sampling makes at the
                     profile's bandwidth (softmax, the exponential race; vLLM's rejection sampler does the same)
    attn_cta_bw      bytes/s one attention CTA sweeps its (sequence, KV head)'s cache at, where such CTAs do not
                     fill the GPU (`sms` of them per wave): a kernel without split-KV, as PyTorch's SDPA; None where
                     decode attention splits the cache across the GPU (vLLM's FlashAttention/FlashInfer), so only
                     the bandwidth bounds it
    """
    layer_s: float
    verify_layer_s: float
    overlap: float
    sampler_passes: float
    attn_cta_bw: float | None = None
    sms: int = 0
    source: str = ""


@dataclass(frozen=True)
class Hardware:
    name: str
    mem_bw: float               # bytes/s of device memory, per device
    flops: float                # dense bf16 FLOP/s, per device
    mem_bytes: float            # device memory capacity (bytes)
    link_bw: float              # bytes/s per direction between devices of one engine (tensor parallel)
    push_bw: float              # bytes/s from the trainer to an engine (weight pushes)
    overhead_s: float           # fixed cost of one target step (scheduling, launches, sampling)
    draft_overhead_s: float     # fixed cost of one drafter step (a small model's launches)
    allreduce_latency_s: float  # per all-reduce, on top of bytes / link_bw
    mem_eff: float = 1.0        # achievable fraction of mem_bw
    flop_eff: float = 1.0       # achievable fraction of flops in decode-sized matmuls
    train_mfu: float = 0.35     # model FLOP utilisation of training (6 N FLOPs per token + 2 N to recompute)
    bytes_per_param: float = 2.0
    nvlink_domain: int = 8      # devices that reach each other at link_bw (an HGX board: 8; GB200 NVL72: 72); an
                                # expert-parallel all-to-all over more crosses the NIC (push_bw)
    # calibrated only (CPU): measured drafter step seconds by method, (fixed, per sequence), replacing the
    # roofline of the drafter; and what a speculative step costs beyond verifying and drafting.
    draft_steps: dict = field(default_factory=dict)
    spec_overhead_s: float = 0.0
    # calibrated only (CPU): what a step without drafts costs beyond a plain step, a fraction of it, by method
    # (an engine with a drafter configured, at k = 0), replacing Drafter.k0_steps' drafter steps
    k0_overhead: dict = field(default_factory=dict)
    # GPUs: the fitted step form (step.py); None: the plain roofline (the CPU profile, fitted by its calibration)
    fit: StepFit | None = None
    source: str = ""

    def ridge(self) -> float:
        """FLOPs per byte where a kernel turns compute-bound."""
        return self.flops * self.flop_eff / (self.mem_bw * self.mem_eff)


# The GPU step form's constants, fitted once to ../shared/reference/h200-steps.json (one NVIDIA H200, 2026-11-26:
# 80 decode steps of a Qwen3-8B shape at batch 1-256, width 1-5, context 512/2048, and 32 steps of an EAGLE-3 head
# and a Qwen3-0.6B draft model, each one CUDA-graph replay; method in ../shared/reference/README.md) by
# perfmodel/fit.py: `python -m rollout_service.perfmodel.fit ../shared/reference/h200-steps.json --datasheet h200`.
# Efficiencies are fractions of the datasheet peaks (4.8 TB/s, 989 TFLOP/s): decode GEMMs and attention read HBM
# at ~4.0 TB/s (the probe's copy: 4.26) and reach ~610 TFLOP/s (an 8192^3 matmul: 785). The per-layer costs are
# those of that plain PyTorch step (~24 kernels a layer); vLLM fuses more of a layer, so they are conservative for
# it. attn_cta_bw is not carried over: vLLM's decode attention splits the cache (StepFit.attn_cta_bw).
# perf/validate_perfmodel.py --gpu-reference checks the form against the file and held-out probe runs.
GPU_FIT = StepFit(layer_s=75.0e-6, verify_layer_s=11.8e-6, overlap=0.72, sampler_passes=12.9, attn_cta_bw=None,
                  source="fitted to ../shared/reference/h200-steps.json (NVIDIA H200, 2026-11-26)")
GPU_EFFICIENCY = {"mem_eff": 0.838, "flop_eff": 0.618}

# Assumptions for GPUs (not measured here): vLLM spends ~1 ms per decode step outside the GPU's kernels
# (scheduling, input preparation) and ~0.25 ms per drafter step; an NVLink all-reduce costs ~5 us before its
# bytes; training runs at 35% MFU. Until the fit these costs also stood for the kernels' launches and sampling
# (and GPUs for 80% of HBM bandwidth and 60% of peak FLOP/s with a sharp roofline); the fit prices those now.
GPU_ASSUMPTIONS = {"overhead_s": 1.0e-3, "draft_overhead_s": 0.25e-3, "allreduce_latency_s": 5e-6, "train_mfu": 0.35,
                   **GPU_EFFICIENCY, "fit": GPU_FIT}

H100_SXM = Hardware(
    name="h100",
    mem_bw=3.35e12,      # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: GPU memory bandwidth 3.35 TB/s
    flops=989e12,        # same datasheet: BF16 Tensor Core 1,979 TFLOPS *with sparsity*; dense = half, 989
    mem_bytes=80e9,      # same datasheet: 80 GB HBM3
    link_bw=450e9,       # same datasheet: NVLink 900 GB/s (bidirectional) -> 450 GB/s per direction
    push_bw=50e9,        # ConnectX-7 400 Gb/s InfiniBand per GPU (DGX H100 datasheet) = 50 GB/s
    source="NVIDIA H100 Tensor Core GPU datasheet (SXM column); DGX H100 datasheet (ConnectX-7)",
    **GPU_ASSUMPTIONS)

H200 = Hardware(
    name="h200",
    mem_bw=4.8e12,       # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: GPU memory bandwidth 4.8 TB/s
    flops=989e12,        # same datasheet: BF16 Tensor Core 1,979 TFLOPS *with sparsity*; dense = half, 989
    mem_bytes=141e9,     # same datasheet: 141 GB HBM3e
    link_bw=450e9,       # same datasheet: NVLink 900 GB/s (bidirectional) -> 450 GB/s per direction
    push_bw=50e9,        # ConnectX-7 400 Gb/s InfiniBand per GPU (HGX/DGX H200) = 50 GB/s
    source="NVIDIA H200 Tensor Core GPU datasheet (SXM column); ConnectX-7 (HGX H200)",
    **GPU_ASSUMPTIONS)

GB200 = Hardware(
    name="gb200",
    mem_bw=8e12,         # NVIDIA GB200 NVL72 datasheet: 576 TB/s HBM3e over 72 GPUs = 8 TB/s per GPU
    flops=2.5e15,        # same: FP16/BF16 Tensor Core 360 PFLOPS with sparsity over 72 GPUs: 5 -> 2.5 PF dense
    mem_bytes=186e9,     # same: 13.4 TB HBM3e over 72 GPUs
    link_bw=900e9,       # same: NVLink 5, 1.8 TB/s per GPU (bidirectional) -> 900 GB/s per direction
    push_bw=100e9,       # ConnectX-8 800 Gb/s per GPU (GB200 NVL72 compute tray) = 100 GB/s
    nvlink_domain=72,    # same: one NVLink domain of 72 GPUs (NVLink Switch)
    source="NVIDIA GB200 NVL72 datasheet (per-rack figures / 72 GPUs); ConnectX-8 SuperNIC",
    **GPU_ASSUMPTIONS)

B200 = Hardware(
    name="b200",
    mem_bw=8e12,         # NVIDIA HGX B200 datasheet: 64 TB/s HBM3e over 8 GPUs = 8 TB/s per GPU
    flops=2.25e15,       # same: FP16/BF16 Tensor Core 36 PFLOPS with sparsity over 8 GPUs: 4.5 -> 2.25 PF dense
    mem_bytes=180e9,     # same: 1,440 GB over 8 GPUs (DGX B200)
    link_bw=900e9,       # same: NVLink 5, 1.8 TB/s per GPU (bidirectional) -> 900 GB/s per direction
    push_bw=50e9,        # ConnectX-7 400 Gb/s per GPU (DGX B200) = 50 GB/s
    source="NVIDIA HGX B200 / DGX B200 datasheets (per-board figures / 8 GPUs); ConnectX-7; the GB200 NVL72 rack's "
           "GPU with 8 instead of 72 GPUs per NVLink domain",
    **GPU_ASSUMPTIONS)


def cpu_from_calibration(path: str | Path) -> Hardware:
    """This machine, with every field fitted by perf/calibrate_cpu.py and read from its JSON (`fit`)."""
    data = json.loads(Path(path).read_text())
    fit = data["fit"]
    return Hardware(
        name="cpu", mem_bw=fit["mem_bw"], flops=fit["flops"], mem_bytes=data.get("mem_bytes", 24 * 2**30),
        link_bw=1e12, push_bw=fit.get("push_bw", 2e9), overhead_s=fit["overhead_s"],
        draft_overhead_s=fit.get("draft_overhead_s", 0.0), allreduce_latency_s=0.0,
        draft_steps={m: tuple(v) for m, v in fit.get("draft_steps", {}).items()},
        spec_overhead_s=fit.get("spec_overhead_s", 0.0), k0_overhead=dict(fit.get("k0_overhead", {})),
        bytes_per_param=fit.get("bytes_per_param", 2.0),
        source=f"fitted to {path} ({data.get('date', '?')})")


def default_calibration() -> Path:
    return Path(__file__).resolve().parents[2] / "bench" / "results" / "cpu_calibration.json"


PROFILES = {"h100": H100_SXM, "h200": H200, "b200": B200, "gb200": GB200}


def get(name: str, calibration: str | Path | None = None) -> Hardware:
    if name == "cpu":
        path = Path(calibration) if calibration else default_calibration()
        if not path.exists():
            raise SystemExit(f"the cpu profile is fitted to {path}, which does not exist; run "
                             "perf/calibrate_cpu.py first (or pass --calibration)")
        return cpu_from_calibration(path)
    if name not in PROFILES:
        raise SystemExit(f"unknown hardware {name!r}: choose cpu, {', '.join(PROFILES)}")
    return PROFILES[name]


__all__ = ["B200", "GB200", "GPU_FIT", "H100_SXM", "H200", "PROFILES", "Hardware", "StepFit", "cpu_from_calibration",
           "get", "replace"]
