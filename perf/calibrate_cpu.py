"""Calibrate the performance model's CPU profile (rollout_service/perfmodel) on this machine (not a test; ~20 min).

    .venv/bin/python perf/calibrate_cpu.py [--batches 1,4,8,16,32,64] [--ks 1,3] [--methods eagle3,draft_model,ngram]
                                            [--out bench/results/cpu_calibration.json]
    .venv/bin/python perf/calibrate_cpu.py --refit     # fit again from the measurements already in --out
    git show 64e93c7:bench/results/speculation.txt > /tmp/old.txt    # an older run's table, not the validated one
    .venv/bin/python perf/calibrate_cpu.py --from-table /tmp/old.txt --out bench/results/cpu_calibration_interim.json

Measures real vLLM engine steps on the default model, with the engine settings bench/speculation.py uses
(VllmEngine, max_model_len 1024, the task's prompts, temperature 1.0, seeded), for each drafter method, at each
batch size B (B sequences of --tokens new tokens, EOS ignored):
- steps without drafts (k = 0 at every batch size, vLLM's dynamic speculative decoding), and speculative steps
  (verify k + 1 tokens per sequence, k drafter steps) at each of --ks;
- each paired with a plain engine's step measured right before it (one plain engine runs the whole time). The
  fit uses the pair's ratio: this machine drifts up to 3x within a day and shares its 2 cores, and a ratio
  measured seconds apart survives that where an absolute time does not. The plain step at B is the median of
  its pairs.
Step time = the wall-time difference of two runs (--tokens and --tokens / 4 new tokens, which cancels prefill)
over the difference in engine steps (plain: tokens; speculative: the samples' verify steps). vLLM's
`rejection_sample_method="synthetic"` would fix acceptance, but its CPU kernels ignore the synthetic rates
(vllm/utils/cpu_triton_utils.py: "not yet implemented"), so steps are counted instead; acceptance only changes
how many steps a run takes, not what one costs.

--from-table (a stand-in while the machine is busy; starts no engine): the plain engine's step time at each
concurrency is taken from an older bench/speculation.py text table's plain tok/s (concurrency / plain tok/s: a
held batch, prefills included) and each drafter's step from its `cost c` column (one drafter forward over one
target forward in PyTorch, times that plain step). Nothing of the table's speculative columns is used. It has no
measurement at token widths > 1: verifying is extrapolated by the roofline alone.

The fit (`fit` in the JSON, read by perfmodel.hardware.cpu_from_calibration):
- plain steps -> overhead_s, mem_bw, flops of the roofline T(B) = overhead + max(weight bytes / mem_bw,
  FLOPs / flops) (perfmodel/step.py) by grid search on relative error;
- k = 0 steps -> k0_overhead[method]: the median over B of (k = 0 step / plain step - 1);
- speculative steps (as ratio x the roofline's plain step) -> what verifying a k + 1 wide step predicts from that
  roofline, the rest is drafting:
  T_spec(B, k) - forward(B, k + 1) = k (d0 + d1 B) + e, least squares per method for the drafter step
  (d0, d1) -> draft_steps[method], and e (spec_overhead_s, shared).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))     # bench/speculation.py's engines

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


async def timed(eng, prompts, batch: int, tokens: int, tag: str) -> tuple[float, float]:
    """(wall seconds, engine steps) for `batch` sequences of `tokens` new tokens generated together."""
    from rollout_service.engine.types import SeqRequest

    reqs = [SeqRequest(seq_id=f"cal-{tag}-{batch}-{tokens}-{i}-{time.monotonic_ns()}", prompt_token_ids=prompts[i],
                       temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=7 + i) for i in range(batch)]
    t = time.perf_counter()
    out = await asyncio.gather(*(eng.generate(r) for r in reqs))
    wall = time.perf_counter() - t
    steps = max(r.spec_steps + (len(r.token_ids) - r.spec_steps - r.num_accepted) for r in out) \
        if any(r.spec_steps for r in out) else tokens
    return wall, float(steps)


async def step_time(eng, prompts, batch: int, tokens: int, tag: str) -> dict:
    """Seconds per engine step at `batch` sequences: two runs (tokens / 4 and tokens new tokens) differenced."""
    w1, s1 = await timed(eng, prompts, batch, tokens // 4, tag)
    w2, s2 = await timed(eng, prompts, batch, tokens, tag)
    return {"step_s": (w2 - w1) / max(1.0, s2 - s1), "steps": [s1, s2], "wall_s": [round(w1, 3), round(w2, 3)]}


async def measure(model: str, spec, prompts, batches: list[int], tokens: int, tag: str, plain=None) -> list[dict]:
    """Step time at each batch size on an engine with `spec`. With `plain` (a running plain engine), each
    measurement is paired with the plain engine's, taken right before it (plain_step_s): the machine drifts up
    to 3x within a day and other work shares its 2 cores, so the fit uses the pair's ratio, not either time."""
    from rollout_service.config import EngineConfig
    from rollout_service.engine.vllm_engine import VllmEngine

    eng = VllmEngine("calibrate", model, EngineConfig(max_model_len=1024, kv_cache_gb=1.5, speculation=spec))
    await eng.start()
    rows = []
    try:
        await timed(eng, prompts, 2, 8, "warm")
        for b in batches:
            base = await step_time(plain, prompts, b, tokens, "plain") if plain is not None else None
            r = await step_time(eng, prompts, b, tokens, tag)
            row = {"batch": b, "step_s": round(r["step_s"], 5), "steps": r["steps"], "wall_s": r["wall_s"]}
            if base is not None:
                row["plain_step_s"] = round(base["step_s"], 5)
            rows.append(row)
            print(f"  {tag:<16} batch {b:>3}: {r['step_s'] * 1e3:8.2f} ms/step"
                  + (f"  (plain beside it {base['step_s'] * 1e3:7.2f} ms: x{r['step_s'] / base['step_s']:.2f})"
                     if base else ""), flush=True)
    finally:
        await eng.shutdown()
    return rows


