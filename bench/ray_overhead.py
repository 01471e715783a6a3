"""The cost of the Ray hop: throughput through the service with engines in-process vs as Ray actors, one run.

    .venv/bin/python bench/ray_overhead.py [--model DIR] [--prompts 16] [--n 4] [--max-tokens 64] [--rounds 3]

Three pools on the same model and engine settings: `embedded-1` (one engine in the gRPC process), `ray-1`
and `ray-2` (one and two engines as actors on a local Ray cluster started here). Each round starts each
pool in turn, warms it up, sends the same workload (P prompts x n samples, ignore_eos, so every run
generates the same number of tokens) and stops it (two pools cannot share the 2 cores fairly); the ratio
to embedded-1 is taken per round and the median printed.
On a 2-core machine two engines share the same cores, so ray-2 measures routing over two engines, not a
speedup; on GPU nodes each engine has its own GPU.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from service_overhead import prompts_for, service_round  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--log-dir", default="runs/ray_overhead")
    args = ap.parse_args()

    from rollout_client import RolloutClient
    from rollout_client.launcher import ServiceProcess
    from tqdm import tqdm
    from transformers import AutoTokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # the repository: tests/ray_cluster.py
    from tests.ray_cluster import LocalRayCluster
    from rollout_service.models import prepare_default_model

    model = args.model or str(prepare_default_model())
    prompts = prompts_for(AutoTokenizer.from_pretrained(model), args.prompts)
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    common = ["--max-model-len", "1024", "--kv-cache-gb", "1", "--dtype", "float32", "--max-num-seqs", "64"]
    with LocalRayCluster(num_cpus=4) as ray:
        configs = {"embedded-1": common, "ray-1": common + ["--ray-address", ray.address],
                   "ray-2": common + ["--ray-address", ray.address, "--engines", "2"]}
        tok_s = {name: [] for name in configs}
        steps = [(r, name) for r in range(args.rounds) for name in configs]
        for r, name in tqdm(steps, desc="pools x rounds", unit="run"):
            with ServiceProcess(model, extra_args=configs[name], log_path=logs / f"{name}.log") as svc, \
                    RolloutClient(svc.target) as c:
                service_round(c, prompts[:2], 1, 8)                      # warm-up
                tokens, dt = service_round(c, prompts, args.n, args.max_tokens)
            tok_s[name].append(tokens / dt)
            tqdm.write(f"round {r} {name}: {tokens} tokens in {dt:.1f} s = {tokens / dt:.1f} tok/s")
    base = tok_s["embedded-1"]
    print(f"\nworkload: {args.prompts} prompts x {args.n} samples x {args.max_tokens} tokens, {args.rounds} rounds, "
          f"model {Path(model).name}, {os.cpu_count()} CPUs")
    print("| pool | tokens/s (median) | vs embedded-1 (median of per-round ratios) |")
    print("| --- | ---: | ---: |")
    for name, xs in tok_s.items():
        ratio = statistics.median(x / b for x, b in zip(xs, base))
        print(f"| {name} | {statistics.median(xs):.0f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
