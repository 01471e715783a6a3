"""What LoRA adapters cost a decode step on whatever GPU this runs on, and what mixing adapters in one batch costs:
the check of docs/lora.md's GPU arithmetic (one adapter +0.5%, 8 mixed +4.2% on Qwen3-8B). PyTorch with CUDA only
(no vLLM); about a minute of measuring on an H100.

    python perf/lora_step_probe.py [--out bench/results/lora_step_probe_<gpu>.json] [--rank 16]
        [--batches 1,4,16,64,256] [--adapters 1,4,8] [--context 1024] [--budget-s 150]
    python perf/lora_step_probe.py --dry-run     # tiny shapes on the CPU, eager: checks the code and the file form

The model is perf/gpu_step_probe.py's Qwen3-8B-shaped decoder (random bf16 weights, one CUDA graph per cell). Each
linear layer (fused QKV, output, fused gate/up, down) carries `--rank` LoRA factors per adapter, A [rank, in] and
B [out, rank], as vLLM applies them to its fused layers. A step with `m` adapters mixed splits the batch's sequences
into m contiguous groups (vLLM's Punica path sorts tokens by adapter the same way) and adds each group's
(x A^T) B^T, one pair of GEMMs per adapter and layer (SGMV's shape; vLLM's Triton kernels fuse the pairs of a
step, so this is an upper bound on the launch cost). `m-gathered` applies the same adapters BGMV's way instead: each
token's factors gathered and one batched GEMM pair per layer whatever m (launches independent of the mix, bytes
growing with the tokens). Arms, timed cell by cell in one run: `base` (no LoRA), `m` and `m-gathered` adapters for m
in --adapters (1 = one adapter for the whole batch). The file keeps each cell's seconds and the
ratios against the base and against one adapter, beside the roofline arithmetic of docs/lora.md.
"""
from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_step_probe as gsp  # noqa: E402  (beside this file: the model, timing, env rates)

LINEARS = ("wqkv", "wo", "wgu", "wd")