def fit(cal: dict) -> dict:
    """Fitted CPU profile fields from the measurements (see the module docstring)."""
    import numpy as np

    from rollout_service.perfmodel import model as pm
    from rollout_service.perfmodel.hardware import Hardware
    from rollout_service.perfmodel.step import forward

    m = pm.from_config(cal["model_config"], name="target")
    ctx, bpp = cal["context"], cal["bytes_per_param"]
    plain = [(r["batch"], r["step_s"]) for r in cal["plain"]]

    def hw(o, bw, fl, **kw):
        return Hardware("cpu", mem_bw=bw, flops=fl, mem_bytes=24 * 2**30, link_bw=1e12, push_bw=2e9, overhead_s=o,
                        draft_overhead_s=0.0, allreduce_latency_s=0.0, bytes_per_param=bpp, **kw)

    best = None
    t1 = min(t for _, t in plain)
    for o in np.linspace(0.0, t1 * 0.95, 40):
        for bw in np.geomspace(1e9, 1e12, 40):
            for fl in np.geomspace(1e10, 1e13, 60):
                h = hw(o, bw, fl)
                err = sum(abs(forward(m, h, b, 1, ctx).seconds / t - 1) for b, t in plain)
                if best is None or err < best[0]:
                    best = (err, o, bw, fl)
    _, o, bw, fl = best
    h = hw(o, bw, fl)
    out = {"overhead_s": float(o), "mem_bw": float(bw), "flops": float(fl), "bytes_per_param": bpp,
           "plain_mean_abs_error": round(float(best[0]) / len(plain), 4), "draft_steps": {}}
    if cal.get("drafter_cost"):                    # --from-table: drafter step = c x plain step, linear in B
        measured = dict(plain)
        for meth, by_b in cal["drafter_cost"].items():
            pts = [(int(b), c * measured[int(b)]) for b, c in by_b.items() if int(b) in measured]
            xs, ys = np.array([b for b, _ in pts], float), np.array([d for _, d in pts])
            d1, d0 = np.polyfit(xs, ys, 1) if len(pts) > 1 else (0.0, ys[0])
            out["draft_steps"][meth] = [max(0.0, float(d0)), max(0.0, float(d1))]
        out["spec_overhead_s"] = 0.0
        return out
    # each speculative measurement in plain steps of the fitted roofline: its ratio to the plain step measured
    # beside it (older calibrations without pairs: its own time)
    def seconds(r):
        return r["step_s"] / r["plain_step_s"] * forward(m, h, r["batch"], 1, ctx).seconds if r.get("plain_step_s") \
            else r["step_s"]

    spec = [{**r, "step_s": seconds(r)} for r in cal.get("spec", [])]
    # k = 0: what a step without drafts costs over a plain one, a fraction of it per method (median over batches)
    out["k0_overhead"] = {meth: round(max(0.0, float(np.median([r["step_s"] / r["plain_step_s"] - 1 for r in spec
                                                                  if r["method"] == meth and r["k"] == 0]))), 4)
                          for meth in sorted({r["method"] for r in spec if r["k"] == 0 and r.get("plain_step_s")})}
    spec = [r for r in spec if r["k"] > 0]
    # speculative: T - forward(B, k + 1) = k d0 + k B d1 + e, per method; e shared -> one least-squares system
    methods = sorted({r["method"] for r in spec})
    rows, rhs = [], []
    for r in spec:
        j = methods.index(r["method"])
        x = [0.0] * (2 * len(methods) + 1)
        x[2 * j], x[2 * j + 1], x[-1] = r["k"], r["k"] * r["batch"], 1.0
        rows.append(x)
        rhs.append((r["step_s"] - forward(m, h, r["batch"], r["k"] + 1, ctx).seconds) / r["step_s"])
        rows[-1] = [v / r["step_s"] for v in x]              # relative errors: weight every cell alike
    if rows:
        sol, *_ = np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)
        for j, meth in enumerate(methods):
            out["draft_steps"][meth] = [max(0.0, float(sol[2 * j])), max(0.0, float(sol[2 * j + 1]))]
        out["spec_overhead_s"] = max(0.0, float(sol[-1]))
    return out


