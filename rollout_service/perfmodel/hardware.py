"""Hardware profiles: what one device can move and compute per second, and what a step costs regardless.

A step's time is max(bytes / (mem_bw * mem_eff), FLOPs / (flops * flop_eff)) + communication + overhead
(step.py). Published peaks are the datasheets'; the efficiencies and overheads are this model's assumptions,
stated once here, and the CPU profile's fields are fitted to a calibration file (bench/calibrate_cpu.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path


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
    # calibrated only (CPU): measured drafter step seconds by method, (fixed, per sequence), replacing the
    # roofline of the drafter; and what a speculative step costs beyond verifying and drafting.
    draft_steps: dict = field(default_factory=dict)
    spec_overhead_s: float = 0.0
    # calibrated only (CPU): what a step without drafts costs beyond a plain step, a fraction of it, by method
    # (an engine with a drafter configured, at k = 0), replacing Drafter.k0_steps' drafter steps
    k0_overhead: dict = field(default_factory=dict)
    source: str = ""

    def ridge(self) -> float:
        """FLOPs per byte where a kernel turns compute-bound."""
        return self.flops * self.flop_eff / (self.mem_bw * self.mem_eff)


# Assumptions for GPUs (not datasheet figures): vLLM with CUDA graphs spends ~1 ms per decode step outside the
# model (scheduling, sampling, launches) and ~0.25 ms per EAGLE-3 head step; decode matmuls reach ~80% of HBM
# bandwidth and ~60% of peak FLOP/s; an NVLink all-reduce costs ~5 us before its bytes.
GPU_ASSUMPTIONS = {"overhead_s": 1.0e-3, "draft_overhead_s": 0.25e-3, "allreduce_latency_s": 5e-6, "mem_eff": 0.8,
                   "flop_eff": 0.6, "train_mfu": 0.35}

H100_SXM = Hardware(
    name="h100",
    mem_bw=3.35e12,      # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: GPU memory bandwidth 3.35 TB/s
    flops=989e12,        # same datasheet: BF16 Tensor Core 1,979 TFLOPS *with sparsity*; dense = half, 989
    mem_bytes=80e9,      # same datasheet: 80 GB HBM3
    link_bw=450e9,       # same datasheet: NVLink 900 GB/s (bidirectional) -> 450 GB/s per direction
    push_bw=50e9,        # ConnectX-7 400 Gb/s InfiniBand per GPU (DGX H100 datasheet) = 50 GB/s
    source="NVIDIA H100 Tensor Core GPU datasheet (SXM column); DGX H100 datasheet (ConnectX-7)",
    **GPU_ASSUMPTIONS)

GB200 = Hardware(
    name="gb200",
    mem_bw=8e12,         # NVIDIA GB200 NVL72 datasheet: 576 TB/s HBM3e over 72 GPUs = 8 TB/s per GPU
    flops=2.5e15,        # same: FP16/BF16 Tensor Core 360 PFLOPS with sparsity over 72 GPUs: 5 -> 2.5 PF dense
    mem_bytes=186e9,     # same: 13.4 TB HBM3e over 72 GPUs
    link_bw=900e9,       # same: NVLink 5, 1.8 TB/s per GPU (bidirectional) -> 900 GB/s per direction
    push_bw=100e9,       # ConnectX-8 800 Gb/s per GPU (GB200 NVL72 compute tray) = 100 GB/s
    source="NVIDIA GB200 NVL72 datasheet (per-rack figures / 72 GPUs); ConnectX-8 SuperNIC",
    **GPU_ASSUMPTIONS)


def cpu_from_calibration(path: str | Path) -> Hardware:
    """This machine, with every field fitted by bench/calibrate_cpu.py and read from its JSON (`fit`)."""
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


PROFILES = {"h100": H100_SXM, "gb200": GB200}


def get(name: str, calibration: str | Path | None = None) -> Hardware:
    if name == "cpu":
        path = Path(calibration) if calibration else default_calibration()
        if not path.exists():
            raise SystemExit(f"the cpu profile is fitted to {path}, which does not exist; run "
                             "bench/calibrate_cpu.py first (or pass --calibration)")
        return cpu_from_calibration(path)
    if name not in PROFILES:
        raise SystemExit(f"unknown hardware {name!r}: choose cpu, {', '.join(PROFILES)}")
    return PROFILES[name]


__all__ = ["GB200", "H100_SXM", "PROFILES", "Hardware", "cpu_from_calibration", "get", "replace"]
