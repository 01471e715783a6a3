"""Speculation on vs off on an RL-shaped workload, side by side in one run (not a test).

    .venv/bin/python bench/speculation.py [--draft-model DIR] [--eagle3-head DIR]
                                          [--methods draft_model,eagle3,ngram] [--ks 1,2,3,5]
                                          [--concurrency 1,8,32] [--max-tokens 256] [--singles 6]

Workload: prompts from the trainer example's task (chat template), groups of 4 samples (concurrency 1
runs `--singles` single samples one after another), up to 256 new tokens, temperature 1.0, natural EOS.
Same engine settings, prompts and seeds for every configuration. For each (method, k, concurrency):
throughput ratio against the plain engine, acceptance rate a, mean acceptance length, the drafter's measured cost c, and the
analytical speedup bound (1 - a^(k+1)) / ((1 - a)(1 + c k)). c is one drafter step over one target step:
for the draft model both run as plain vLLM engines at the same concurrency; an EAGLE-3 head cannot run
alone in vLLM, so its c is one head step over one target forward, both timed in PyTorch in this process at
the same batch (it leaves out vLLM's per-step overhead of drafting); 0 for n-gram.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import time

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def bound(a: float, k: int, c: float) -> float:
    if a >= 1.0:
        return (k + 1) / (1 + c * k)
    return (1 - a ** (k + 1)) / ((1 - a) * (1 + c * k))


async def run_config(model: str, spec, prompts, concurrency: list[int], max_tokens: int, singles: int) -> dict:
    from rollout_service.config import EngineConfig
    from rollout_service.engine.types import SeqRequest
    from rollout_service.engine.vllm_engine import VllmEngine

    eng = VllmEngine("bench", model, EngineConfig(max_model_len=1024, kv_cache_gb=2, speculation=spec))
    await eng.start()
    out = {}
    try:
        await eng.generate(SeqRequest(seq_id="warm", prompt_token_ids=prompts[0], max_tokens=8))
        for c in concurrency:
            if c == 1:
                batches = [[(p, 0)] for p in range(singles)]    # single samples, one after the other
            else:
                batches = [[(p, s) for p in range(c // 4) for s in range(4)]]
            tokens = drafted = accepted = steps = 0
            t = time.perf_counter()
            for b in batches:
                res = await asyncio.gather(*(eng.generate(SeqRequest(
                    seq_id=f"c{c}-{p}-{s}-{time.monotonic_ns()}", prompt_token_ids=prompts[p], temperature=1.0,
                    max_tokens=max_tokens, seed=1000 * p + s)) for p, s in b))
                for r in res:
                    tokens += len(r.token_ids)
                    drafted += r.num_drafted
                    accepted += r.num_accepted
                    steps += r.spec_steps
            wall = time.perf_counter() - t
            out[c] = dict(tok_s=tokens / wall, a=accepted / drafted if drafted else 0.0,
                          mal=1 + accepted / steps if steps else 1.0, tokens=tokens)
            print(f"    concurrency {c:>2}: {tokens} tokens, {tokens / wall:6.1f} tok/s", flush=True)
    finally:
        await eng.shutdown()
    return out


def eagle3_cost(model: str, head_dir: str, concurrency: list[int], ctx: int = 32, reps: int = 3) -> dict:
    """One head step / one target forward at equal batch and length, timed in PyTorch (see the docstring)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollout_service.speculation.eagle3 import load_head

    target = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    head = load_head(head_dir, target).eval()
    out = {}
    with torch.no_grad():
        for c in concurrency:
            ids = torch.randint(0, 1000, (c, ctx))
            aux = torch.randn(c, ctx, head.fc.in_features)
            times = []
            for fn in (lambda: target(input_ids=ids), lambda: head.unroll(aux, ids, 1)):
                fn()
                t = time.perf_counter()
                for _ in range(reps):
                    fn()
                times.append(time.perf_counter() - t)
            out[c] = times[1] / times[0]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--draft-model")
    ap.add_argument("--eagle3-head", help="EAGLE-3 head (default: `rollout-service prepare-drafter --kind eagle3`)")
    ap.add_argument("--methods", default="draft_model,eagle3,ngram")
    ap.add_argument("--ks", default="1,2,3,5")
    ap.add_argument("--ngram-ks", default="3", help="k values for ngram (it rarely proposes on this task)")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--singles", type=int, default=6, help="samples run one after another at concurrency 1")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from rollout_service.cli import resolve_model
    from rollout_service.config import SpeculationConfig
    from rollout_service.speculation.drafters import default_drafter_dir, task_prompts

    model = resolve_model(args.model)
    drafter = args.draft_model or str(default_drafter_dir("draft_model"))
    head = args.eagle3_head or str(default_drafter_dir("eagle3"))
    conc = [int(x) for x in args.concurrency.split(",")]
    prompts = task_prompts(AutoTokenizer.from_pretrained(model), max(max(conc) // 4, args.singles),
                           start=50_000)
    print(f"target {model}\ndrafter {drafter}\nEAGLE-3 head {head}\nconcurrency {conc}, max_tokens {args.max_tokens}, temperature 1.0")

    print("plain target:", flush=True)
    plain = asyncio.run(run_config(model, SpeculationConfig(), prompts, conc, args.max_tokens, args.singles))
    methods = args.methods.split(",")
    cost = {m: {c: 0.0 for c in conc} for m in methods}
    if "draft_model" in methods:
        print("drafter alone (for its cost c):", flush=True)
        alone = asyncio.run(run_config(drafter, SpeculationConfig(), prompts, conc, args.max_tokens, args.singles))
        cost["draft_model"] = {c: plain[c]["tok_s"] / alone[c]["tok_s"] for c in conc}   # step time ratio
    if "eagle3" in methods:
        cost["eagle3"] = eagle3_cost(model, head, conc)
        print("EAGLE-3 head step / target step (PyTorch): "
              + ", ".join(f"{c}: {v:.3f}" for c, v in cost["eagle3"].items()), flush=True)
    rows = []
    for method in methods:
        ks = [int(k) for k in (args.ks if method != "ngram" else args.ngram_ks).split(",")]
        for k in ks:
            spec = SpeculationConfig(method=method, num_speculative_tokens=k,
                                     model={"draft_model": drafter, "eagle3": head}.get(method, ""),
                                     prompt_lookup_min=2, prompt_lookup_max=5)
            print(f"{method} k={k}:", flush=True)
            res = asyncio.run(run_config(model, spec, prompts, conc, args.max_tokens, args.singles))
            for c in conc:
                cc = cost[method][c]
                r = res[c]
                b = bound(r["a"], k, cc)
                rows.append((method, k, c, plain[c]["tok_s"], r["tok_s"], r["tok_s"] / plain[c]["tok_s"], r["a"],
                             r["mal"], cc, b))
    print("\nmethod       k  conc  plain tok/s  spec tok/s  speedup  accept a  mean acc len  cost c  bound  speedup/bound")
    for m, k, c, p, s, ratio, a, mal, cc, b in rows:
        print(f"{m:<12} {k:>1} {c:>5} {p:>12.1f} {s:>11.1f} {ratio:>8.2f} {a:>9.3f} {mal:>13.2f} {cc:>7.2f} "
              f"{b:>6.2f} {ratio / b:>14.2f}")


if __name__ == "__main__":
    main()
