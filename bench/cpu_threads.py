"""vLLM's CPU thread binding: "auto" vs every usable core, side by side in one run (not a test).

    .venv/bin/python bench/cpu_threads.py [--rounds 2] [--concurrency 1,8] [--max-tokens 256]

vLLM's "auto" VLLM_CPU_OMP_THREADS_BIND leaves a core per NUMA node to the front end; on a 2-core machine
the engine then computes on one core. The service binds the engine to every usable core on machines with
at most engine.cpu_env.SMALL_MACHINE_CPUS of them. This runs the plain engine (the bench/speculation.py
workload: the trainer task's prompts, groups of 4, temperature 1.0) under both settings, alternating
rounds so drift on this noisy machine hits both, and prints tokens/s and the ratio per round.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()

    from speculation import run_config
    from transformers import AutoTokenizer

    from rollout_service.cli import resolve_model
    from rollout_service.config import SpeculationConfig
    from rollout_service.engine.cpu_env import cpu_list
    from rollout_service.drafting.drafters import task_prompts

    model = resolve_model(args.model)
    conc = [int(x) for x in args.concurrency.split(",")]
    prompts = task_prompts(AutoTokenizer.from_pretrained(model), max(conc) // 4 + 2, start=50_000)
    cores = cpu_list(sorted(os.sched_getaffinity(0)))
    settings = {"auto": "auto", "all cores": cores}
    print(f"model {model}; usable CPUs {cores}; concurrency {conc}; max_tokens {args.max_tokens}")
    results = []                                   # (round, setting, {c: tok/s})
    for r in range(args.rounds):
        for name, value in settings.items():
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = value
            print(f"round {r + 1}, VLLM_CPU_OMP_THREADS_BIND={value}:", flush=True)
            res = asyncio.run(run_config(model, SpeculationConfig(), prompts, conc, args.max_tokens))
            results.append((r, name, {c: res[c]["tok_s"] for c in conc}))
    print("\nround  concurrency  auto tok/s  all-cores tok/s  all-cores / auto")
    for r in range(args.rounds):
        auto = next(x for rr, n, x in results if rr == r and n == "auto")
        full = next(x for rr, n, x in results if rr == r and n == "all cores")
        for c in conc:
            print(f"{r + 1:>5} {c:>12} {auto[c]:>11.1f} {full[c]:>16.1f} {full[c] / auto[c]:>17.2f}")


if __name__ == "__main__":
    main()
