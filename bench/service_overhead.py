"""Throughput through the service (gRPC client) vs the same vLLM engine called in-process, one run.

    .venv/bin/python bench/service_overhead.py [--model DIR] [--prompts 16] [--n 4] [--max-tokens 128]

Workload: P prompts x n samples, max_tokens new tokens each (ignore_eos, so every run generates the same
number of tokens), temperature 1.0, one request. The two paths alternate (in-process, service,
in-process, service, ...) so drift on this noisy machine hits both; the ratio is taken per pair and
the median reported. Same engine settings on both sides (one engine, same config).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

PROMPT_TEXT = "Solve step by step: a farmer has {a} apples and buys {b} more. How many apples does he have?"


def prompts_for(tok, count: int) -> list[list[int]]:
    out = []
    for i in range(count):
        ids = tok.apply_chat_template([{"role": "user", "content": PROMPT_TEXT.format(a=3 + i, b=7 * i + 2)}],
                                      add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


async def in_process_round(engine, prompts, n, max_tokens, tag) -> tuple[int, float]:
    from rollout_service.engine.types import SeqRequest

    seqs = [SeqRequest(seq_id=f"{tag}-{p}-{s}", prompt_token_ids=ids, temperature=1.0, max_tokens=max_tokens,
                       ignore_eos=True, seed=p * 100 + s) for p, ids in enumerate(prompts) for s in range(n)]
    t = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(q) for q in seqs))
    return sum(len(r.token_ids) for r in results), time.perf_counter() - t


def service_round(client, prompts, n, max_tokens) -> tuple[int, float]:
    t = time.perf_counter()
    tokens = sum(len(s.token_ids) for s in client.generate(prompts, n=n, max_tokens=max_tokens, temperature=1.0,
                                                            ignore_eos=True, seed=1))
    return tokens, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from rollout_client import RolloutClient
    from rollout_client.launcher import ServiceProcess
    from transformers import AutoTokenizer

    from rollout_service.cli import resolve_model
    from rollout_service.config import EngineConfig
    from rollout_service.engine.vllm_engine import VllmEngine

    model = resolve_model(args.model)
    prompts = prompts_for(AutoTokenizer.from_pretrained(model), args.prompts)
    cfg = EngineConfig()
    print(f"model {model}; {args.prompts} prompts x {args.n} samples x {args.max_tokens} tokens; "
          f"{args.rounds} alternating rounds (engine settings: {cfg})")

    # Both sides cannot hold the 2 cores at once, so each side starts, warms up, runs one round, stops.
    inproc, service = [], []
    for r in range(args.rounds):
        async def run_inproc():
            eng = VllmEngine("bench", model, cfg)
            await eng.start()
            await in_process_round(eng, prompts[:2], 1, 8, f"warm{r}")
            res = await in_process_round(eng, prompts, args.n, args.max_tokens, f"r{r}")
            await eng.shutdown()
            return res

        tok, sec = asyncio.run(run_inproc())
        inproc.append(tok / sec)
        print(f"round {r}: in-process {tok} tokens in {sec:.1f} s = {tok / sec:.1f} tok/s", flush=True)
        with ServiceProcess(model, log_path="bench/results/service_overhead.log") as svc, \
                RolloutClient(svc.target) as client:
            service_round(client, prompts[:2], 1, 8)
            tok, sec = service_round(client, prompts, args.n, args.max_tokens)
        service.append(tok / sec)
        print(f"round {r}: service    {tok} tokens in {sec:.1f} s = {tok / sec:.1f} tok/s", flush=True)
    ratios = [s / i for s, i in zip(service, inproc)]
    print(f"\nservice / in-process throughput, per round: {', '.join(f'{x:.3f}' for x in ratios)}")
    print(f"median ratio {statistics.median(ratios):.3f}  -> service overhead "
          f"{(1 - statistics.median(ratios)) * 100:+.1f}% (goal: under 3%)")


if __name__ == "__main__":
    main()
