"""The GPU projections of docs/projections.md, re-run in one go (not a test; seconds):

    .venv/bin/python perf/projections.py [--hardware gb200,h100,h200] [--out-dir bench/results/perfmodel]
        [--before SUMMARY.json]     # print each figure beside an earlier run's (e.g. the model before a change)

For each hardware profile, `rollout-service simulate` (perfmodel/simulate.build) on the scenarios of the seed-paper
comparison: Qwen3-8B with an EAGLE-3 head at per-token acceptance 0.56 and 0.68 (L(3) = 2.05, 2.47) and a decaying
per-position profile, n-gram at 0.15, and Qwen3-235B-A22B with the head at 0.62 (512 prompts x 16, up to 512 in
flight). Writes each run's JSON (<scenario>-<hardware>.json), the plot of the decaying profile on gb200, and
summary.json / projections.txt: speedup at k = 3 and at the best k by concurrency, the rollout batch, the RL step.
An older model's summary (run this script with that model first on PYTHONPATH, --out-dir elsewhere) is read by
--before; a profile the older model lacks is stood in for as its H100 profile with the other's bandwidth and memory.

    .venv/bin/python perf/projections.py --moe      # the mixture-of-experts projections instead (issue 42)

--moe: Qwen3-30B-A3B and Qwen3-235B-A22B on one GB200 NVL72 rack (72 GPUs) with and without speculation (EAGLE-3,
per-token acceptance 0.62, k fixed and chosen per step), engines of tp devices or of ep devices (expert parallelism,
attention data-parallel), sync and async RL; each beside a dense model of the same active size (what a verify pass
costs when it reads no more weights than a plain step); and the model against published MoE decode figures
(PUBLISHED below, each with its source). Writes moe-<scenario>.json, moe_summary.json and moe_projections.txt.

    .venv/bin/python perf/projections.py --weight-sync    # weight sync with and without deltas (prints only)

--weight-sync: Qwen3-8B, Qwen3-30B-A3B and Qwen3-235B-A22B on h200, full push against deltas (perfmodel/
weight_sync.py) over NVLink, 400 Gb/s and 100 Gb/s: bytes, seconds and share of the sync RL step (generate + train
from simulate.build, speculation off), as the markdown table of docs/projections.md, and the checks against
published figures (WEIGHT_SYNC_CHECKS) beside it.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

SCENARIOS = {
    "qwen3-8b-eagle3-a056": ["--policy-config", "qwen3-8b", "--drafter-config", "qwen3-8b-eagle3",
                             "--acceptance", "0.56"],
    "qwen3-8b-eagle3-a068": ["--policy-config", "qwen3-8b", "--drafter-config", "qwen3-8b-eagle3",
                             "--acceptance", "0.68"],
    "qwen3-8b-eagle3-decay": ["--policy-config", "qwen3-8b", "--drafter-config", "qwen3-8b-eagle3",
                              "--acceptance", "0.75,0.6,0.5,0.45,0.4,0.35,0.3"],
    "qwen3-8b-ngram-a015": ["--policy-config", "qwen3-8b", "--method", "ngram", "--acceptance", "0.15"],
    "qwen3-235b-eagle3-a062": ["--policy-config", "qwen3-235b-a22b", "--drafter-config", "qwen3-8b-eagle3",
                               "--acceptance", "0.62", "--prompts", "512", "--group", "16",
                               "--max-concurrency", "512"],
}
STANDIN = {"h200": {"mem_bw": 4.8e12, "mem_bytes": 141e9}}

# One GB200 NVL72 rack (72 GPUs), 512 prompts x 16 samples; EAGLE-3 at per-token acceptance 0.62 (our guess, the
# seed paper's 235B scenario above). Engines: tp devices each (ep = tp), or ep devices with attention data-parallel.
RACK = ["--hardware", "gb200", "--prompts", "512", "--group", "16", "--acceptance", "0.62"]
A3B = ["--policy-config", "qwen3-30b-a3b", "--drafter-config", "qwen3-30b-a3b-eagle3"]
A22B = ["--policy-config", "qwen3-235b-a22b", "--drafter-config", "qwen3-8b-eagle3"]
MOE_SCENARIOS = {
    "qwen3-30b-a3b-tp1": [*A3B, "--tp", "1", "--engines", "72", "--concurrency", "1,8,32,64,128,256"],
    "qwen3-30b-a3b-ep8": [*A3B, "--tp", "1", "--ep", "8", "--engines", "9", "--max-concurrency", "2048",
                          "--concurrency", "8,64,256,512,1024,2048"],
    "qwen3-235b-a22b-tp8": [*A22B, "--tp", "8", "--engines", "9", "--max-concurrency", "1024",
                            "--concurrency", "1,8,64,256,512,1024"],
    "qwen3-235b-a22b-ep72": [*A22B, "--tp", "1", "--ep", "72", "--engines", "1", "--max-concurrency", "9216",
                             "--concurrency", "72,576,2304,4608,9216"],
}
# the same active shape with a dense MLP (8 x 768 = 6144 wide; 8 x 1536 = 12288): a verify reads no more weights
DENSE_TWINS = {"qwen3-30b-a3b": {"experts": 0, "experts_per_tok": 0, "expert_intermediate": 0, "intermediate": 6144},
               "qwen3-235b-a22b": {"experts": 0, "experts_per_tok": 0, "expert_intermediate": 0,
                                   "intermediate": 12288}}

# Weight sync (--weight-sync): each policy's RL step on h200 as the seed-paper and MoE scenarios set it (8B and
# 30B-A3B: 128 prompts x 8 over 8 engines of one GPU; 235B: 512 x 16 over 8 engines of tp 8); the acceptance only
# feeds the speculative rows, which this does not read (the sync step with speculation off). (policy, its scenario,
# links: None, each engine device over its own link; 1, the whole policy over one, as TRL's 235B figure)
WEIGHT_SYNC = [("qwen3-8b", SCENARIOS["qwen3-8b-eagle3-a056"], None),
               ("qwen3-30b-a3b", [*A3B, "--acceptance", "0.62"], None),
               ("qwen3-235b-a22b", SCENARIOS["qwen3-235b-eagle3-a062"], None),
               ("qwen3-235b-a22b", SCENARIOS["qwen3-235b-eagle3-a062"], 1)]
SYNC_LINKS = {"nvlink": "NVLink", "400g": "400 Gb/s", "100g": "100 Gb/s"}
# Published weight-sync figures the model is checked against:
# - Hugging Face TRL delta sync (TRL #5417, #5937): a Qwen3-0.6B push from 1.2 GB to 20-35 MB (34-60x), generation
#   paused 1.1 s of a 9.4 s sync; a full push of Qwen3-235B-A22B is 470 GB in bf16, 38 s a step at 100 Gb/s.
# - Fireworks: "typically 20x+", a full snapshot every 20-30 steps. AReaL: 50-100x (its disk path). miles: up to 50x.
WEIGHT_SYNC_CHECKS = {"trl_0.6b_full_gb": 1.2, "trl_0.6b_delta_mb": (20, 35), "trl_235b_full_gb": 470,
                      "trl_235b_100g_s": 38, "fireworks_ratio": 20, "areal_ratio": (50, 100), "miles_ratio": 50}


# Published decode figures (bf16 unless said). ML.ENERGY Leaderboard v3 (https://ml.energy/leaderboard; data
# github.com/ml-energy/leaderboard, public/data/tasks/lm-arena-chat.json at commit 0cd52da, 2026-02-27): vLLM at a
# fixed batch in steady state on LM Arena chat prompts (mean output ~870 tokens; prompts not given: context taken as
# 1,000 tokens); the median inter-token latency is one engine step, prefills of arriving requests included.
# (model, hardware, GPUs, tp, ep, batch, median ITL ms, output tok/s)
MLENERGY = [("qwen3-8b", "h100", 1, 1, 1, 8, 8.20, 962), ("qwen3-8b", "h100", 1, 1, 1, 64, 13.95, 4315),
            ("qwen3-8b", "h100", 1, 1, 1, 256, 31.36, 7719),
            ("qwen3-30b-a3b", "h100", 1, 1, 1, 8, 12.85, 611), ("qwen3-30b-a3b", "h100", 1, 1, 1, 32, 22.57, 1394),
            ("qwen3-30b-a3b", "h100", 1, 1, 1, 64, 28.94, 2164),
            ("qwen3-30b-a3b", "h100", 2, 2, 2, 8, 9.36, 831), ("qwen3-30b-a3b", "h100", 2, 2, 2, 64, 18.70, 3290),
            ("qwen3-30b-a3b", "h100", 2, 2, 2, 256, 34.58, 7154),
            ("qwen3-30b-a3b", "b200", 1, 1, 1, 8, 8.24, 910), ("qwen3-30b-a3b", "b200", 1, 1, 1, 64, 19.32, 2907),
            ("qwen3-30b-a3b", "b200", 1, 1, 1, 256, 26.27, 8872),
            ("qwen3-235b-a22b", "h100", 8, 8, 8, 8, 20.24, 388), ("qwen3-235b-a22b", "h100", 8, 8, 8, 64, 40.34, 1548),
            ("qwen3-235b-a22b", "h100", 8, 8, 8, 228, 55.48, 3696),
            ("qwen3-235b-a22b", "b200", 8, 8, 8, 8, 16.56, 469), ("qwen3-235b-a22b", "b200", 8, 8, 8, 64, 32.99, 1877),
            ("qwen3-235b-a22b", "b200", 8, 8, 8, 256, 43.47, 5403)]
MLENERGY_CONTEXT = 1000
# LMSYS, DeepSeek-V3/R1 on GB200 NVL72, prefill-decode disaggregated, decode on 12 nodes (48 GPUs, DP attention,
# EP 48), 2,000-token inputs, no MTP; batch per GPU not given in the posts' text: the model answers at what batch per
# GPU it reaches the figure and whether that batch's KV cache fits. (label, tok/s per GPU, weight bytes per param)
LMSYS = [("Part I (2025-06-16, FP8 GEMMs): https://lmsys.org/blog/2025-06-16-gb200-part-1/", 7583, 1.0),
         ("Part II (2025-09-25, BF16 attention, FP8 MoE): https://lmsys.org/blog/2025-09-25-gb200-part-2/", 9087, 1.0)]


def summarise(r: dict) -> dict:
    rows = r["by_concurrency"]
    rl = {f"{'fixed' if x['speculation'].startswith('k=') else x['speculation']} {x['mode'].split()[0]}":
          x["speedup_vs_sync_off"] for x in r["rl"]}
    fixed_k = next(x["speculation"] for x in r["rl"] if x["speculation"].startswith("k="))
    return {"speedup_k3": {str(x["concurrency"]): x["speedup"][3] for x in rows},
            "best_k": {str(x["concurrency"]): x["best_k"] for x in rows},
            "best_speedup": {str(x["concurrency"]): x["best_speedup"] for x in rows},
            "step_ms_k0": {str(x["concurrency"]): x["step_ms"][0] for x in rows},
            "rollout_speedup": {k: v["speedup"] for k, v in r["rollout"].items() if k in ("k=3", "auto")},
            "rl_vs_sync_off": rl, "rl_fixed_k": fixed_k, "tp": r["policy"]["tp"]}


def run(hw_name: str, argv: list[str], out: Path, name: str, plot: bool) -> dict:
    from rollout_service.perfmodel import hardware, simulate

    ap = argparse.ArgumentParser()
    simulate.add_args(ap)
    args = ap.parse_args(["--hardware", hw_name, *argv])
    if hw_name not in hardware.PROFILES:                 # an older model without this profile
        hardware.PROFILES[hw_name] = replace(hardware.H100_SXM, name=hw_name, **STANDIN[hw_name])
    r = simulate.build(args)
    from rollout_service.perfmodel import report

    report.write_json(r, out / f"{name}-{hw_name}.json")
    if plot:
        report.plot(r, out / f"{name}-{hw_name}.png")
    return summarise(r)


def fmt(d: dict, keys, before: dict | None = None, spec: str = "{:.2f}") -> str:
    out = []
    for k in keys:
        v = d.get(k)
        b = (before or {}).get(k)
        s = spec.format(v) if v is not None else "-"
        out.append(f"{s} ({spec.format(b)})" if before is not None and b is not None else s)
    return "  ".join(out)


def moe_scenario(name: str, argv: list[str], out: Path) -> tuple[list[str], dict]:
    """One MoE scenario: its simulate run, the dense twin's speedups beside it, and its lines of the text."""
    from rollout_service.perfmodel import model, report, simulate
    from rollout_service.perfmodel.rollout import Engine
    from rollout_service.perfmodel.step import Drafter

    ap = argparse.ArgumentParser()
    simulate.add_args(ap)
    args = ap.parse_args([*RACK, *argv])
    r = simulate.build(args)
    report.write_json(r, out / f"moe-{name}.json")
    pol, policy = r["policy"], model.load(args.policy_config)
    twin = replace(policy, name=policy.name + "-dense-twin", **DENSE_TWINS[policy.name])
    hw = simulate.profile(args)
    eng = Engine(twin, hw, Drafter("eagle3", model.load(args.drafter_config)), [0.62], pol["tp"])
    ctx = r["workload"]["mean_context"]
    dev = pol.get("devices", pol["tp"])
    groups = dev // pol["tp"]                     # the twin's attention replicas serve batch / groups each
    rows = r["by_concurrency"]
    rl = {f"{x['speculation']} {x['mode'].split()[0]}": x["speedup_vs_sync_off"] for x in r["rl"]}
    summary = {"devices_per_engine": dev, "engines": r["workload"]["engines"],
               "concurrency": [x["concurrency"] for x in rows],
               "plain_tok_s_per_gpu": [round(x["plain_tok_s"] / dev) for x in rows],
               "speedup_k3": [x["speedup"][3] for x in rows], "best_k": [x["best_k"] for x in rows],
               "best_speedup": [x["best_speedup"] for x in rows],
               "experts_read_k0_k3": [(x["experts_read"][0], x["experts_read"][3]) for x in rows],
               "dense_twin_speedup_k3": [round(eng.speedup(-(-x["concurrency"] // groups), 3, ctx), 3) for x in rows],
               "rollout": {k: v["speedup"] for k, v in r["rollout"].items() if k in ("k=3", "auto")},
               "rollout_seconds_off": r["rollout"]["off"]["seconds"], "rl_vs_sync_off": rl}
    lines = ["", f"{name}: {pol['name']}, {summary['engines']} engines x {dev} GPUs (tp {pol['tp']}, ep "
                 f"{pol.get('ep', 1)}), mean context {ctx:.0f}",
             "  sequences/engine     " + "  ".join(f"{c:>6}" for c in summary["concurrency"]),
             "  plain tok/s/GPU      " + "  ".join(f"{c:>6}" for c in summary["plain_tok_s_per_gpu"]),
             "  experts read k=0/3   " + "  ".join(f"{a:.0f}/{b:.0f}".rjust(6)
                                                   for a, b in summary["experts_read_k0_k3"]),
             "  speedup k=3          " + "  ".join(f"{c:>6.2f}" for c in summary["speedup_k3"]),
             "  dense twin, k=3      " + "  ".join(f"{c:>6.2f}" for c in summary["dense_twin_speedup_k3"]),
             "  best k (speedup)     " + "  ".join(f"{k}:{v:.2f}".rjust(6)
                                                   for k, v in zip(summary["best_k"], summary["best_speedup"])),
             f"  rollout batch: off {summary['rollout_seconds_off']:.0f} s; speedup k=3 "
             f"{summary['rollout']['k=3']:.2f}, k per step {summary['rollout']['auto']:.2f}",
             "  RL step vs sync off: " + ", ".join(f"{k} {v:.2f}" for k, v in rl.items())]
    return lines, summary


def published() -> tuple[list[str], list[dict]]:
    """The model against published decode figures (MLENERGY, LMSYS)."""
    from rollout_service.perfmodel import hardware, model
    from rollout_service.perfmodel.step import device_weight_bytes, spec_step

    rows, lines = [], ["", "published decode figures against the model (ratio = model / published)",
                       "  ML.ENERGY v3 (vLLM, bf16): median inter-token latency ms at a fixed batch, context "
                       f"{MLENERGY_CONTEXT}"]
    for name, hw_name, gpus, tp, ep, batch, itl_ms, tok_s in MLENERGY:
        m, hw = model.load(name), hardware.get(hw_name)
        ms = spec_step(m, None, hw, batch, 0, MLENERGY_CONTEXT, tp, ep) * 1e3
        rows.append({"source": "ml.energy v3", "model": name, "hardware": hw_name, "gpus": gpus, "tp": tp, "ep": ep,
                     "batch": batch, "published_ms": itl_ms, "model_ms": round(ms, 2), "ratio": round(ms / itl_ms, 2),
                     "published_tok_s": tok_s})
        lines.append(f"  {name:<16} {hw_name:<5} {gpus} GPU tp {tp} batch {batch:>3}: published {itl_ms:6.2f} ms, "
                     f"model {ms:6.2f} ms, ratio {ms / itl_ms:.2f}")
    ds = model.load("deepseek-v3")
    lines.append("  LMSYS, DeepSeek-V3 decode on GB200 NVL72 (48 GPUs, EP 48, DP attention, 2,000-token inputs):")
    for label, tok_s, bpp in LMSYS:
        hw = replace(hardware.GB200, bytes_per_param=bpp)
        found = None
        for per_gpu in range(8, 1025, 8):
            b = per_gpu * 48
            if b / spec_step(ds, None, hw, b, 0, 2050, 1, 48) / 48 >= tok_s:
                found = per_gpu
                break
        kv = None if found is None else found * 2050 * ds.kv_bytes_per_token() / 1e9
        weights = device_weight_bytes(ds, bpp, 1, 48) / 1e9
        rows.append({"source": label, "model": "deepseek-v3", "hardware": "gb200", "gpus": 48, "tp": 1, "ep": 48,
                     "published_tok_s_per_gpu": tok_s, "batch_per_gpu_to_reach": found,
                     "kv_gb_per_gpu": kv and round(kv, 1), "weights_gb_per_gpu": round(weights, 1)})
        lines.append(f"    {tok_s} tok/s/GPU ({label.split(':')[0]}): the model reaches it at "
                     + (f"{found} sequences per GPU (KV {kv:.0f} GB + weights {weights:.0f} GB per GPU)" if found
                        else "no batch up to 1024 per GPU"))
    return lines, rows


def moe_main(out: Path) -> None:
    lines = ["Mixtures of experts on one GB200 NVL72 rack (72 GPUs), 512 prompts x 16 samples, EAGLE-3 at a = 0.62",
             "(perf/projections.py --moe; experts read = per MoE layer by a plain step / a k = 3 verify, of 128)"]
    summary = {}
    for name, argv in MOE_SCENARIOS.items():
        more, summary[name] = moe_scenario(name, argv, out)
        lines += more
    more, summary["published"] = published()
    lines += more
    (out / "moe_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    text = "\n".join(lines) + "\n"
    (out / "moe_projections.txt").write_text(text)
    print(text)


def rl_step_without_push(hw_name: str, argv: list[str]) -> tuple[dict, float]:
    """The policy and its sync RL step's generate + train seconds, speculation off (simulate.build)."""
    from rollout_service.perfmodel import simulate

    ap = argparse.ArgumentParser()
    simulate.add_args(ap)
    r = simulate.build(ap.parse_args(["--hardware", hw_name, *argv]))
    off = next(x for x in r["rl"] if x["speculation"] == "off" and x["mode"] == "sync")
    return r["policy"], off["generate_s"] + off["train_s"]


def percent(x: float) -> str:
    return f"{x:.2%}" if x >= 5e-5 else "<0.01%"


def weight_sync_main(hw_name: str = "h200") -> None:
    """docs/projections.md's weight-sync table and its checks, printed as markdown."""
    from rollout_service.perfmodel import hardware, model
    from rollout_service.perfmodel.weight_sync import ANCHOR_EVERY, DENSITY, DENSITY_MAX, INDEX_BYTES, weight_sync

    hw = hardware.get(hw_name)
    lines = ["| policy, tp (generate + train) | push | GB | " + " | ".join(SYNC_LINKS.values()) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in SYNC_LINKS) + " |"]
    kinds = {"full": "full", "delta": f"delta {DENSITY:.0%}", "anchored": f"+ full every {ANCHOR_EVERY}"}
    steps = {}
    for name, argv, links in WEIGHT_SYNC:
        pol, steps[name] = rl_step_without_push(hw_name, argv)
        tp, ep = pol["tp"], pol.get("ep", 1)
        syncs = [weight_sync(model.load(name), hw, ln, tp=tp, ep=ep, step_s=steps[name], links=links)
                 for ln in SYNC_LINKS]
        where = f"{tp}" + ("" if links is None else f", {links} link{'s' * (links > 1)}")
        for kind, label in kinds.items():
            one = getattr(syncs[0], kind)
            head = f"{name}, {where} ({steps[name]:.0f} s)" if kind == "full" else ""
            ratio = "" if kind == "full" else f" ({syncs[0].ratio(one):.1f}x)"
            cells = [f"{getattr(w, kind).seconds:.2g} ({percent(getattr(w, kind).share)})" for w in syncs]
            lines.append(f"| {head} | {label} | {one.bytes / 1e9:.3g}{ratio} | " + " | ".join(cells) + " |")
    c = WEIGHT_SYNC_CHECKS
    a22b, step_a22b = model.load("qwen3-235b-a22b"), steps["qwen3-235b-a22b"]
    small = weight_sync(model.load("qwen3-0.6b"), hw, "100g")
    one_link = weight_sync(a22b, hw, "100g", tp=8, links=1, step_s=step_a22b)
    nccl = weight_sync(a22b, hw, "nccl", tp=8, step_s=step_a22b)
    at20, at30 = (weight_sync(a22b, hw, "100g", anchor_every=n, tp=8) for n in (ANCHOR_EVERY, 30))
    worst = weight_sync(a22b, hw, "100g", density=DENSITY_MAX, tp=8)

    def density_for(ratio: float) -> str:           # the fraction changed at which a delta is `ratio` times smaller
        return f"{hw.bytes_per_param / ((INDEX_BYTES + hw.bytes_per_param) * ratio):.2%}"

    checks = [
        (f"TRL, Qwen3-0.6B: {c['trl_0.6b_full_gb']} GB -> {c['trl_0.6b_delta_mb'][0]}-{c['trl_0.6b_delta_mb'][1]} MB",
         f"{small.full.bytes / 1e9:.2f} GB -> {small.delta.bytes / 1e6:.0f} MB at {DENSITY:.0%} "
         f"({small.ratio(small.delta):.1f}x); {c['trl_0.6b_delta_mb'][0]} MB is "
         f"{density_for(small.full.bytes / c['trl_0.6b_delta_mb'][0] / 1e6)} changed"),
        (f"TRL, Qwen3-235B-A22B full: {c['trl_235b_full_gb']} GB, {c['trl_235b_100g_s']} s at 100 Gb/s",
         f"{one_link.full.bytes / 1e9:.1f} GB, {one_link.full.transfer_s:.1f} s over one 100 Gb/s link"),
        (f"Fireworks {c['fireworks_ratio']}x+ (a full snapshot every 20-30 steps)",
         f"a delta {small.ratio(small.delta):.1f}x at {DENSITY:.0%}, {worst.ratio(worst.delta):.1f}x at "
         f"{DENSITY_MAX:.0%}; with a full push every {ANCHOR_EVERY} / 30: {at20.ratio(at20.anchored):.1f}x / "
         f"{at30.ratio(at30.anchored):.1f}x at {DENSITY:.0%} ({worst.ratio(worst.anchored):.1f}x at {DENSITY_MAX:.0%}, "
         f"every {ANCHOR_EVERY})"),
        (f"AReaL {c['areal_ratio'][0]}-{c['areal_ratio'][1]}x, miles up to {c['miles_ratio']}x",
         f"a delta reaches {c['areal_ratio'][0]}x / {c['areal_ratio'][1]}x at {density_for(c['areal_ratio'][0])} / "
         f"{density_for(c['areal_ratio'][1])} changed (uncompressed)")]
    lines += ["", "Checks (reported: model):"] + [f"- {reported}: {modelled}" for reported, modelled in checks]
    lines += ["", f"By nccl (8.25 GB/s per GPU, published), qwen3-235b-a22b tp 8: full {nccl.full.seconds:.2f} s "
              f"({percent(nccl.full.share)}), + full every {ANCHOR_EVERY} {nccl.anchored.seconds:.2f} s "
              f"({percent(nccl.anchored.share)}); over one 100 Gb/s link: full {one_link.full.seconds:.1f} s "
              f"({percent(one_link.full.share)}), + full every {ANCHOR_EVERY} {one_link.anchored.seconds:.2f} s "
              f"({percent(one_link.anchored.share)})"]
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hardware", default="gb200,h100,h200")
    ap.add_argument("--out-dir", default="bench/results/perfmodel")
    ap.add_argument("--before", help="an earlier run's summary.json: each figure is followed by it in brackets")
    ap.add_argument("--moe", action="store_true", help="the mixture-of-experts projections and published check")
    ap.add_argument("--weight-sync", action="store_true",
                    help="weight sync with and without deltas: docs/projections.md's table, printed (h200)")
    args = ap.parse_args()
    if args.weight_sync:
        weight_sync_main()
        return
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.moe:
        moe_main(out)
        return
    summary = {}
    for hw in args.hardware.split(","):
        for name, argv in SCENARIOS.items():
            summary[f"{name}-{hw}"] = run(hw, argv, out, name, plot=(name == "qwen3-8b-eagle3-decay" and hw == "gb200"))
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    before = json.loads(Path(args.before).read_text()) if args.before else {}
    lines = ["speedup over plain decoding by concurrency (sequences per engine); rollout batch and RL step speedups"
             + (" (in brackets: " + args.before + ")" if before else "")]
    for key, s in summary.items():
        b = before.get(key)
        conc = list(s["speedup_k3"])
        lines += ["", f"{key} (tp {s['tp']})", f"  concurrency       {'  '.join(conc)}",
                  f"  plain step ms     {fmt(s['step_ms_k0'], conc, b and b['step_ms_k0'], '{:.1f}')}",
                  f"  speedup k = 3     {fmt(s['speedup_k3'], conc, b and b['speedup_k3'])}",
                  f"  best k            {fmt(s['best_k'], conc, b and b['best_k'], '{}')}",
                  f"  best speedup      {fmt(s['best_speedup'], conc, b and b['best_speedup'])}",
                  f"  rollout batch     k=3 {fmt(s['rollout_speedup'], ['k=3'], b and b['rollout_speedup'])}, "
                  f"k per step {fmt(s['rollout_speedup'], ['auto'], b and b['rollout_speedup'])}",
                  f"  RL step vs sync off (fixed: the best fixed k, {s['rl_fixed_k']}"
                  + (f" ({b['rl_fixed_k']})" if b else "") + ")  " + ", ".join(
                      f"{k} {fmt(s['rl_vs_sync_off'], [k], b and b['rl_vs_sync_off'])}" for k in s["rl_vs_sync_off"])]
    text = "\n".join(lines) + "\n"
    (out / "projections.txt").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
