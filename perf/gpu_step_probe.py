"""Decode-step times of an ideal engine on whatever GPU this runs on: the reference file the performance model is
fitted to (`rollout-service simulate --hardware-from FILE`). Needs PyTorch with CUDA only (no vLLM); 25 s of
measuring on an H200 (about a minute with start-up), never more than --budget-s (what is left is skipped and
counted in the file's `probe.skipped_cells`).

    python perf/gpu_step_probe.py [--out bench/results/gpu_step_probe_<gpu>.json] [--budget-s 150]
        [--target-config CONFIG.json] [--batches 1,2,4,...] [--widths 1,2,3,4,5] [--contexts 512,2048]
        [--max-kv-tokens 140000] [--no-drafters] [--no-env] [--gqa fold|native|expand]
    python perf/gpu_step_probe.py --dry-run     # tiny shapes on the CPU, eager: checks the code and the file form

Written from the method of ../shared/reference/README.md (h200-steps.json), and writes the same JSON form:
- `env`: a device-to-device copy's rate counting bytes read and written; an 8192^3 bf16 matmul's FLOP/s.
- `copies`: host-to-device and device-to-host from pinned memory, host-to-device from pageable memory, GB/s.
- `cells`: one decoding step of a Qwen3-8B-shaped model (or --target-config's dense shape), random bf16 weights,
  for `batch` sequences, `width` new tokens each (k + 1 for a verify of k drafts) over `context` cached tokens
  each. Per layer: RMSNorm (plain torch ops), one fused QKV matmul, the new K/V written into a preallocated cache,
  attention by scaled_dot_product_attention over the whole cache (no mask; the query heads sharing a KV head folded
  into query rows of it, --gqa fold: this reproduces the reference within 1.5% at the median, where SDPA's own
  enable_gqa ran steps wider than one token 1.4-1.7x slower on torch 2.11), output projection, a fused gate/up
  matmul, SiLU, down projection; then the final norm and the LM head over every new token. Left out: RoPE and
  q/k norms, the embedding lookup, scheduling. Cells whose KV cache exceeds --max-kv-tokens are skipped (the
  reference stops at 131,072 cached tokens: batch 256 at context 512, 64 at 2048).
- `drafters`: one width-1 step of an EAGLE-3-shaped head (fc from 3 x hidden to hidden, one decoder layer whose
  attention takes [embedding, hidden], 2 x hidden wide, LM head over a 32,000-token draft vocabulary) and of a
  Qwen3-0.6B-shaped draft model, at the same batches and contexts.
- `sampler`: batch x width rows of float32 logits over 151,936 tokens sampled as vLLM's sampler does (softmax,
  then argmax of p / Exp(1) noise).
Each step is captured once as a CUDA graph and replayed; `seconds` is the median of 10 replays timed with CUDA
events after 3 warm-up replays.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

QWEN3_8B = {"layers": 36, "hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "mlp": 12288, "vocab": 151936}
DRAFTERS = {
    "eagle3-head": {"layers": 1, "hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "mlp": 12288,
                    "vocab": 32000, "eagle3": True},
    "qwen3-0.6b": {"layers": 28, "hidden": 1024, "heads": 16, "kv_heads": 8, "head_dim": 128, "mlp": 3072,
                   "vocab": 151936},
}
TINY = {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "head_dim": 64, "mlp": 512, "vocab": 1000}
SAMPLER_VOCAB = 151936


def shape_from_config(path: str) -> tuple[str, dict]:
    """A dense Hugging Face config.json -> (name, shape)."""
    c = json.loads(Path(path).read_text())
    c = {**c, **c.get("text_config", {})}
    heads = c["num_attention_heads"]
    name = Path(path).parent.name if Path(path).name == "config.json" else Path(path).stem
    return name, {"layers": c["num_hidden_layers"], "hidden": c["hidden_size"], "heads": heads,
                  "kv_heads": c.get("num_key_value_heads") or heads,
                  "head_dim": c.get("head_dim") or c["hidden_size"] // heads, "mlp": c["intermediate_size"],
                  "vocab": c["vocab_size"]}


class Stack:
    """Random bf16 weights of a decoder-only model (or an EAGLE-3 head) and its decoding step."""

    def __init__(self, s: dict, device, dtype):
        import torch

        self.s, self.device, self.dtype = s, device, dtype
        h, hd = s["hidden"], s["head_dim"]
        attn_in = 2 * h if s.get("eagle3") else h

        def w(*shape):
            return (torch.randn(*shape, device=device, dtype=dtype) * 0.02)

        self.layers = [{"norm1": torch.ones(attn_in, device=device, dtype=dtype),
                        "wqkv": w((s["heads"] + 2 * s["kv_heads"]) * hd, attn_in),
                        "wo": w(h, s["heads"] * hd),
                        "norm2": torch.ones(h, device=device, dtype=dtype),
                        "wgu": w(2 * s["mlp"], h), "wd": w(h, s["mlp"])} for _ in range(s["layers"])]
        self.fc = w(h, 3 * h) if s.get("eagle3") else None
        self.norm = torch.ones(h, device=device, dtype=dtype)
        self.lm = w(s["vocab"], h)

    def linear(self, x, weight):
        """A layer's matmul (perf/fp8_step_probe.py runs its FP8 twin here)."""
        import torch.nn.functional as F

        return F.linear(x, weight)

    def caches(self, batch: int, slots: int) -> list:
        import torch

        s = self.s
        return [(torch.zeros(batch, s["kv_heads"], slots, s["head_dim"], device=self.device, dtype=self.dtype),
                 torch.zeros(batch, s["kv_heads"], slots, s["head_dim"], device=self.device, dtype=self.dtype))
                for _ in range(s["layers"])]

    def inputs(self, batch: int, width: int):
        import torch

        h = self.s["hidden"]
        x = torch.randn(batch, width, 3 * h if self.fc is not None else h, device=self.device, dtype=self.dtype)
        emb = torch.randn(batch, width, h, device=self.device, dtype=self.dtype) if self.fc is not None else None
        return x, emb

    def step(self, x, emb, caches, context: int):
        """One decoding step: x [B, w, hidden] (EAGLE-3: [B, w, 3 hidden] and the embeddings [B, w, hidden]) over
        `context` cached tokens per sequence; returns the logits of every new token."""
        import torch
        import torch.nn.functional as F

        s = self.s
        b, w = x.shape[0], x.shape[1]
        hd, nh, nkv = s["head_dim"], s["heads"], s["kv_heads"]
        if self.fc is not None:
            x = self.linear(x, self.fc)
        for layer, (kc, vc) in zip(self.layers, caches):
            a_in = torch.cat([emb, x], dim=-1) if self.fc is not None else x
            h = rms(a_in, layer["norm1"])
            qkv = self.linear(h, layer["wqkv"])
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q = q.view(b, w, nh, hd).transpose(1, 2)
            kc[:, :, context:context + w].copy_(k.view(b, w, nkv, hd).transpose(1, 2))
            vc[:, :, context:context + w].copy_(v.view(b, w, nkv, hd).transpose(1, 2))
            o = attention(q, kc[:, :, :context + w], vc[:, :, :context + w], GQA[0])
            x = x + self.linear(o.transpose(1, 2).reshape(b, w, nh * hd), layer["wo"])
            g, u = self.linear(rms(x, layer["norm2"]), layer["wgu"]).chunk(2, dim=-1)
            x = x + self.linear(F.silu(g) * u, layer["wd"])
        return F.linear(rms(x, self.norm), self.lm)


