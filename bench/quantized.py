"""Int8 rollouts against float32 (engine.quantization): generation throughput, the log-prob mismatch per token, and
an FP8 projection for GPU nodes, in one run (not a test).

    .venv/bin/python bench/quantized.py [--model DIR] [--concurrency 1,16] [--n 4] [--max-tokens 64] [--rounds 2]
                                        [--out bench/results/quantized.json]

Two services on the same float checkpoint (default: SmolLM2-135M-Instruct), float32 (`A`) and `--quantization int8`
(`B`), started one at a time (one vLLM process at a time on 2 cores), A B, B A, ... (`--rounds` pairs, the order
rotating: bench/harness.py).
In each service, for each concurrency, one batch of `concurrency` prompts x n samples of max_tokens tokens
(ignore_eos, T 1.0, rollout_tasks' prompts): throughput is generated tokens over the batch's wall time. The ratio
int8 / float32 is taken per round (B against that round's A) and its median and range reported.

Mismatch: on the first int8 service's samples (--mismatch-prompts x 2, T 1.0), the served int8 log-probs against
an independent float32 forward pass of the same checkpoint (transformers): mean |delta log p| per token and
KL(int8 || float32) by the k3 estimator; and against the independent int8 forward pass (drafting/reference.py
int8_w8a8, modelling this CPU's int16 pair saturation) on the first --reference-samples samples: the proof that the
samples carry the served policy's log-probs on the real model.

Projection: FP8 against bf16 decode steps on H200 and GB200 from the performance model (perfmodel/step.py's fitted
step form), weights at 1 byte per parameter and twice the dense FLOP/s (FP8 tensor cores), KV cache left in bf16.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

from harness import ROOT, logs_dir, services, spread, turns, write_result

ARMS = {"float32": [], "int8": ["--quantization", "int8"]}


def batch(client, prompts, n: int, max_tokens: int, seed: int) -> dict:
    t0 = time.perf_counter()
    groups = client.generate_all(prompts, n=n, max_tokens=max_tokens, ignore_eos=True, temperature=1.0, seed=seed)
    wall = time.perf_counter() - t0
    tokens = sum(len(s.token_ids) for g in groups for s in g)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall}


def mismatch(client, model_dir: str, prompts, max_tokens: int, reference_samples: int) -> dict:
    """Served int8 log-probs against float32 and int8 forward passes of the checkpoint (module docstring)."""
    import copy

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from rollout_service.drafting.reference import int16_pair_saturation, int8_w8a8, processed_logprobs

    groups = client.generate_all(prompts, n=2, max_tokens=max_tokens, ignore_eos=True, temperature=1.0, seed=99)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    d = []
    for p, group in enumerate(groups):
        for s in group:
            ref = processed_logprobs(model, prompts[p], s.token_ids.tolist(), 1.0, 0, 1.0).numpy()
            d.append(ref - s.logprobs)                        # log p_float32 - log p_int8 on int8's samples
    d = np.concatenate(d)
    q = int8_w8a8(copy.deepcopy(model))
    err = []
    for p, group in enumerate(groups):
        for s in group:
            if len(err) < reference_samples:
                ref = processed_logprobs(q, prompts[p], s.token_ids.tolist(), 1.0, 0, 1.0).numpy()
                err.append(np.abs(ref - s.logprobs))
    err = np.concatenate(err)
    return {"tokens": int(d.size), "mean_abs_dlogp": float(np.abs(d).mean()),
            "p99_abs_dlogp": float(np.quantile(np.abs(d), 0.99)), "kl_k3": float((np.expm1(d) - d).mean()),
            "reference_tokens": int(err.size), "reference_max_abs": float(err.max()),
            "reference_mean_abs": float(err.mean()), "int16_pair_saturation": int16_pair_saturation()}


def fp8_projection() -> list[dict]:
    """FP8 / bf16 decode-step speedup on H200 and GB200 (perfmodel), dense and MoE, by batch size."""
    from rollout_service.perfmodel.hardware import GB200, H200
    from rollout_service.perfmodel.model import from_config
    from rollout_service.perfmodel.step import forward

    configs = ROOT / "rollout_service/perfmodel/configs"
    rows = []
    for name in ("qwen3-8b", "qwen3-30b-a3b"):
        m = from_config(json.loads((configs / f"{name}.json").read_text()), name)
        for hw in (H200, GB200):
            fp8 = dataclasses.replace(hw, bytes_per_param=1.0, flops=2 * hw.flops)
            for b in (1, 16, 64, 256):
                bf16_s = forward(m, hw, b, 1, 1024).seconds
                fp8_s = forward(m, fp8, b, 1, 1024).seconds
                rows.append({"model": name, "hardware": hw.name, "batch": b, "context": 1024,
                             "bf16_step_ms": bf16_s * 1e3, "fp8_step_ms": fp8_s * 1e3, "speedup": bf16_s / fp8_s})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="float checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--mismatch-prompts", type=int, default=16)
    ap.add_argument("--reference-samples", type=int, default=4)
    ap.add_argument("--out", default=None, help="default bench/results/quantized.json")
    args = ap.parse_args()

    from rollout_client import RolloutClient
    from rollout_service.cli import resolve_model
    from rollout_service.model_info import ModelInfo
    from rollout_tasks.arithmetic import split

    model = resolve_model(args.model)
    info = ModelInfo.load(model, 1024)
    prompts = [info.encode(p.prompt, chat=True) for p in split(64)]
    levels = [int(x) for x in args.concurrency.split(",")]
    common = ["--dtype", "float32", "--max-model-len", "1024", "--kv-cache-gb", "2", "--max-num-seqs", "64"]
    config = {"model": model, "n": args.n, "max_tokens": args.max_tokens, "concurrency": levels, "service": common}
    logs = logs_dir("quantized")
    runs, found = [], None
    for r in range(args.rounds):
        for arm in turns(ARMS, r):
            t0 = time.perf_counter()
            with services(model, {arm: common + ARMS[arm]}, logs) as up, RolloutClient(up[arm].target) as c:
                start_s = time.perf_counter() - t0
                served = c.status().quantization
                assert served.method == ("none" if arm == "float32" else "int8"), served
                c.generate_all(prompts[:2], n=1, max_tokens=8)          # warm-up
                for conc in levels:
                    picked = [prompts[(r * conc + i) % len(prompts)] for i in range(conc)]
                    res = batch(c, picked, args.n, args.max_tokens, seed=r)
                    runs.append({"round": r, "arm": arm, "concurrency": conc, "start_s": start_s, **res})
                    print(f"round {r} {arm:>7} concurrency {conc:>3}: {res['tok_s']:7.1f} tok/s", flush=True)
                if arm == "int8" and found is None:
                    found = mismatch(c, model, prompts[:args.mismatch_prompts], args.max_tokens,
                                     args.reference_samples)
                    print(f"mismatch: {json.dumps(found)}", flush=True)
            # each service's batches written as it ends: a run cut short (a loaded machine) keeps what it measured
            write_result("quantized", config, None, runs, args.out, partial=True, mismatch=found)
    summary = []
    for conc in levels:
        by = {(x["round"], x["arm"]): x for x in runs if x["concurrency"] == conc}
        ratio = spread(by[r, "int8"]["tok_s"] / by[r, "float32"]["tok_s"] for r in range(args.rounds))
        tok = {arm: statistics.median(by[r, arm]["tok_s"] for r in range(args.rounds)) for arm in ARMS}
        summary.append({"concurrency": conc, "samples_in_flight": conc * args.n, "float32_tok_s_median": tok["float32"],
                        "int8_tok_s_median": tok["int8"], "ratio_median": ratio["median"],
                        "ratio_range": [ratio["min"], ratio["max"]],
                        "ratios": [by[r, "int8"]["tok_s"] / by[r, "float32"]["tok_s"] for r in range(args.rounds)]})
    projection = fp8_projection()
    path = write_result("quantized", config, summary, runs, args.out, mismatch=found, fp8_projection=projection)
    print(f"{'conc':>5} {'float32 tok/s':>13} {'int8 tok/s':>10} {'int8/f32':>8}  per round")
    for s in summary:
        print(f"{s['concurrency']:>5} {s['float32_tok_s_median']:>13.1f} {s['int8_tok_s_median']:>10.1f} "
              f"{s['ratio_median']:>8.2f}  {' '.join(f'{x:.2f}' for x in s['ratios'])}")
    print("FP8 / bf16 decode step (perfmodel):")
    for p in projection:
        print(f"  {p['model']:>14} {p['hardware']:>6} batch {p['batch']:>3}: {p['bf16_step_ms']:6.2f} -> "
              f"{p['fp8_step_ms']:6.2f} ms, {p['speedup']:.2f}x")
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
