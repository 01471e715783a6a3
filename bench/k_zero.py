"""What speculation costs when it drafts nothing: each method with k = 0 at every step against the plain engine,
interleaved in one run (not a test).

    .venv/bin/python bench/k_zero.py [--methods draft_model,eagle3,ngram] [--concurrency 8,32] [--rounds 2]
                                     [--draft-model DIR] [--eagle3-head DIR] [--auto]

Where the k controller (speculation/k_controller.py) decides that drafting does not pay, an engine runs k = 0;
what such a step still costs over a plain engine's step is the floor under the controller's worst case. Each
speculative engine is configured with k_by_batch_size = [[1, any, 0]] (vLLM's dynamic speculative decoding with
k 0 everywhere) and measured plain, k0, plain, k0, ... at each concurrency (same workload as
bench/speculation.py). Prints tok/s and the ratio per round.

--auto adds a third engine per method with the k controller (k_control = "auto", k up to 3) in the same rotation
(plain, k0, auto), and prints what the controller measured and chose: steps by k, and per batch bucket the step
time at each k and the k it settled on. A controlled engine that settles on k = 0 should run like the k0 one.
Results: bench/results/k_zero.json (--out; bench/harness.py's schema).

Start order biases engines that share one process: of several identical plain engines started one after another in
one process, each later one ran faster than the one before (three, one sequence, float32, rounds rotated: 44.0,
40.7, 39.6 ms a token in start order, and 43.0, 38.6, 37.0 in a second run; 2026-12-07). Their memory, huge pages,
OpenMP libraries and thread binding were the same; per-thread schedstat put the difference in the worker's own CPU
time (medians 81.8, 74.6, 71.9 ms of CPU a token over its two OpenMP threads; waiting 5.9-7.2 ms in each): the first
engine computes slower, it does not wait longer. Restarted mid-run (stopped, then started as the newest), it stayed
the slowest (41.1-43.7 ms against 37.9-42.5), as if the cost were in the memory the first engine had and its
successor took again (this VM's), not in the engine. Cause not found. So by default plain, started first, is
penalised; `--plain-last` starts it after the speculative engines: run both orders and report both (or their
geometric mean).
"""
from __future__ import annotations

import argparse
import asyncio

from harness import print_controller, spread, write_result
from speculation import Draw, Workload, held, start  # bench/speculation.py


async def run(args) -> None:
    from transformers import AutoTokenizer

    from rollout_service.cli import resolve_model
    from rollout_service.config import OPEN_BATCH, SpeculationConfig
    from rollout_service.drafting.drafters import default_drafter_dir

    model = resolve_model(args.model)
    drafters = {"draft_model": args.draft_model or str(default_drafter_dir("draft_model")),
                "eagle3": args.eagle3_head or str(default_drafter_dir("eagle3")), "ngram": ""}
    conc = [int(x) for x in args.concurrency.split(",")]
    n_of = {c: max(8, c * args.samples_per_slot) for c in conc}
    work = Workload(AutoTokenizer.from_pretrained(model))
    plain = None if args.plain_last else await start(model, SpeculationConfig())
    rows = []
    try:
        for method in args.methods.split(","):
            eng = await start(model, SpeculationConfig(method=method, model=drafters[method], num_speculative_tokens=3,
                                                       k_by_batch_size=[(1, OPEN_BATCH, 0)]))
            auto = await start(model, SpeculationConfig(method=method, model=drafters[method], num_speculative_tokens=3,
                                                        k_control="auto")) if args.auto else None
            if args.plain_last:
                plain = await start(model, SpeculationConfig())
            try:
                for c in conc:
                    for r in range(args.rounds):
                        prompts = Draw(work, n_of[c])            # one draw for the round's engines
                        p = await held(plain, prompts, c, n_of[c], args.max_tokens, "plain")
                        s = await held(eng, prompts, c, n_of[c], args.max_tokens, f"{method} k=0")
                        a = await held(auto, prompts, c, n_of[c], args.max_tokens, f"{method} auto") if auto else None
                        rows.append((method, c, r, p["tok_s"], s["tok_s"], a["tok_s"] if a else None))
                        print(f"{method:<11} conc {c:>2} round {r}: plain {p['tok_s']:7.1f} tok/s, "
                              f"k=0 {s['tok_s']:7.1f} "
                              f"tok/s, ratio {s['tok_s'] / p['tok_s']:.3f}"
                              + (f"; auto {a['tok_s']:7.1f} tok/s, ratio {a['tok_s'] / p['tok_s']:.3f}" if a else ""),
                              flush=True)
                if auto:
                    print_controller(method, await auto.k_control_snapshot())
            finally:
                await eng.shutdown()
                if auto:
                    await auto.shutdown()
                if args.plain_last:
                    await plain.shutdown()
    finally:
        if plain is not None and not args.plain_last:
            await plain.shutdown()
    print("\nmethod       conc  k=0 / plain (mean of rounds)" + ("   auto / plain" if args.auto else ""))
    for method in dict.fromkeys(m for m, *_ in rows):
        for c in conc:
            ratios = [s / p for m, cc, _, p, s, _a in rows if m == method and cc == c]
            line = f"{method:<11} {c:>5}  {sum(ratios) / len(ratios):.3f}  ({', '.join(f'{x:.3f}' for x in ratios)})"
            if args.auto:
                autos = [a / p for m, cc, _, p, _s, a in rows if m == method and cc == c]
                line += f"   {sum(autos) / len(autos):.3f}  ({', '.join(f'{x:.3f}' for x in autos)})"
            print(line)
    cell = lambda m, c, i: spread(r[i] / r[3] for r in rows if r[:2] == (m, c))       # noqa: E731
    summary = [{"method": m, "concurrency": c, "k0_ratio": cell(m, c, 4), "auto_ratio": cell(m, c, 5) if args.auto
                else None} for m in dict.fromkeys(m for m, *_ in rows) for c in conc]
    keys = ("method", "concurrency", "round", "plain_tok_s", "k0_tok_s", "auto_tok_s")
    print("results:", write_result("k_zero", vars(args), summary, [dict(zip(keys, r)) for r in rows], args.out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--methods", default="draft_model,eagle3,ngram")
    ap.add_argument("--draft-model", help="draft_model drafter (default: `rollout-service prepare-drafter`'s)")
    ap.add_argument("--eagle3-head", help="EAGLE-3 head (default: `prepare-drafter --kind eagle3`'s)")
    ap.add_argument("--concurrency", default="8,32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--samples-per-slot", type=int, default=2)
    ap.add_argument("--auto", action="store_true", help="also an engine with the k controller (see above)")
    ap.add_argument("--plain-last", action="store_true", help="start the plain engine after the speculative ones "
                    "(see above: run both orders and take both)")
    ap.add_argument("--out", default=None, help="default bench/results/k_zero.json")
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
