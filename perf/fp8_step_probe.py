"""FP8 against bf16 decode steps on whatever GPU this runs on: the check of the performance model's FP8 projection
(bench/quantized.py: weights at 1 byte per parameter, twice the dense FLOP/s, KV cache and LM head in bf16).
PyTorch with CUDA only (no vLLM); about a minute of measuring on an H100.

    python perf/fp8_step_probe.py [--out bench/results/fp8_step_probe_<gpu>.json] [--budget-s 120]
        [--batches 1,4,16,64,256] [--widths 1,4] [--contexts 1024]
    python perf/fp8_step_probe.py --dry-run      # tiny shapes on the CPU, eager: checks the code and the file form

The model is perf/gpu_step_probe.py's Qwen3-8B-shaped decoder with random weights, one CUDA graph per cell. Arms,
timed cell by cell in one run (bf16, fp8, fp8-static for each cell before the next):
- `bf16`: every layer's matmuls in bf16 (gpu_step_probe.Stack).
- `fp8`: the QKV, output, gate/up and down weights in float8_e4m3fn with one scale per output channel; each
  activation quantized per token at run time (absmax / 448) and multiplied by torch._scaled_mm with row-wise scales,
  bf16 out: the form of vLLM's dynamic-per-token FP8 (compressed-tensors W8A8-FP8). The activation quantization runs as
  unfused PyTorch ops (vLLM fuses it into one kernel), so this arm is an upper bound on FP8's step time.
- `fp8-static`: the same weights, activations scaled by one fixed per-tensor factor (two element-wise ops): what FP8
  costs with static activation scales.
- `fp8-tensor`: one scale per weight tensor and one static activation scale: scalar scales, which torch._scaled_mm
  serves by cuBLASLt (row-wise scales take its CUTLASS kernels).
`gemms`: each of the four linear shapes alone at every batch size, bf16 against FP8 with scalar and with row-wise
scales, and the weight bytes read per second each reaches.
The file keeps each cell's seconds per arm and the ratio bf16 / fp8, beside the performance model's projected ratio
for the same shape on H200 (and this GPU's own measured copy and matmul rates, `env`).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The repository too: the GPU machine runs this file from a copy of the repo with plain PyTorch, rollout_service not
# installed (its perfmodel needs only the standard library).
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
import gpu_step_probe as gsp  # noqa: E402  (beside this file: the model, timing, env rates)
from rollout_service.perfmodel.hardware import H200  # noqa: E402
from rollout_service.perfmodel.model import from_config  # noqa: E402
from rollout_service.perfmodel.step import forward  # noqa: E402

FP8_MAX = 448.0     # float8_e4m3fn's largest finite value


class FP8Stack(gsp.Stack):
    """gsp.Stack with its layers' weights in FP8 (per output channel scales) and FP8 matmuls."""

    def __init__(self, s: dict, device, dtype, static: bool, emulate: bool, tensorwise: bool = False):
        import torch

        super().__init__(s, device, dtype)
        self.static, self.emulate, self.tensorwise = static or tensorwise, emulate, tensorwise
        for layer in self.layers:                  # each weight becomes (FP8 weight [N, K], its scales [1, N] or [])
            for name in ("wqkv", "wo", "wgu", "wd"):
                w = layer[name].float()
                scale = (w.abs().amax() if tensorwise else w.abs().amax(dim=1, keepdim=True)) / FP8_MAX
                scale = scale.clamp(min=1e-12)
                layer[name] = ((w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale.t().contiguous())
                del w
        self.static_scale = torch.tensor(1.0 / 64, device=device, dtype=torch.float32)

    def linear(self, x, weight):
        import torch

        wq, w_scale = weight
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.tensorwise:
            xs = self.static_scale
            xq = (x2 / self.static_scale.to(x2.dtype)).to(torch.float8_e4m3fn)
        elif self.static:
            xs = self.static_scale.expand(x2.shape[0], 1)
            xq = (x2 / self.static_scale.to(x2.dtype)).to(torch.float8_e4m3fn)
        else:
            xs = (x2.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)      # [M, 1]
            xq = (x2.float() / xs).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        if self.emulate:                      # the CPU dry run: the same arithmetic, dequantized
            out = (xq.float() * xs) @ (wq.float().t() * w_scale.reshape(1, -1))
            out = out.to(x.dtype)
        else:
            out = torch._scaled_mm(xq, wq.t(), scale_a=xs.contiguous(), scale_b=w_scale, out_dtype=x.dtype)
        return out.reshape(*shape[:-1], wq.shape[0])


def model_ratio(batch: int, width: int, context: int) -> float:
    """The performance model's bf16 / FP8 step-time ratio for Qwen3-8B on H200 (bench/quantized.py's projection)."""
    import dataclasses

    cfg = Path(__file__).resolve().parents[1] / "rollout_service/perfmodel/configs/qwen3-8b.json"
    m = from_config(json.loads(cfg.read_text()), "qwen3-8b")
    fp8 = dataclasses.replace(H200, bytes_per_param=1.0, flops=2 * H200.flops)
    return forward(m, H200, batch, width, context).seconds / forward(m, fp8, batch, width, context).seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="default bench/results/fp8_step_probe_<gpu>.json")
    ap.add_argument("--batches", default="1,4,16,64,256")
    ap.add_argument("--widths", default="1,4")
    ap.add_argument("--contexts", default="1024")
    ap.add_argument("--budget-s", type=float, default=120.0, help="seconds of measuring at most")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, eager (checks the code)")
    args = ap.parse_args()
    import torch

    t0 = time.monotonic()
    cuda, device, dtype = gsp.open_device(args.dry_run)
    gsp.GQA[0] = "fold"
    batches = [int(x) for x in args.batches.split(",")]
    widths = [int(x) for x in args.widths.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    shape = gsp.TINY if args.dry_run else gsp.QWEN3_8B
    if args.dry_run:
        batches, contexts = [b for b in batches if b <= 4] or [1], [min(contexts)]
    clock = gsp.Clock(args.budget_s)
    env, copies = gsp.env_rates(device, cuda, dtype, small=args.dry_run)
    print(f"env {env}", flush=True)
    arms = {"bf16": gsp.Stack(shape, device, dtype),
            "fp8": FP8Stack(shape, device, dtype, static=False, emulate=not cuda),
            "fp8-static": FP8Stack(shape, device, dtype, static=True, emulate=not cuda),
            "fp8-tensor": FP8Stack(shape, device, dtype, static=True, emulate=not cuda, tensorwise=True)}
    if cuda:
        torch.cuda.empty_cache()
    cells = []
    for n in contexts:
        for b in batches:
            for w in widths:
                if not clock.left():
                    clock.skipped += 1
                    continue
                caches = arms["bf16"].caches(b, n + w)
                x, emb = arms["bf16"].inputs(b, w)
                row = {"batch": b, "width": w, "context": n}
                for name, st in arms.items():
                    with torch.no_grad():
                        row[name] = gsp.timed(lambda st=st: st.step(x, emb, caches, n), cuda)
                row["ratio_bf16_over_fp8"] = row["bf16"] / row["fp8"]
                row["ratio_bf16_over_fp8_static"] = row["bf16"] / row["fp8-static"]
                row["ratio_bf16_over_fp8_tensor"] = row["bf16"] / row["fp8-tensor"]
                row["model_ratio_h200"] = model_ratio(b, w, n)
                cells.append(row)
                print(f"  batch {b:>4} width {w} context {n:>5}: bf16 {row['bf16'] * 1e3:7.3f} ms  fp8 "
                      f"{row['fp8'] * 1e3:7.3f} ms ({row['ratio_bf16_over_fp8']:.2f}x)  fp8-static "
                      f"{row['fp8-static'] * 1e3:7.3f} ms ({row['ratio_bf16_over_fp8_static']:.2f}x)  fp8-tensor "
                      f"{row['fp8-tensor'] * 1e3:7.3f} ms ({row['ratio_bf16_over_fp8_tensor']:.2f}x)  model "
                      f"{row['model_ratio_h200']:.2f}x", flush=True)
                caches = None
                if cuda:
                    torch.cuda.empty_cache()
    gemms = []
    h, d = shape["hidden"], shape["head_dim"]
    shapes = {"qkv": ((shape["heads"] + 2 * shape["kv_heads"]) * d, h), "o": (h, shape["heads"] * d),
              "gate_up": (2 * shape["mlp"], h), "down": (h, shape["mlp"])}
    for name, (n_out, k_in) in shapes.items():
        w = torch.randn(n_out, k_in, device=device, dtype=dtype) * 0.02
        wq = w.to(torch.float8_e4m3fn)
        for m in batches:
            if not clock.left():
                clock.skipped += 1
                continue
            x = torch.randn(m, k_in, device=device, dtype=dtype)
            xq = x.to(torch.float8_e4m3fn)
            one = torch.ones((), device=device, dtype=torch.float32)
            row = {"gemm": name, "m": m, "n": n_out, "k": k_in,
                   "bf16": gsp.timed(lambda: torch.nn.functional.linear(x, w), cuda)}
            if cuda:
                row["fp8_tensor"] = gsp.timed(lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one,
                                                                        out_dtype=dtype), cuda)
                sa, sb = torch.ones(m, 1, device=device), torch.ones(1, n_out, device=device)
                row["fp8_rowwise"] = gsp.timed(lambda: torch._scaled_mm(xq, wq.t(), scale_a=sa, scale_b=sb,
                                                                         out_dtype=dtype), cuda)
                row["weight_GBps_bf16"] = n_out * k_in * 2 / row["bf16"] / 1e9
                row["weight_GBps_fp8_tensor"] = n_out * k_in / row["fp8_tensor"] / 1e9
                row["weight_GBps_fp8_rowwise"] = n_out * k_in / row["fp8_rowwise"] / 1e9
                print(f"  gemm {name:<8} m {m:>4}: bf16 {row['bf16'] * 1e6:7.1f} us  fp8 tensor "
                      f"{row['fp8_tensor'] * 1e6:7.1f} us  fp8 rowwise {row['fp8_rowwise'] * 1e6:7.1f} us", flush=True)
            gemms.append(row)
        w = wq = None                               # freed before the next shape
    result = {"what": "FP8 against bf16 decode steps, Qwen3-8B shape (perf/fp8_step_probe.py)",
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
              "env": env, "copies": copies, "target_shape": {"kind": "tiny" if args.dry_run else "qwen3-8b", **shape},
              "cells": cells, "gemms": gemms,
              "probe": {"args": vars(args), "seconds": round(time.monotonic() - t0, 1), "skipped_cells": clock.skipped}}
    out = gsp.write_result(result, args.out, "fp8_step_probe", cuda)
    print(f"{len(cells)} cells in {time.monotonic() - t0:.0f} s; wrote {out}", flush=True)


if __name__ == "__main__":
    main()