def rms(x, weight, eps: float = 1e-6):
    import torch

    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


GQA = ["native"]


def attention(q, k, v, how: str = "native"):
    """q [B, heads, w, d] over k, v [B, kv_heads, n, d]. native: SDPA's enable_gqa; fold: the query heads sharing
    a KV head become w x group query rows of it (no mask, so the same result); expand: K/V repeated per head."""
    import torch.nn.functional as F

    b, nh, w, d = q.shape
    g = nh // k.shape[1]
    if how == "fold":
        qf = q.reshape(b, k.shape[1], g * w, d)         # heads are grouped by KV head: rows (group, width)
        return F.scaled_dot_product_attention(qf, k, v).reshape(b, nh, w, d)
    if how == "native":
        try:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        except TypeError:                               # PyTorch < 2.5: no enable_gqa
            pass
    return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1))


def sampler_step(logits):
    """vLLM's random sampling: softmax, then argmax of p / Exp(1) noise (the exponential race)."""
    import torch

    p = torch.softmax(logits, dim=-1)
    return (p / torch.empty_like(p).exponential_()).argmax(dim=-1)


def timed(fn, cuda: bool, warm: int = 3, reps: int = 10, graph: bool = True) -> float:
    """Median seconds of `fn`: captured once as a CUDA graph and replayed (graph False: launched eagerly, timed
    with CUDA events; CPU: run eagerly)."""
    if not cuda:
        fn()
        out = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return statistics.median(out)
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                      # eager warm-up: cuBLAS handles and workspaces
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph() if graph else None
    try:
        if g is None:
            raise RuntimeError("eager by request")
        with torch.cuda.graph(g):
            out_ref = fn()
        run = g.replay
    except RuntimeError as e:                           # never lose a run to one capture: time it eagerly
        if graph:
            print(f"  (CUDA graph capture failed, timed eagerly: {str(e).splitlines()[0][:120]})", flush=True)
        g, out_ref, run = None, None, fn
        torch.cuda.synchronize()
    for _ in range(warm):
        run()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del g, out_ref
    return statistics.median(times)