class LoraStack(gsp.Stack):
    """gsp.Stack whose linear layers add LoRA deltas of `adapters` adapters, each over its contiguous token group."""

    def __init__(self, base: gsp.Stack, rank: int, adapters: int, gathered: bool = False):
        """On `base`'s weights (shared, not copied: four arms of an 8B model would not fit one GPU otherwise).
        gathered: every token's own factors gathered and applied by one batched GEMM pair per layer, whatever the
        number of adapters (BGMV's shape: kernels per step independent of the mix, bytes growing with tokens)."""
        import torch

        self.__dict__.update(base.__dict__)
        self.adapters, self.groups, self.gathered, self.index = adapters, None, gathered, None
        self.layers = []
        for layer in base.layers:                 # each weight becomes (W, A [m, r, in], B [m, out, r])
            mine = dict(layer)
            for name in LINEARS:
                w = layer[name]
                a = torch.randn(adapters, rank, w.shape[1], device=w.device, dtype=w.dtype) * 0.02
                b = torch.randn(adapters, w.shape[0], rank, device=w.device, dtype=w.dtype) * 0.02
                mine[name] = (w, a, b)
            self.layers.append(mine)

    def set_batch(self, batch: int, width: int) -> None:
        """Token ranges of each adapter: the batch's sequences split into `adapters` contiguous groups."""
        per = [batch // self.adapters + (1 if i < batch % self.adapters else 0) for i in range(self.adapters)]
        bounds, start = [], 0
        for n in per:
            bounds.append((start * width, (start + n) * width))
            start += n
        self.groups = [(i, s, e) for i, (s, e) in enumerate(bounds) if e > s]
        import torch

        self.index = torch.cat([torch.full((e - s,), i, dtype=torch.long) for i, s, e in self.groups]).to(
            self.layers[0]["wo"][0].device)

    def linear(self, x, weight):
        import torch.nn.functional as F

        w, a, b = weight
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        y = F.linear(x2, w)
        if self.gathered:
            import torch

            shrink = torch.bmm(x2.unsqueeze(1), a[self.index].transpose(1, 2))          # [T, 1, r]
            y += torch.bmm(shrink, b[self.index].transpose(1, 2)).squeeze(1)           # [T, out]
            return y.reshape(*shape[:-1], w.shape[0])
        for i, s, e in self.groups:
            y[s:e] += F.linear(F.linear(x2[s:e], a[i]), b[i])
        return y.reshape(*shape[:-1], w.shape[0])


def roofline(shape: dict, rank: int, batch: int, adapters: int) -> dict:
    """docs/lora.md's arithmetic: extra weight bytes a memory-bound step reads (the distinct adapters in the batch)
    as a fraction of the base's, and extra FLOPs per token as a fraction of the base's."""
    h, d = shape["hidden"], shape["head_dim"]
    dims = [(h, (shape["heads"] + 2 * shape["kv_heads"]) * d), (shape["heads"] * d, h), (h, 2 * shape["mlp"]),
            (shape["mlp"], h)]
    base = shape["layers"] * sum(i * o for i, o in dims) + shape["vocab"] * h
    lora = shape["layers"] * sum(rank * (i + o) for i, o in dims)
    return {"extra_bytes_fraction": min(adapters, batch) * lora / base, "extra_flops_fraction": lora / base}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="default bench/results/lora_step_probe_<gpu>.json")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batches", default="1,4,16,64,256")
    ap.add_argument("--adapters", default="1,4,8")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--budget-s", type=float, default=150.0, help="seconds of measuring at most")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, eager (checks the code)")
    args = ap.parse_args()
    import torch

    t0 = time.monotonic()
    cuda, device, dtype = gsp.open_device(args.dry_run)
    gsp.GQA[0] = "fold"
    batches = [int(x) for x in args.batches.split(",")]
    counts = [int(x) for x in args.adapters.split(",")]
    shape, n = (gsp.TINY, 16) if args.dry_run else (gsp.QWEN3_8B, args.context)
    if args.dry_run:
        batches = [b for b in batches if b <= 8] or [1]
    clock = gsp.Clock(args.budget_s)
    env, _ = gsp.env_rates(device, cuda, dtype, small=args.dry_run)
    print(f"env {env}", flush=True)
    arms = {"base": gsp.Stack(shape, device, dtype)}
    for m in counts:
        arms[str(m)] = LoraStack(arms["base"], args.rank, m)
    for m in counts:
        arms[f"{m}-gathered"] = LoraStack(arms["base"], args.rank, m, gathered=True)
    cells = []
    for b in batches:
        if not clock.left():
            clock.skipped += 1
            continue
        caches = arms["base"].caches(b, n + 1)
        x, emb = arms["base"].inputs(b, 1)
        row = {"batch": b, "width": 1, "context": n, "seconds": {}}
        for name, st in arms.items():
            if isinstance(st, LoraStack):
                st.set_batch(b, 1)
            with torch.no_grad():
                row["seconds"][name] = gsp.timed(lambda st=st: st.step(x, emb, caches, n), cuda)
        sec = row["seconds"]
        row["over_base"] = {m: sec[m] / sec["base"] for m in sec if m != "base"}
        row["over_one_adapter"] = {m: sec[m] / sec["1"] for m in sec if m not in ("base", "1")} if "1" in sec else {}
        row["roofline"] = {m: roofline(shape, args.rank, b, int(m.split("-")[0])) for m in sec if m != "base"}
        cells.append(row)
        print(f"  batch {b:>4}: base {sec['base'] * 1e3:7.3f} ms  " + "  ".join(
            f"{m} adapter(s) {sec[m] * 1e3:7.3f} ms ({row['over_base'][m]:.3f}x base)" for m in sec if m != "base"),
            flush=True)
        caches = None
        if cuda:
            torch.cuda.empty_cache()
    result = {"what": f"LoRA rank {args.rank} on every linear layer of a Qwen3-8B-shaped decode step, one adapter and "
                      "several mixed against the base (perf/lora_step_probe.py)",
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
              "env": env, "target_shape": {"kind": "tiny" if args.dry_run else "qwen3-8b", **shape}, "rank": args.rank,
              "cells": cells,
              "probe": {"args": vars(args), "seconds": round(time.monotonic() - t0, 1), "skipped_cells": clock.skipped}}
    out = gsp.write_result(result, args.out, "lora_step_probe", cuda)
    print(f"{len(cells)} cells in {time.monotonic() - t0:.0f} s; wrote {out}", flush=True)


if __name__ == "__main__":
    main()
