"""MoE decode-step times on whatever GPU this runs on: a Qwen3-30B-A3B-shaped model (hidden 2048, 32 query / 4 KV
heads of 128, 128 experts of moe_intermediate 768, top-8) with random bf16 weights, its experts run as grouped GEMMs
over the top-k routing of a random router. PyTorch with CUDA only (no vLLM). What it is for: the performance model's
MoE terms (perfmodel/moe.py: distinct experts read per step as batch and width grow) measured, and a profile fitted
to it (`rollout-service simulate --hardware-from FILE`, perfmodel/fit.py: the file has perf/gpu_step_probe.py's form).

    python perf/moe_step_probe.py [--out bench/results/moe_step_probe_<gpu>.json] [--budget-s 240]
        [--layers 48] [--batches 1,2,4,8,16,32,64,128,256] [--widths 1,4] [--contexts 512] [--impl auto]
    python perf/moe_step_probe.py --smoke [--out FILE]   # tiny shapes on the CPU, eager, float32: seconds

The 48 layers' weights take 61 GB: on an 80 GB GPU the batch-256 cells do not fit beside them (skipped, counted);
--layers 24 keeps them (the file's target_shape says how many layers, and the fit prices per layer).

Writes (the form of perf/gpu_step_probe.py's files, which perfmodel/fit.py reads):
- `env`, `copies`: the device's copy and matmul rates (gpu_step_probe.env_rates).
- `cells`: one decoding step of the whole model for `batch` sequences, `width` new tokens each (k + 1 for a verify of
  k drafts; default widths 1 and 4) over `context` cached tokens. Per layer: RMSNorm, fused QKV, the new K/V written
  into a preallocated cache, attention by SDPA with grouped heads folded (gpu_step_probe.attention), output
  projection; RMSNorm, the router (a [tokens, 128] GEMM, softmax, top-8, renormalised), then the experts: rows sorted
  by expert and padded to 16 per expert, one grouped GEMM for gate/up (torch._grouped_mm), SiLU, one for down, and a
  weighted index_add back to the tokens; then the final norm and the LM head over every new token. Each cell also
  records `experts_read`: the distinct experts its routing read per layer (mean over layers), beside the uniform
  expectation E (1 - (1 - k/E)^T).
- `moe`: one MoE block alone (router to combine) at each batch and width: `seconds`, `experts_read`, `expected`.
- `target_shape`: the shape with its MoE fields, so the fit builds the same model.
Each step is captured once as a CUDA graph (static shapes: the padding makes the grouped GEMM's rows fixed) and
replayed; `seconds` is the median of 10 replays timed with CUDA events after 3 warm-up replays (where capture fails,
eager launches timed the same way). --impl loop runs one GEMM pair per routed expert instead (eager only; for a
PyTorch without torch._grouped_mm).
"""
from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_step_probe as gsp  # noqa: E402  (beside this file: timing, attention, env rates)

QWEN3_30B_A3B = {"layers": 48, "hidden": 2048, "heads": 32, "kv_heads": 4, "head_dim": 128, "mlp": 6144,
                 "vocab": 151936, "experts": 128, "experts_per_tok": 8, "expert_intermediate": 768}
TINY = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "mlp": 128, "vocab": 256,
        "experts": 16, "experts_per_tok": 2, "expert_intermediate": 32}
ALIGN = 16          # rows per expert padded to this (grouped GEMM tiles; torchtitan pads to 8-16 for bf16)


def expected_experts(s: dict, tokens: int) -> float:
    e, k = s["experts"], s["experts_per_tok"]
    return e * (1 - (1 - k / e) ** tokens)