def open_device(cpu_run: bool, flag: str = "--dry-run", cpu_dtype=None):
    """A probe's (cuda, device, dtype): the GPU in bfloat16, or the CPU when `cpu_run` (its `flag`) checks the code
    (in `cpu_dtype`, default bfloat16); without either it exits naming the flag. Seeds torch."""
    import torch

    cuda = torch.cuda.is_available() and not cpu_run
    if not cuda and not cpu_run:
        raise SystemExit(f"no CUDA device: this probe measures a GPU ({flag} checks it on the CPU)")
    torch.manual_seed(0)
    return cuda, ("cuda" if cuda else "cpu"), (torch.bfloat16 if cuda or cpu_dtype is None else cpu_dtype)


def write_result(result: dict, out: str | None, probe: str, cuda: bool, cpu_label: str = "dry-run") -> Path:
    """`result` as JSON to `out`, default bench/results/<probe>_<gpu>.json (the GPU's short name from
    result["env"]["gpu"], `cpu_label` for a CPU run); returns the path."""
    gpu = result["env"]["gpu"].lower().replace("nvidia", "").strip().split()[0] if cuda else cpu_label
    path = Path(out or f"bench/results/{probe}_{gpu}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


class Clock:
    """The measuring budget: cells not started before it runs out are skipped (and counted)."""

    def __init__(self, budget_s: float):
        self.end, self.skipped = time.monotonic() + budget_s, 0

    def left(self) -> bool:
        return time.monotonic() < self.end


def grid_cells(stack: Stack, kind: str, batches, widths, contexts, max_kv: int, cuda: bool, clock: Clock,
               log) -> list[dict]:
    import torch

    out = []
    for n in contexts:
        for b in batches:
            ws = [w for w in widths if b * (n + w) <= max_kv]
            if not ws:
                continue
            if not clock.left():
                clock.skipped += len(ws)
                continue
            caches = stack.caches(b, n + max(ws))
            for w in ws:
                if not clock.left():
                    clock.skipped += 1
                    continue
                x, emb = stack.inputs(b, w)
                with torch.no_grad():
                    sec = timed(lambda: stack.step(x, emb, caches, n), cuda)
                out.append({"kind": kind, "batch": b, "width": w, "context": n, "seconds": sec})
                log(f"  {kind:<12} batch {b:>4} width {w} context {n:>5}: {sec * 1e3:8.3f} ms")
            caches = None                                 # freed before the next batch's
            if cuda:
                torch.cuda.empty_cache()
    return out


def env_rates(device, cuda: bool, dtype, small: bool) -> tuple[dict, dict]:
    """(env, copies): device copy rate, bf16 matmul rate, host/device copy rates."""
    import torch

    n = (1 << 20) if small else (1 << 30)                # elements of bf16: 2 MB / 2 GB
    src = torch.empty(n, dtype=dtype, device=device).normal_()
    dst = torch.empty_like(src)
    d2d = timed(lambda: dst.copy_(src), cuda, reps=5, graph=False)   # captured, it would run on the copy engines
    m = 256 if small else 8192
    a, b = (torch.randn(m, m, dtype=dtype, device=device) for _ in range(2))
    mm = timed(lambda: a @ b, cuda, reps=5)
    env = {"torch": torch.__version__, "d2d_rw_TBps": round(2 * src.numel() * 2 / d2d / 1e12, 3),
           "bf16_matmul_TFLOPs": round(2 * m ** 3 / mm / 1e12, 1)}
    if cuda:
        p = torch.cuda.get_device_properties(0)
        env.update({"gpu": p.name, "sms": p.multi_processor_count, "mem_gb": round(p.total_memory / 2**30, 1)})
    else:
        env.update({"gpu": "cpu (dry run)", "sms": 0, "mem_gb": 0})
    src = dst = a = b = None
    if not cuda:
        return env, {}
    nb = 1 << 28                                        # 512 MB of bf16
    dev = torch.empty(nb, dtype=dtype, device=device)
    pinned = torch.empty(nb, dtype=dtype, pin_memory=True)
    pageable = torch.empty(nb, dtype=dtype)

    def rate(fn):
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
        return round(nb * 2 / statistics.median(ts) / 1e9, 1)

    copies = {"h2d_pinned_GBps": rate(lambda: dev.copy_(pinned, non_blocking=True)),
              "d2h_pinned_GBps": rate(lambda: pinned.copy_(dev, non_blocking=True)),
              "h2d_pageable_GBps": rate(lambda: dev.copy_(pageable))}
    return env, copies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="default bench/results/gpu_step_probe_<gpu>.json")
    ap.add_argument("--target-config", help="a dense model's config.json (default: Qwen3-8B's shape)")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--widths", default="1,2,3,4,5")
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--max-kv-tokens", type=int, default=140_000, help="skip cells caching more tokens than this")
    ap.add_argument("--budget-s", type=float, default=150.0, help="seconds of measuring at most")
    ap.add_argument("--no-drafters", action="store_true")
    ap.add_argument("--no-env", action="store_true", help="skip env, copies and sampler")
    ap.add_argument("--gqa", choices=["native", "fold", "expand"], default="fold",
                    help="how attention serves grouped KV heads (see attention())")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, eager (checks the code)")
    args = ap.parse_args()
    import torch

    t0 = time.monotonic()
    cuda, device, dtype = open_device(args.dry_run)
    GQA[0] = args.gqa
    batches = [int(x) for x in args.batches.split(",")]
    widths = [int(x) for x in args.widths.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    kind, shape = shape_from_config(args.target_config) if args.target_config else ("qwen3-8b", QWEN3_8B)
    drafters = dict(DRAFTERS)
    if args.dry_run:
        kind, shape = "tiny", TINY
        drafters = {"tiny-eagle3-head": {**TINY, "layers": 1, "eagle3": True}, "tiny-draft": TINY}
        batches, contexts = [b for b in batches if b <= 4] or [1], [min(contexts)]
    clock = Clock(args.budget_s)

    def log(msg):
        print(msg, flush=True)

    result = {"what": (f"Decode-step times of an ideal engine (perf/gpu_step_probe.py): a {kind}-shaped model "
                       "with random bf16 weights, one CUDA graph per (batch, width, context), no scheduler; an EAGLE-3-"
                       "shaped head step and a Qwen3-0.6B-shaped draft-model step; a vLLM-style sampler; host/device "
                       "copy rates. Method: ../shared/reference/README.md."),
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes")}
    if not args.no_env:
        env, copies = env_rates(device, cuda, dtype, small=args.dry_run)
        result["env"], result["copies"] = env, copies
        log(f"env {env} copies {copies}")
    else:
        p = torch.cuda.get_device_properties(0) if cuda else None
        result["env"] = {"torch": torch.__version__, "gpu": p.name if p else "cpu (dry run)",
                         "sms": p.multi_processor_count if p else 0}
    target = Stack(shape, device, dtype)
    result["cells"] = grid_cells(target, kind, batches, widths, contexts, args.max_kv_tokens, cuda, clock, log)
    result["target_shape"] = {"kind": kind, **shape}
    del target
    if cuda:
        torch.cuda.empty_cache()
    result["drafters"] = []
    if not args.no_drafters:
        for name, s in drafters.items():
            st = Stack(s, device, dtype)
            result["drafters"] += grid_cells(st, name, batches, [1], contexts, args.max_kv_tokens, cuda, clock, log)
            del st
    if not args.no_env:
        result["sampler"] = []
        vocab = 1000 if args.dry_run else SAMPLER_VOCAB
        for b in [x for x in (1, 16, 64, 256) if x <= max(batches)] or [1]:
            for w in (1, 4):
                logits = torch.randn(b * w, vocab, device=device, dtype=torch.float32)
                sec = timed(lambda: sampler_step(logits), cuda)
                result["sampler"].append({"batch": b, "width": w, "vocab": vocab, "seconds": sec})
                log(f"  sampler      batch {b:>4} width {w}: {sec * 1e3:8.3f} ms")
    result["probe"] = {"args": vars(args), "seconds": round(time.monotonic() - t0, 1), "skipped_cells": clock.skipped}
    out = write_result(result, args.out, "gpu_step_probe", cuda)
    log(f"{len(result['cells'])} cells, {len(result['drafters'])} drafter cells"
        + (f", {clock.skipped} skipped (budget)" if clock.skipped else "")
        + f" in {time.monotonic() - t0:.0f} s; wrote {out}")


if __name__ == "__main__":
    main()
