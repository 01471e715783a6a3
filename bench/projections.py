"""The GPU projections of docs/projections.md, re-run in one go (not a test; seconds):

    .venv/bin/python bench/projections.py [--hardware gb200,h100,h200] [--out-dir bench/results/perfmodel]
        [--before SUMMARY.json]     # print each figure beside an earlier run's (e.g. the model before a change)

For each hardware profile, `rollout-service simulate` (perfmodel/simulate.build) on the scenarios of the seed-paper
comparison: Qwen3-8B with an EAGLE-3 head at per-token acceptance 0.56 and 0.68 (L(3) = 2.05, 2.47) and a decaying
per-position profile, n-gram at 0.15, and Qwen3-235B-A22B with the head at 0.62 (512 prompts x 16, up to 512 in
flight). Writes each run's JSON (<scenario>-<hardware>.json), the plot of the decaying profile on gb200, and
summary.json / projections.txt: speedup at k = 3 and at the best k by concurrency, the rollout batch, the RL step.
An older model's summary (run this script with that model first on PYTHONPATH, --out-dir elsewhere) is read by
--before; a profile the older model lacks is stood in for as its H100 profile with the other's bandwidth and memory.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hardware", default="gb200,h100,h200")
    ap.add_argument("--out-dir", default="bench/results/perfmodel")
    ap.add_argument("--before", help="an earlier run's summary.json: each figure is followed by it in brackets")
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
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
