"""The EAGLE-3 head's acceptance per draft position as served (not a test): fixed k = 3 at 8 sequences (every step
drafts three tokens), and the k controller at 32 sequences with the head's k = 0 pass skipped (the default) and
run (ROLLOUT_K0_KEEP_DRAFTER_KV=1). Prints accepted drafts per position, per verify step, and the controller's
conditional a_i.

    .venv/bin/python bench/eagle3_positions.py [HEAD_DIR]
"""
from __future__ import annotations

import asyncio
import os
import sys
import time

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

async def run(label, k_control, conc, n, env):
    from transformers import AutoTokenizer
    from rollout_service.cli import resolve_model
    from rollout_service.config import EngineConfig, SpeculationConfig
    from rollout_service.drafting.drafters import default_drafter_dir, task_prompts
    from rollout_service.engine.types import SeqRequest
    from rollout_service.engine.vllm_engine import VllmEngine
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    model = resolve_model(None)
    head = sys.argv[1] if len(sys.argv) > 1 else str(default_drafter_dir("eagle3"))
    prompts = task_prompts(AutoTokenizer.from_pretrained(model), n // 4 + 1, start=70000)
    eng = VllmEngine("probe", model, EngineConfig(max_model_len=1024, kv_cache_gb=1.5, speculation=SpeculationConfig(
        method="eagle3", model=head, num_speculative_tokens=3, k_control=k_control)))
    await eng.start()
    for k, v in saved.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    todo, res = iter(range(n)), []
    async def slot():
        for j in todo:
            res.append(await eng.generate(SeqRequest(
                seq_id=f"{label}-{j}-{time.monotonic_ns()}", prompt_token_ids=prompts[j // 4], temperature=1.0,
                max_tokens=128, seed=j)))
    t = time.perf_counter()
    await asyncio.gather(*(slot() for _ in range(conc)))
    wall = time.perf_counter() - t
    steps = sum(r.spec_steps for r in res)
    per = [sum(r.accepted_per_pos[i] for r in res if len(r.accepted_per_pos) > i) for i in range(3)]
    snap = await eng.k_control_snapshot() if k_control == "auto" else None
    await eng.shutdown()
    toks = sum(len(r.token_ids) for r in res)
    print(f"{label:<28} conc {conc:>2}: {toks / wall:6.1f} tok/s, spec steps {steps}, accepted per position "
          f"{[p for p in per]}, per spec step {[round(p / max(1, steps), 3) for p in per]}, "
          f"controller a_i {[round(a, 3) for a in snap['acceptance']] if snap else '-'} "
          f"steps_by_k {snap['steps_by_k'] if snap else '-'}", flush=True)

async def main():
    await run("fixed k=3", "fixed", 8, 32, {})
    await run("auto, head pass skipped", "auto", 32, 96, {})
    await run("auto, head pass kept", "auto", 32, 96, {"ROLLOUT_K0_KEEP_DRAFTER_KV": "1"})

if __name__ == "__main__":
    asyncio.run(main())
