"""A GPU profile fitted to measured decode steps: a perf/gpu_step_probe.py file (or the shared reference,
../shared/reference/h200-steps.json, which has the same form).

    python -m rollout_service.perfmodel.fit FILE [--datasheet h200]     # print the fitted constants
    rollout-service simulate --hardware-from FILE ...                   # project with them

What is fitted (step.py's form, hardware.StepFit): mem_eff and flop_eff (against the file's own copy and matmul
rates, or a datasheet profile's peaks with --datasheet), the fixed and per-layer costs of a step, the extra
per-layer cost of a step wider than one token, the GEMMs' overlap, the per-CTA attention sweep rate, and the
sampler's passes. Seven numbers for the steps, one for the sampler; least squares on, at once, every width's step
over the width-1 step at its batch and context, every drafter step over the target's width-1 step, and half-weighted
each step's own relative error. A drafter step is one replay like a target step: draft_overhead_s = overhead_s.
"""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from rollout_service.perfmodel import hardware
from rollout_service.perfmodel import model as pm
from rollout_service.perfmodel.step import Drafter, step_table

# the shapes a probe file names (kind -> a shipped config); others: a shipped config of that name, or the
# file's target_shape
KIND_CONFIGS = {"qwen3-8b": "qwen3-8b", "eagle3-head": "qwen3-8b-eagle3", "qwen3-0.6b": "qwen3-0.6b",
                "qwen3-30b-a3b": "qwen3-30b-a3b"}


@dataclass(frozen=True)
class Cell:
    kind: str
    model: pm.Transformer
    drafter: bool
    batch: int
    width: int
    context: int
    seconds: float


@dataclass
class Probe:
    path: str
    env: dict
    cells: list           # target steps
    drafters: list        # drafter steps (width 1)
    sampler: list         # {"batch", "width", "vocab", "seconds"}
    date: str = ""

    @property
    def gpu(self) -> str:
        return self.env.get("gpu", "gpu")


def transformer_for(kind: str, data: dict) -> pm.Transformer:
    name = KIND_CONFIGS.get(kind, kind)
    if (pm.CONFIGS / f"{name}.json").exists():
        return pm.load(name)
    s = data.get("target_shape") or {}
    if s.get("kind") != kind:
        raise SystemExit(f"{kind}: no shipped config of that name (perfmodel/configs) and no target_shape for it")
    return pm.Transformer(name=kind, layers=s["layers"], hidden=s["hidden"], heads=s["heads"],
                          kv_heads=s["kv_heads"], head_dim=s["head_dim"], intermediate=s["mlp"], vocab=s["vocab"],
                          experts=s.get("experts", 0), experts_per_tok=s.get("experts_per_tok", 0),
                          expert_intermediate=s.get("expert_intermediate", 0))     # perf/moe_step_probe.py


def read(path: str | Path) -> Probe:
    data = json.loads(Path(path).read_text())
    models: dict = {}

    def cells(rows, drafter):
        out = []
        for c in rows:
            if c["kind"] not in models:
                models[c["kind"]] = transformer_for(c["kind"], data)
            out.append(Cell(c["kind"], models[c["kind"]], drafter, c["batch"], c["width"], c["context"],
                            c["seconds"]))
        return out

    return Probe(str(path), data.get("env", {}), cells(data.get("cells", []), False),
                 cells(data.get("drafters", []), True), data.get("sampler", []), data.get("date", ""))


def predictions(probe: Probe, hw: hardware.Hardware) -> dict:
    """The model's seconds for every cell, as `simulate --step-table` answers (step.step_table): a target cell's
    `seconds`, a drafter cell's `draft_seconds` (one drafter step, as spec_step prices it)."""
    out = {}
    for c in probe.cells + probe.drafters:
        drafter = Drafter("eagle3" if c.model.eagle3 else "draft_model", c.model) if c.drafter else None
        row = step_table(c.model, hw, [(c.batch, c.width, c.context)], drafter)["steps"][0]
        out[id(c)] = row["draft_seconds"] if c.drafter else row["seconds"]
    return out


def comparisons(probe: Probe, hw: hardware.Hardware) -> dict:
    """Predicted against measured, per cell: T(w)/T(1) of every target step wider than one token, drafter step
    over the target's width-1 step at the same batch and context, and every step's seconds."""
    pred = predictions(probe, hw)
    one = {(c.kind, c.batch, c.context): c for c in probe.cells if c.width == 1}
    targets = {c.kind for c in probe.cells}
    ratios, drafter, steps = [], [], []
    for c in probe.cells:
        base = one.get((c.kind, c.batch, c.context))
        if c.width > 1 and base is not None:
            p, m = pred[id(c)] / pred[id(base)], c.seconds / base.seconds
            ratios.append({"kind": c.kind, "batch": c.batch, "context": c.context, "width": c.width,
                           "predicted": p, "measured": m, "error": p / m - 1})
    for c in probe.drafters:
        base = next((one[(t, c.batch, c.context)] for t in sorted(targets) if (t, c.batch, c.context) in one), None)
        if base is not None:
            p, m = pred[id(c)] / pred[id(base)], c.seconds / base.seconds
            drafter.append({"kind": c.kind, "target": base.kind, "batch": c.batch, "context": c.context,
                            "predicted": p, "measured": m, "error": p / m - 1})
    for c in probe.cells + probe.drafters:
        steps.append({"kind": c.kind, "batch": c.batch, "width": c.width, "context": c.context,
                      "predicted_s": pred[id(c)], "measured_s": c.seconds, "error": pred[id(c)] / c.seconds - 1})
    return {"ratios": ratios, "drafter": drafter, "steps": steps}