async def run(args) -> dict:
    from transformers import AutoTokenizer

    from rollout_service.cli import resolve_model
    from rollout_service.config import OPEN_BATCH, SpeculationConfig
    from rollout_service.engine.vllm_engine import resolve_dtype
    from rollout_service.drafting.drafters import default_drafter_dir, task_prompts

    model = resolve_model(args.model)
    batches = [int(x) for x in args.batches.split(",")]
    prompts = task_prompts(AutoTokenizer.from_pretrained(model), max(batches), start=90_000)
    prompt_len = sum(len(p) for p in prompts) / len(prompts)
    dtype = resolve_dtype("auto")
    cal = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"), "model": model,
           "model_config": json.loads((Path(model) / "config.json").read_text()), "dtype": dtype,
           "bytes_per_param": 4 if dtype == "float32" else 2, "prompt_len": round(prompt_len, 1),
           "context": round(prompt_len + args.tokens * 5 / 8, 1), "tokens": args.tokens, "plain": [], "spec": []}
    print(f"calibrating on {model} ({dtype}); batches {batches}; prompt {prompt_len:.0f} tokens", flush=True)
    from speculation import start  # bench/speculation.py: a warmed-up plain engine, kept for the pairs

    plain = await start(model, SpeculationConfig())
    drafters = {"eagle3": args.eagle3_head or str(default_drafter_dir("eagle3")),
                "draft_model": args.draft_model or str(default_drafter_dir("draft_model")), "ngram": ""}
    try:
        for method in args.methods.split(","):
            if method != "ngram" and not Path(drafters[method]).exists():
                print(f"  {method}: no drafter at {drafters[method]}; skipped", flush=True)
                continue
            cal.setdefault("drafters", {})[method] = drafters[method]
            for k in [0] + [int(x) for x in args.ks.split(",")]:
                # k = 0: drafting off at every batch size (k_by_batch_size), what a step without drafts costs
                spec = SpeculationConfig(method=method, model=drafters[method], num_speculative_tokens=max(k, 1),
                                         k_control="fixed", k_by_batch_size=[(1, OPEN_BATCH, 0)] if k == 0 else [])
                for r in await measure(model, spec, prompts, batches, args.tokens, f"{method} k={k}", plain):
                    cal["spec"].append({"method": method, "k": k, **r})
    finally:
        await plain.shutdown()
    # the plain step at each batch size: the median of every plain measurement paired above
    import statistics

    cal["plain"] = [{"batch": b, "step_s": round(statistics.median(r["plain_step_s"] for r in cal["spec"]
                                                                 if r["batch"] == b), 5)} for b in batches]
    return cal


