"""A second look at cells of bench/speculation.py (not a test): one method at some concurrencies, paired draws
served in turn (order rotating) by the plain engine, the method under the k controller ("auto") and the same
controlled engine with every k = 0 step's drafter switched off and no exploration ("off": what the controller's
off steps cost by themselves, without the k = 1 steps it spends re-trying drafting). Ratios to plain, pooled over
the rounds and per round, and the auto engine's steps by k in each batch-size bucket.

    .venv/bin/python bench/speculation_repeat.py draft_model 4 --rounds 6 --draft-model runs/drafter-cut
    .venv/bin/python bench/speculation_repeat.py ngram 8,16
    .venv/bin/python bench/speculation_repeat.py suffix 32 --auto-env ROLLOUT_K_CONTROL_MARGIN=0.15
    .venv/bin/python bench/speculation_repeat.py ngram 4 --auto-env ROLLOUT_K_CONTROL_EXPLORE_EVERY=160

--auto-env sets the controller's knobs (rollout_service/speculation/k_scheduler.py) for the auto engine only.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
from speculation import SETTLE_S, Draw, Workload, held, off_share, pooled, start, steps_share  # noqa: E402

OFF_ENV = {"ROLLOUT_K_CONTROL_FORCE_OFF": "1", "ROLLOUT_K_CONTROL_EXPLORE_EVERY": str(10 ** 9)}


def step_profile(steps: list[list] | None, t0: float, t1: float) -> dict | None:
    """A controlled engine's steps that finished between t0 and t1 (perf_counter, one clock for both processes):
    how many, their seconds by k and with the drafter off, and the slowest three."""
    if steps is None:
        return None
    inside = [s for s in steps if t0 <= s[0] <= t1]
    by_k: dict[str, list] = {}
    for _, _, k, off, sec, _ in inside:
        row = by_k.setdefault(f"{k}{' off' if off else ''}", [0, 0.0])
        row[0] += 1
        row[1] = round(row[1] + sec, 3)
    slowest = sorted(inside, key=lambda s: -s[4])[:3]
    return {"steps": len(inside), "step_s": round(sum(s[4] for s in inside), 3), "wall_s": round(t1 - t0, 3),
            "by_k": by_k, "slowest": [{"ms": round(s[4] * 1e3, 1), "batch": s[1], "k": s[2]} for s in slowest]}


def bucket_steps(before: dict, after: dict) -> dict[str, list[int]]:
    """Steps scheduled between two controller snapshots, by batch-size bucket and k."""
    was = {r["batch"]: r["steps_by_k"] for r in before["buckets"]}
    return {r["batch"]: [x - y for x, y in zip(r["steps_by_k"], was.get(r["batch"], [0] * len(r["steps_by_k"])))]
            for r in after["buckets"]}


async def main(args) -> list[dict]:
    from transformers import AutoTokenizer

    from rollout_service.cli import resolve_model
    from rollout_service.config import SpeculationConfig
    from rollout_service.drafting.drafters import default_drafter_dir

    model = resolve_model(None)
    work = Workload(AutoTokenizer.from_pretrained(model))
    drafter = args.draft_model or (str(default_drafter_dir(args.method))
                                   if args.method in ("draft_model", "eagle3") else "")
    auto_env = dict(kv.split("=", 1) for kv in args.auto_env)
    spec = SpeculationConfig(k_control="auto", method=args.method, model=drafter, num_speculative_tokens=3,
                             prompt_lookup_min=2, prompt_lookup_max=5)
    engines = {"plain": await start(model, SpeculationConfig()),
               "auto": await start(model, spec, env=auto_env),
               "off": await start(model, spec, env=OFF_ENV)}
    cells = []
    try:
        for c in args.concurrency:                     # the controllers' first minutes of serving
            for name in ("auto", "off"):
                await held(engines[name], work, c, max(args.min_samples, 2 * c), 64, "warm-up")
        for c in args.concurrency:
            n = max(args.min_samples, 2 * c)           # as bench/speculation.py's default
            runs: dict[str, list[dict]] = {name: [] for name in engines}
            snap0 = await engines["auto"].k_control_snapshot()
            names = list(engines)
            for rnd in range(args.rounds):
                draw = Draw(work, n)
                for name in names[rnd % 3:] + names[:rnd % 3]:
                    await asyncio.sleep(SETTLE_S)
                    t0 = time.perf_counter()
                    runs[name].append(await held(engines[name], draw, c, n, args.max_tokens, name))
                    runs[name][-1]["profile"] = step_profile(await engines[name].k_control_steps(), t0,
                                                             time.perf_counter())
                print(f"  round {rnd} conc {c}: " + ", ".join(
                    f"{name} {runs[name][-1]['tok_s'] / runs['plain'][-1]['tok_s']:.3f}" for name in ("auto", "off")),
                    flush=True)
                for name in ("auto", "off"):
                    print(f"    {name}: {json.dumps(runs[name][-1]['profile'])}", flush=True)
            snap1 = await engines["auto"].k_control_snapshot()
            p = pooled(runs["plain"])["tok_s"]
            cell = {"method": args.method, "drafter": Path(drafter).name if drafter else "", "concurrency": c,
                    "rounds": args.rounds, "samples_per_round": n, "plain_tok_s": round(p, 2),
                    "auto_env": auto_env, "auto_k_share": steps_share(snap0, snap1),
                    "auto_drafter_off_share": off_share(snap0, snap1),
                    "auto_steps_by_bucket": {b: v for b, v in bucket_steps(snap0, snap1).items() if any(v)}}
            for name in ("auto", "off"):
                cell[f"{name}_speedup"] = round(pooled(runs[name])["tok_s"] / p, 3)
                cell[f"{name}_by_round"] = [round(x["tok_s"] / y["tok_s"], 3)
                                            for x, y in zip(runs[name], runs["plain"])]
                cell[f"{name}_steps_by_round"] = [x["profile"] for x in runs[name]]
            cells.append(cell)
            print(json.dumps(cell), flush=True)
        print(f"auto controller: {await engines['auto'].k_control_snapshot()}", flush=True)
    finally:
        for eng in engines.values():
            await eng.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps(cells, indent=1) + "\n")
    return cells


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("method", choices=["ngram", "suffix", "draft_model", "eagle3"])
    ap.add_argument("concurrency", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--min-samples", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft-model", default=None, help="the drafter (default: the method's built-in one)")
    ap.add_argument("--auto-env", action="append", default=[], metavar="VAR=VALUE",
                    help="an environment variable for the auto engine (the controller's knobs)")
    ap.add_argument("--json", default=None, help="write the cells here")
    asyncio.run(main(ap.parse_args()))
