"""Engine start and stop time with the CPU worker forked from the engine core (patch cpu_worker_fork) against vLLM's
spawn, interleaved (A, B, A, B, ...) on the same model, so that the machine's drift hits both alike.

    .venv/bin/python bench/engine_start.py [--model DIR] [--pairs 3]

Without --model it builds the tests' tiny model in a temporary folder. Writes bench/results/engine_start.json.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from harness import write_result

OFF = "ROLLOUT_DISABLE_WORKER_FORK"        # engine/patches.py: cpu_worker_fork switched off -> vLLM spawns


async def start_stop(model: str, fork: bool) -> dict:
    from rollout_service.config import EngineConfig
    from rollout_service.engine.types import SeqRequest
    from rollout_service.engine.vllm_engine import VllmEngine

    if fork:
        os.environ.pop(OFF, None)
    else:
        os.environ[OFF] = "1"                   # read by the plugin in the engine core, which inherits it
    engine = VllmEngine("bench", model, EngineConfig(max_model_len=512, kv_cache_gb=1, dtype="float32"))
    t0 = time.perf_counter()
    await engine.start()
    started = time.perf_counter() - t0
    state = {p["name"]: p["state"] for p in engine.patches}["cpu_worker_fork"]
    tokens = (await engine.generate(SeqRequest(seq_id="x", prompt_token_ids=[1, 2, 3], max_tokens=8, seed=1,
                                               temperature=1.0))).token_ids
    t0 = time.perf_counter()
    await engine.shutdown()
    return {"fork": fork, "patch": state, "start_s": round(started, 2),
            "stop_s": round(time.perf_counter() - t0, 2), "tokens": list(tokens)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a model directory (default: the tests' tiny model, built here)")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--out", default=None, help="default bench/results/engine_start.json")
    args = ap.parse_args()
    model = args.model
    if model is None:
        from tests.tiny_models import build_tiny_model

        model = str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny-llama"))
    runs = []
    for i in range(args.pairs):
        for fork in (True, False):
            runs.append(asyncio.run(start_stop(model, fork)))
            print(f"pair {i + 1}/{args.pairs}: {'fork ' if fork else 'spawn'} start {runs[-1]['start_s']:5.1f} s, "
                  f"stop {runs[-1]['stop_s']:4.1f} s (cpu_worker_fork: {runs[-1]['patch']})", flush=True)
    assert len({tuple(r["tokens"]) for r in runs}) == 1, "the same seeded sample from every engine"
    med = {k: {m: statistics.median(r[k] for r in runs if r["fork"] == (m == "fork")) for m in ("fork", "spawn")}
           for k in ("start_s", "stop_s")}
    summary = {"median": med, "start_ratio_spawn_over_fork": round(med["start_s"]["spawn"] / med["start_s"]["fork"], 2)}
    path = write_result("engine_start", {"model": model, "pairs": args.pairs}, summary, runs, args.out)
    print(f"median start: fork {med['start_s']['fork']:.1f} s, spawn {med['start_s']['spawn']:.1f} s "
          f"({summary['start_ratio_spawn_over_fork']}x); stop: fork {med['stop_s']['fork']:.1f} s, spawn "
          f"{med['stop_s']['spawn']:.1f} s; load average {os.getloadavg()[0]:.1f} -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