def from_table(path: Path, model: str | None) -> dict:
    """A calibration from an older speculation table's plain columns and drafter costs (see the docstring)."""
    import re

    from transformers import AutoTokenizer

    from rollout_service.cli import resolve_model
    from rollout_service.drafting.drafters import task_prompts

    model = resolve_model(model)
    plain, cost = {}, {}
    for line in path.read_text().splitlines():
        f = line.split()
        if len(f) >= 10 and f[0] in ("eagle3", "draft_model", "ngram") and re.fullmatch(r"\d+|dyn", f[1]):
            plain[int(f[2])] = float(f[3])
            if f[0] != "ngram":
                cost.setdefault(f[0], {})[int(f[2])] = float(f[9])
    prompts = task_prompts(AutoTokenizer.from_pretrained(model), 64, start=50_000)
    prompt_len = sum(len(p) for p in prompts) / len(prompts)
    dates = re.findall(r"\d{4}-\d{2}-\d{2}", path.read_text())
    return {"date": f"interim, from {path}" + (f" ({dates[0]})" if dates else ""), "model": model,
            "model_config": json.loads((Path(model) / "config.json").read_text()), "dtype": "bfloat16",
            "bytes_per_param": 2, "prompt_len": round(prompt_len, 1), "context": round(prompt_len + 72, 1),
            "plain": [{"batch": b, "step_s": round(b / t, 5)} for b, t in sorted(plain.items())], "spec": [],
            "drafter_cost": {m: {str(b): c for b, c in v.items()} for m, v in cost.items()},
            "source": "plain steps = concurrency / plain tok/s of the table; drafter steps = cost c x plain step"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--batches", default="1,4,8,16,32,64")
    ap.add_argument("--ks", default="1,3")
    ap.add_argument("--methods", default="eagle3,draft_model,ngram")
    ap.add_argument("--eagle3-head")
    ap.add_argument("--draft-model")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per sequence in the long run")
    ap.add_argument("--out", default="bench/results/cpu_calibration.json")
    ap.add_argument("--refit", action="store_true", help="only fit again from the measurements in --out")
    ap.add_argument("--from-table", help="no engines: calibrate from an older bench/speculation.py text table")
    args = ap.parse_args()
    if args.from_table:
        cal = from_table(Path(args.from_table), args.model)
    else:
        cal = json.loads(Path(args.out).read_text()) if args.refit else asyncio.run(run(args))
    cal["fit"] = fit(cal)
    Path(args.out).write_text(json.dumps(cal, indent=1) + "\n")
    f = cal["fit"]
    print(f"fit: overhead {f['overhead_s'] * 1e3:.1f} ms, mem_bw {f['mem_bw'] / 1e9:.1f} GB/s, flops "
          f"{f['flops'] / 1e9:.1f} GFLOP/s (plain steps within {f['plain_mean_abs_error']:.1%} on average); "
          f"drafter steps {f['draft_steps']}; spec overhead {f.get('spec_overhead_s', 0) * 1e3:.1f} ms; k = 0 costs "
          f"{f.get('k0_overhead')} of a plain step")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
