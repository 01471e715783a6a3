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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
from speculation import Workload, held, start  # noqa: E402


async def run(label, k_control, conc, n, env):
    from transformers import AutoTokenizer

    from rollout_service.cli import resolve_model
    from rollout_service.config import SpeculationConfig
    from rollout_service.drafting.drafters import default_drafter_dir

    model = resolve_model(None)
    head = sys.argv[1] if len(sys.argv) > 1 else str(default_drafter_dir("eagle3"))
    eng = await start(model, SpeculationConfig(method="eagle3", model=head, num_speculative_tokens=3,
                                               k_control=k_control), env=env)
    try:
        r = await held(eng, Workload(AutoTokenizer.from_pretrained(model)), conc, n, 128, label)
        snap = await eng.k_control_snapshot() if k_control == "auto" else None
    finally:
        await eng.shutdown()
    steps, per = r["steps"], r["accepted_per_pos"]
    print(f"{label:<28} conc {conc:>2}: {r['tok_s']:6.1f} tok/s, spec steps {steps}, accepted per position "
          f"{per}, per spec step {[round(p / max(1, steps), 3) for p in per]}, "
          f"controller a_i {[round(a, 3) for a in snap['acceptance']] if snap else '-'} "
          f"steps_by_k {snap['steps_by_k'] if snap else '-'}", flush=True)


async def main():
    await run("fixed k=3", "fixed", 8, 32, {})
    await run("auto, head pass skipped", "auto", 32, 96, {})
    await run("auto, head pass kept", "auto", 32, 96, {"ROLLOUT_K0_KEEP_DRAFTER_KV": "1"})


if __name__ == "__main__":
    asyncio.run(main())