class MoEStack:
    """Random weights of a Qwen3-MoE-shaped decoder and its decoding step."""

    def __init__(self, s: dict, device, dtype, impl: str):
        import torch

        self.s, self.device, self.dtype, self.impl = s, device, dtype, impl
        h, hd, e, i = s["hidden"], s["head_dim"], s["experts"], s["expert_intermediate"]

        def w(*shape):
            return torch.randn(*shape, device=device, dtype=dtype) * 0.02

        self.layers = [{"norm1": torch.ones(h, device=device, dtype=dtype),
                        "wqkv": w((s["heads"] + 2 * s["kv_heads"]) * hd, h), "wo": w(h, s["heads"] * hd),
                        "norm2": torch.ones(h, device=device, dtype=dtype), "router": w(e, h),
                        "w13": w(e, 2 * i, h), "w2": w(e, h, i)} for _ in range(s["layers"])]
        self.norm = torch.ones(h, device=device, dtype=dtype)
        self.lm = w(s["vocab"], h)
        self.seen: list[int] = []          # distinct experts per MoE block of the last eager step

    def caches(self, batch: int, slots: int) -> list:
        import torch

        s = self.s
        return [tuple(torch.zeros(batch, s["kv_heads"], slots, s["head_dim"], device=self.device, dtype=self.dtype)
                      for _ in range(2)) for _ in range(s["layers"])]

    def moe(self, x, layer):
        """x [T, hidden] -> [T, hidden]: router, top-k, experts as grouped GEMMs, weighted combine."""
        import torch
        import torch.nn.functional as F

        s = self.s
        e, k = s["experts"], s["experts_per_tok"]
        t = x.shape[0]
        probs = torch.softmax(F.linear(x, layer["router"]).float(), dim=-1)
        weight, ids = probs.topk(k, dim=-1)                              # [T, k]
        weight = (weight / weight.sum(-1, keepdim=True)).to(x.dtype)
        flat = ids.reshape(-1)                                           # [T k]
        if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.seen.append(int(torch.unique(flat).numel()))
        order = torch.argsort(flat, stable=True)
        sorted_ids = flat[order]
        token = order // k
        if self.impl == "loop":
            out = torch.zeros_like(x)
            counts = torch.bincount(flat, minlength=e).tolist()
            start = 0
            for ex, n in enumerate(counts):
                if n:
                    sl = order[start:start + n]
                    g, u = F.linear(x[sl // k], layer["w13"][ex]).chunk(2, dim=-1)
                    y = F.linear(F.silu(g) * u, layer["w2"][ex]) * weight.reshape(-1)[sl].unsqueeze(-1)
                    out.index_add_(0, sl // k, y)
                    start += n
            return out
        counts = torch.zeros(e, device=x.device, dtype=torch.int64).scatter_add_(
            0, flat, torch.ones_like(flat))
        padded = (counts + ALIGN - 1) // ALIGN * ALIGN
        start = torch.cumsum(counts, 0) - counts
        pstart = torch.cumsum(padded, 0) - padded
        rank = torch.arange(t * k, device=x.device) - start[sorted_ids]
        dest = pstart[sorted_ids] + rank                                 # each row's place in the padded buffer
        rows = torch.zeros(t * k + e * (ALIGN - 1), x.shape[1], device=x.device, dtype=x.dtype)
        rows.index_copy_(0, dest, x[token])
        offs = torch.cumsum(padded, 0).to(torch.int32)
        gu = torch._grouped_mm(rows, layer["w13"].transpose(-2, -1), offs=offs)
        g, u = gu.chunk(2, dim=-1)
        y = torch._grouped_mm((F.silu(g) * u).contiguous(), layer["w2"].transpose(-2, -1), offs=offs)
        y = y[dest] * weight.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add_(0, token, y)

    def step(self, x, caches, context: int):
        """One decoding step: x [B, w, hidden] over `context` cached tokens per sequence -> logits [B, w, vocab]."""
        import torch.nn.functional as F

        s = self.s
        b, w = x.shape[0], x.shape[1]
        hd, nh, nkv = s["head_dim"], s["heads"], s["kv_heads"]
        for layer, (kc, vc) in zip(self.layers, caches):
            qkv = F.linear(gsp.rms(x, layer["norm1"]), layer["wqkv"])
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q = q.view(b, w, nh, hd).transpose(1, 2)
            kc[:, :, context:context + w].copy_(k.view(b, w, nkv, hd).transpose(1, 2))
            vc[:, :, context:context + w].copy_(v.view(b, w, nkv, hd).transpose(1, 2))
            o = gsp.attention(q, kc[:, :, :context + w], vc[:, :, :context + w], "fold")
            x = x + F.linear(o.transpose(1, 2).reshape(b, w, nh * hd), layer["wo"])
            x = x + self.moe(gsp.rms(x, layer["norm2"]).reshape(b * w, -1), layer).view(b, w, -1)
        return F.linear(gsp.rms(x, self.norm), self.lm)


def pick_impl(want: str, device, dtype) -> str:
    """grouped where torch._grouped_mm runs on this device and dtype, else loop."""
    import torch

    if want != "auto":
        return want
    try:
        a = torch.randn(32, 32, device=device, dtype=dtype)
        b = torch.randn(2, 32, 32, device=device, dtype=dtype)
        torch._grouped_mm(a, b.transpose(-2, -1), offs=torch.tensor([16, 32], device=device, dtype=torch.int32))
        return "grouped"
    except (AttributeError, RuntimeError, NotImplementedError, TypeError):
        return "loop"


def measure(stack: MoEStack, kind: str, batches, widths, contexts, max_kv: int, cuda: bool, clock, log):
    import torch

    s, cells, blocks = stack.s, [], []
    graph = cuda and stack.impl == "grouped"
    for n in contexts:
        for b in batches:
            ws = [w for w in widths if b * (n + w) <= max_kv]
            if not ws or not clock.left():
                clock.skipped += len(ws)
                continue
            caches = stack.caches(b, n + max(ws))
            for w in ws:
                if not clock.left():
                    clock.skipped += 1
                    continue
                x = torch.randn(b, w, s["hidden"], device=stack.device, dtype=stack.dtype)
                with torch.no_grad():
                    stack.seen = []
                    stack.step(x, caches, n)                            # eager once: the routing's experts
                    read = sum(stack.seen) / len(stack.seen)
                    sec = gsp.timed(lambda: stack.step(x, caches, n), cuda, graph=graph)
                cells.append({"kind": kind, "batch": b, "width": w, "context": n, "seconds": sec,
                              "experts_read": round(read, 2), "expected": round(expected_experts(s, b * w), 2)})
                log(f"  step  batch {b:>4} width {w} context {n:>5}: {sec * 1e3:8.3f} ms, experts read {read:6.1f} "
                    f"(expected {expected_experts(s, b * w):6.1f})")
            caches = None
            if cuda:
                torch.cuda.empty_cache()
    for b in batches:                                                   # one MoE block alone
        for w in widths:
            if not clock.left():
                clock.skipped += 1
                continue
            xs = torch.randn(b * w, s["hidden"], device=stack.device, dtype=stack.dtype)
            with torch.no_grad():
                stack.seen = []
                stack.moe(xs, stack.layers[0])
                read = stack.seen[0]
                sec = gsp.timed(lambda: stack.moe(xs, stack.layers[0]), cuda, graph=graph)
            blocks.append({"batch": b, "width": w, "tokens": b * w, "seconds": sec, "experts_read": read,
                           "expected": round(expected_experts(s, b * w), 2)})
            log(f"  moe   batch {b:>4} width {w}: {sec * 1e6:9.1f} us, experts read {read:4d}")
    return cells, blocks


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="default bench/results/moe_step_probe_<gpu>.json")
    ap.add_argument("--layers", type=int, help="decoder layers (default 48, the model's; fewer to fit a small GPU)")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--widths", default="1,4", help="new tokens per sequence: 1 (plain) and k + 1 (a verify)")
    ap.add_argument("--contexts", default="512")
    ap.add_argument("--max-kv-tokens", type=int, help="skip cells caching more tokens (default: what memory holds)")
    ap.add_argument("--budget-s", type=float, default=240.0, help="seconds of measuring at most")
    ap.add_argument("--impl", choices=["auto", "grouped", "loop"], default="auto")
    ap.add_argument("--no-env", action="store_true", help="skip the copy and matmul rates")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, eager, float32 (checks the code)")
    args = ap.parse_args(argv)
    import torch

    t0 = time.monotonic()
    cuda, device, dtype = gsp.open_device(args.smoke, "--smoke", cpu_dtype=torch.float32)
    shape = dict(TINY if args.smoke else QWEN3_30B_A3B)
    if args.layers:
        shape["layers"] = args.layers
    batches = [int(x) for x in args.batches.split(",")]
    widths = [int(x) for x in args.widths.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    if args.smoke:
        batches, widths, contexts = [b for b in batches if b <= 4] or [1], widths, [32]
    kind = ("tiny-moe" if args.smoke else "qwen3-30b-a3b" if shape == QWEN3_30B_A3B
            else f"qwen3-moe-{shape['layers']}l")

    def log(msg):
        print(msg, flush=True)

    result = {"what": (f"MoE decode-step times (perf/moe_step_probe.py): a {kind} shape with random weights, experts "
                       "as grouped GEMMs over a random router's top-k, one CUDA graph per (batch, width, context), no "
                       "scheduler."),
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes")}
    if not args.no_env:
        result["env"], result["copies"] = gsp.env_rates(device, cuda, dtype, small=args.smoke)
        log(f"env {result['env']}")
    else:
        p = torch.cuda.get_device_properties(0) if cuda else None
        result["env"] = {"torch": torch.__version__, "gpu": p.name if p else "cpu (smoke)",
                         "sms": p.multi_processor_count if p else 0}
    impl = pick_impl(args.impl, device, dtype)
    stack = MoEStack(shape, device, dtype, impl)
    kv_per_token = shape["layers"] * 2 * shape["kv_heads"] * shape["head_dim"] * (2 if cuda else 4)
    max_kv = args.max_kv_tokens
    if max_kv is None:
        free = torch.cuda.mem_get_info()[0] - 6 * 2**30 if cuda else 2**30
        max_kv = max(0, int(free / kv_per_token))
    log(f"{kind}: {shape}; experts by {impl}; up to {max_kv} cached tokens")
    clock = gsp.Clock(args.budget_s)
    cells, blocks = measure(stack, kind, batches, widths, contexts, max_kv, cuda, clock, log)
    result.update({"cells": cells, "drafters": [], "moe": blocks,
                   "target_shape": {"kind": kind, **shape},
                   "probe": {"args": vars(args), "impl": impl, "max_kv_tokens": max_kv,
                             "seconds": round(time.monotonic() - t0, 1), "skipped_cells": clock.skipped}})
    out = gsp.write_result(result, args.out, "moe_step_probe", cuda, "smoke")
    log(f"{len(cells)} steps, {len(blocks)} MoE blocks"
        + (f", {clock.skipped} skipped (budget)" if clock.skipped else "")
        + f" in {time.monotonic() - t0:.0f} s; wrote {out}")


if __name__ == "__main__":
    main()
