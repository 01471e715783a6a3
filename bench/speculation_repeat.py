"""A second look at cells of bench/speculation.py (not a test): per concurrency, the plain engine, the method under
the k controller and the same speculative engine with k = 0 at every batch size (never drafting: what a step of a
speculative engine costs by itself), interleaved plain, auto, k = 0, plain, in two rounds, ratios to the mean of
the two plain runs around them.

    .venv/bin/python bench/speculation_repeat.py ngram 8,16
    .venv/bin/python bench/speculation_repeat.py suffix 32
    AUTO_MARGIN=0.15 .venv/bin/python bench/speculation_repeat.py suffix 32    # the controller's margin, this run
    AUTO_DEEPEN=0.8 .venv/bin/python bench/speculation_repeat.py suffix 32     # and the share of k = 0's rate
                                                                  # a k must reach for a deeper one to be measured
"""
from __future__ import annotations

import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
from speculation import Workload, held, off_share, start, steps_share  # noqa: E402


async def main():
    from transformers import AutoTokenizer
    from rollout_service.cli import resolve_model
    from rollout_service.config import OPEN_BATCH, SpeculationConfig
    method = sys.argv[1] if len(sys.argv) > 1 else "ngram"
    concs = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "8,16").split(",")]
    model = resolve_model(None)
    work = Workload(AutoTokenizer.from_pretrained(model))
    common = dict(method=method, num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=5)
    plain = await start(model, SpeculationConfig())
    knobs = {var: os.environ[mine] for mine, var in (("AUTO_MARGIN", "ROLLOUT_K_CONTROL_MARGIN"),
                                                      ("AUTO_DEEPEN", "ROLLOUT_K_CONTROL_DEEPEN"))
             if os.environ.get(mine)}                       # the controller's settings for this run's auto engine only
    auto = await start(model, SpeculationConfig(k_control="auto", **common), env=knobs)
    zero = await start(model, SpeculationConfig(k_control="fixed", k_by_batch_size=[(1, OPEN_BATCH, 0)], **common))
    try:
        for c in concs:
            await held(auto, work, c, c, 64, "warm")
        for rnd in (1, 2):
            for c in concs:
                n = 3 * c
                res = {}
                s0 = await auto.k_control_snapshot()
                for name, eng in (("plain", plain), ("auto", auto), ("zero", zero)):
                    res[name] = (await held(eng, work, c, n, 128, name))["tok_s"]
                s1 = await auto.k_control_snapshot()
                p2 = (await held(plain, work, c, n, 128, "plain"))["tok_s"]
                p = (res["plain"] + p2) / 2
                before = {r["batch"]: r["steps_by_k"] for r in s0["buckets"]}
                per_bucket = {r["batch"]: [x - y for x, y in zip(r["steps_by_k"], before.get(r["batch"], [0] * 9))]
                              for r in s1["buckets"]}
                print(f"round {rnd} conc {c}: plain {res['plain']:.1f}/{p2:.1f}, auto {res['auto'] / p:.3f}, "
                      f"k=0 always {res['zero'] / p:.3f}; auto steps by k {steps_share(s0, s1)}, "
                      f"off {off_share(s0, s1)}; "
                      "by batch size " + ", ".join(f"{b}: {v}" for b, v in per_bucket.items() if any(v)), flush=True)
    finally:
        for e in (plain, auto, zero):
            await e.shutdown()

if __name__ == "__main__":
    asyncio.run(main())
