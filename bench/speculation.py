"""Speculation on vs off on an RL-shaped workload, side by side in one run (not a test).

    .venv/bin/python bench/speculation.py [--draft-model DIR] [--eagle3-head DIR]
                                          [--methods draft_model,eagle3,ngram] [--ks 1,2,3,5]
                                          [--concurrency 1,8,32] [--max-tokens 256] [--samples-per-slot 6]
                                          [--k-by-batch-size 1-1:3,2-8:1,9-:0]

Workload: prompts from the trainer example's task (chat template), groups of 4 samples, up to 256 new
tokens, temperature 1.0, natural EOS. Each concurrency C is held: C sequences stay in flight (a finished one
is replaced by the next sample) until max(16, C * --samples-per-slot) samples finished, so a batch does not
drain to its longest sample and the measurement covers thousands of tokens. Same engine settings, prompts
and seeds for every configuration. For each (method, k, concurrency): the throughput ratio against the
plain engine, vLLM's acceptance rate (accepted / drafted), the mean acceptance length L, the per-token
acceptance a solved from L (rollout_service/speculation/speedup.py: accepted / drafted is not a when k > 1),
the drafter's measured cost c, the analytical bound (1 - a^(k+1)) / ((1 - a)(1 + c k)), and a speculative
step's measured time over a plain step (the bound assumes 1 + c k). c is one drafter step over one target
step: for the draft model both run as plain vLLM engines at the same concurrency; an EAGLE-3 head cannot
run alone in vLLM, so its c is one head step over one target forward, both timed in PyTorch in this process
at the same batch (it leaves out vLLM's per-step overhead of drafting); 0 for n-gram.
With --k-by-batch-size, each method also runs once with that schedule (engine.speculation.k_by_batch_size:
k chosen per step by the engine's batch size, 0 = no drafting): rows with k `dyn`, whose bound uses the
drafts per verify step measured in the run and which show what the service does where speculation loses.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import time

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


async def held(eng, prompts, c: int, n: int, max_tokens: int) -> tuple[list, float]:
    """`n` samples with `c` of them in flight at all times (until fewer than c are left): (results, wall s)."""
    from tqdm import tqdm

    from rollout_service.engine.types import SeqRequest

    todo = iter(range(n))                  # sample j: prompt j // 4, so a group's samples run together
    results = []
    bar = tqdm(total=n, desc=f"    concurrency {c}", unit="sample", leave=False)

    async def slot():
        for j in todo:
            results.append(await eng.generate(SeqRequest(
                seq_id=f"c{c}-{j}-{time.monotonic_ns()}", prompt_token_ids=prompts[j // 4], temperature=1.0,
                max_tokens=max_tokens, seed=1000 + j)))
            bar.update()
    t = time.perf_counter()
    await asyncio.gather(*(slot() for _ in range(c)))
    wall = time.perf_counter() - t
    bar.close()
    return results, wall


async def run_config(model: str, spec, prompts, concurrency: list[int], max_tokens: int, per_slot: int) -> dict:
    from rollout_service.config import EngineConfig
    from rollout_service.engine.types import SeqRequest
    from rollout_service.engine.vllm_engine import VllmEngine

    eng = VllmEngine("bench", model, EngineConfig(max_model_len=1024, kv_cache_gb=2, speculation=spec))
    await eng.start()
    out = {}
    try:
        await eng.generate(SeqRequest(seq_id="warm", prompt_token_ids=prompts[0], max_tokens=8))
        for c in concurrency:
            n = max(16, c * per_slot)
            results, wall = await held(eng, prompts, c, n, max_tokens)
            tokens = sum(len(r.token_ids) for r in results)
            drafted = sum(r.num_drafted for r in results)
            accepted = sum(r.num_accepted for r in results)
            steps = sum(r.spec_steps for r in results)
            out[c] = {"tok_s": tokens / wall, "rate": accepted / drafted if drafted else 0.0,
                      "mal": 1 + accepted / steps if steps else 1.0, "k": drafted / steps if steps else 0.0}
            print(f"    concurrency {c:>2}: {n} samples, {tokens} tokens, {tokens / wall:6.1f} tok/s", flush=True)
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
    ap.add_argument("--samples-per-slot", type=int, default=6,
                    help="samples measured per concurrent sequence (at least 16 in all)")
    ap.add_argument("--k-by-batch-size", metavar="FIRST-LAST:K,...",
                    help="also run each method with this k schedule (as `serve --k-by-batch-size`)")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from rollout_service.cli import resolve_model
    from rollout_service.config import SpeculationConfig, parse_k_schedule
    from rollout_service.speculation.drafters import default_drafter_dir, task_prompts
    from rollout_service.speculation.speedup import per_token_acceptance, speedup_bound, step_cost

    model = resolve_model(args.model)
    drafter = args.draft_model or str(default_drafter_dir("draft_model"))
    head = args.eagle3_head or str(default_drafter_dir("eagle3"))
    conc = [int(x) for x in args.concurrency.split(",")]
    n_samples = max(16, max(conc) * args.samples_per_slot)
    prompts = task_prompts(AutoTokenizer.from_pretrained(model), (n_samples + 3) // 4, start=50_000)
    print(f"target {model}\ndrafter {drafter}\nEAGLE-3 head {head}\nconcurrency {conc}, max_tokens {args.max_tokens}, temperature 1.0")

    print("plain target:", flush=True)
    plain = asyncio.run(run_config(model, SpeculationConfig(), prompts, conc, args.max_tokens, args.samples_per_slot))
    methods = args.methods.split(",")
    cost = {m: {c: 0.0 for c in conc} for m in methods}
    if "draft_model" in methods:
        print("drafter alone (for its cost c):", flush=True)
        alone = asyncio.run(run_config(drafter, SpeculationConfig(), prompts, conc, args.max_tokens, args.samples_per_slot))
        cost["draft_model"] = {c: plain[c]["tok_s"] / alone[c]["tok_s"] for c in conc}   # step time ratio
    if "eagle3" in methods:
        cost["eagle3"] = eagle3_cost(model, head, conc)
        print("EAGLE-3 head step / target step (PyTorch): "
              + ", ".join(f"{c}: {v:.3f}" for c, v in cost["eagle3"].items()), flush=True)
    schedule = parse_k_schedule(args.k_by_batch_size) if args.k_by_batch_size else []
    rows = []
    for method in methods:
        ks = [int(k) for k in (args.ks if method != "ngram" else args.ngram_ks).split(",")]
        configs = [(k, []) for k in ks] + ([(max(r[2] for r in schedule), schedule)] if schedule else [])
        for k, sched in configs:
            spec = SpeculationConfig(method=method, num_speculative_tokens=k, k_by_batch_size=sched,
                                     model={"draft_model": drafter, "eagle3": head}.get(method, ""),
                                     prompt_lookup_min=2, prompt_lookup_max=5)
            print(f"{method} k={k}{f' by batch size {args.k_by_batch_size}' if sched else ''}:", flush=True)
            res = asyncio.run(run_config(model, spec, prompts, conc, args.max_tokens, args.samples_per_slot))
            for c in conc:
                r, p = res[c], plain[c]["tok_s"]
                kk = r["k"] if sched else k          # drafts per verify step (0: the schedule drafted nothing)
                kd = max(1, round(kk))               # whole drafts per step, for solving a and the bound
                a = per_token_acceptance(r["mal"], kd) if kk else 0.0
                # k 0: no drafts; the bound charges one drafter pass per step (vLLM's llm_base_proposer runs one
                # to keep the drafter's KV cache in sync)
                bound = speedup_bound(a, kd, cost[method][c]) if kk else 1 / (1 + cost[method][c])
                rows.append((method, "dyn" if sched else str(k), c, p, r["tok_s"], r["tok_s"] / p, r["rate"],
                             r["mal"], a, cost[method][c], bound, step_cost(r["mal"], p, r["tok_s"]), kk))
    # step: a speculative step's time over a plain step's (the bound assumes 1 + c k); effective c: (step - 1) / k,
    # the drafter cost that --draft-cost should be given for GetStatus's expected speedup to match this run.
    print("\nmethod         k  conc  plain tok/s  spec tok/s  speedup  accepted/drafted  mean acc len  per-token a"
          "  cost c  bound  speedup/bound  step  (1+ck)  effective c")
    for m, k, c, p, s, ratio, rate, mal, a, cc, b, st, kk in rows:
        eff = f"{(st - 1) / kk:>12.2f}" if kk else f"{'-':>12}"
        print(f"{m:<12} {k:>3} {c:>5} {p:>12.1f} {s:>11.1f} {ratio:>8.2f} {rate:>17.3f} {mal:>13.2f} {a:>12.3f}"
              f" {cc:>7.2f} {b:>6.2f} {ratio / b:>14.2f} {st:>5.2f} {1 + cc * kk:>7.2f} {eff}")


if __name__ == "__main__":
    main()