def summary(rows: list) -> dict:
    errs = [abs(r["error"]) for r in rows]
    if not errs:
        return {"n": 0}
    return {"n": len(errs), "median_abs_error": round(statistics.median(errs), 4), "max_abs_error": round(max(errs), 4)}


def base_profile(probe: Probe, datasheet: str | None = None) -> hardware.Hardware:
    """What the fit starts from: a datasheet profile's peaks, or the file's own measured copy and matmul rates
    (capacity and links from the shipped profile of that GPU where there is one, else H100's)."""
    if datasheet:
        return hardware.get(datasheet)
    gpu = probe.gpu.lower()
    like = next((p for n, p in hardware.PROFILES.items() if n in gpu), hardware.H100_SXM)
    env = probe.env
    return replace(like, name=f"{gpu.replace('nvidia', '').strip() or 'gpu'} (fitted)",
                   mem_bw=env.get("d2d_rw_TBps", like.mem_bw / 1e12) * 1e12,
                   flops=env.get("bf16_matmul_TFLOPs", like.flops / 1e12) * 1e12,
                   mem_bytes=env.get("mem_gb", like.mem_bytes / 2**30) * 2**30)


def with_params(base: hardware.Hardware, x, sms: int, passes: float, source: str) -> hardware.Hardware:
    overhead, layer, verify, mem_eff, flop_eff, overlap, cta = x
    fit = hardware.StepFit(layer_s=float(layer), verify_layer_s=float(verify), overlap=float(overlap),
                           sampler_passes=passes, attn_cta_bw=float(cta) if sms else None, sms=sms, source=source)
    return replace(base, overhead_s=float(overhead), draft_overhead_s=float(overhead), mem_eff=float(mem_eff),
                   flop_eff=float(flop_eff), fit=fit)


def sampler_passes(probe: Probe, base: hardware.Hardware, mem_eff: float) -> float:
    """Passes over the logits from the sampler rows: the slope of seconds over rows x vocab x 4 bytes."""
    rows = [(s["batch"] * s["width"] * s["vocab"] * 4, s["seconds"]) for s in probe.sampler]
    if len(rows) < 2:
        return hardware.GPU_FIT.sampler_passes
    n = len(rows)
    mx, my = sum(b for b, _ in rows) / n, sum(t for _, t in rows) / n
    slope = sum((b - mx) * (t - my) for b, t in rows) / sum((b - mx) ** 2 for b, _ in rows)
    return round(max(0.0, slope * base.mem_bw * mem_eff), 2)


def fit(probe: Probe, datasheet: str | None = None) -> hardware.Hardware:
    """The profile whose step form best matches the probe file (see the module docstring)."""
    import numpy as np
    from scipy.optimize import least_squares

    base = base_profile(probe, datasheet)
    sms = int(probe.env.get("sms") or 0)
    source = f"fitted to {probe.path} ({probe.gpu}, {probe.date})"
    g = hardware.GPU_FIT
    x0 = [30e-6, g.layer_s, g.verify_layer_s, 0.8, 0.6, g.overlap, 60e9]
    lo = [0.0, 0.0, 0.0, 0.05, 0.05, 0.0, 1e9]
    hi = [5e-3, 1e-3, 1e-3, 1.0, 1.0, 1.0, 1e12]

    def residuals(x):
        r = comparisons(probe, with_params(base, x, sms, 0.0, source))
        return np.array([e["error"] for e in r["ratios"] + r["drafter"]] + [0.5 * e["error"] for e in r["steps"]])

    sol = least_squares(residuals, x0, bounds=(lo, hi), x_scale="jac")
    x = list(sol.x)
    return with_params(base, x, sms, sampler_passes(probe, base, x[3]), source)


def from_probe(path: str | Path, datasheet: str | None = None) -> hardware.Hardware:
    return fit(read(path), datasheet)


def describe(hw: hardware.Hardware) -> str:
    f = hw.fit
    return (f"{hw.name}: overhead {hw.overhead_s * 1e6:.1f} us + {f.layer_s * 1e6:.1f} us per layer "
            f"(+{f.verify_layer_s * 1e6:.1f} us per layer when wider than one token); mem_eff {hw.mem_eff:.3f} of "
            f"{hw.mem_bw / 1e12:.2f} TB/s = {hw.mem_bw * hw.mem_eff / 1e12:.2f} TB/s, flop_eff {hw.flop_eff:.3f} of "
            f"{hw.flops / 1e12:.0f} TFLOP/s = {hw.flops * hw.flop_eff / 1e12:.0f} TFLOP/s; overlap {f.overlap:.3f}; "
            + (f"attention CTA sweep {f.attn_cta_bw / 1e9:.1f} GB/s ({f.sms} SMs); " if f.attn_cta_bw else "")
            + f"sampler {f.sampler_passes:.1f} passes")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--datasheet", help="express the efficiencies against this shipped profile's peaks (h200)")
    args = ap.parse_args(argv)
    probe = read(args.file)
    hw = fit(probe, args.datasheet)
    print(describe(hw))
    r = comparisons(probe, hw)
    for name in ("ratios", "drafter", "steps"):
        print(f"  {name}: {summary(r[name])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
