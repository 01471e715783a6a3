"""Summarise GRPO runs side by side (bench/grpo_runs.sh calls it): mean step time per phase over steps
1..N-1 of each run (step 0 carries warm-up), ratios against the first run, acceptance per drafter version,
held-out accuracy first -> last, and for runs that evaluated on the same problems before and after, an exact
McNemar test of the change (paired: each held-out problem solved before / after). Runs on quantized rollouts get a
second table: the rollout correction, reward, and the served-vs-trainer mismatch the correction acts on.

    python -m bench.grpo_table runs/a runs/b ... --steps 4
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from trainer_example.plot import read_jsonl

PHASES = ["generate_s", "recompute_s", "train_s", "push_s", "step_s"]


def mcnemar(before: str, after: str) -> tuple[int, int, float]:
    """Paired change on the same problems ('0'/'1' per problem): (newly solved, newly failed, exact two-sided
    p-value of the sign test on those discordant pairs, under 'training changed nothing')."""
    if len(before) != len(after):
        raise ValueError(f"evaluations of different sizes ({len(before)} vs {len(after)}) cannot be paired")
    gained = sum(b == "0" and a == "1" for b, a in zip(before, after))
    lost = sum(b == "1" and a == "0" for b, a in zip(before, after))
    n = gained + lost
    tail = sum(math.comb(n, i) for i in range(min(gained, lost) + 1)) / 2 ** n if n else 1.0
    return gained, lost, min(1.0, 2 * tail)


def accuracy_change(rows: list[dict]) -> str:
    """'0.385 -> 0.448 (+24 / -8 problems, McNemar p = 0.005, n = 256)', or the plain accuracies."""
    ev = [r for r in rows if r.get("eval_accuracy") is not None]
    if not rows or not ev:
        return "-"
    text = f"{rows[0]['eval_before']:.3f} -> {ev[-1]['eval_accuracy']:.3f}"
    if rows[0].get("eval_before_correct") and ev[-1].get("eval_correct"):
        gained, lost, p = mcnemar(rows[0]["eval_before_correct"], ev[-1]["eval_correct"])
        text += f" (+{gained} / -{lost} problems, McNemar p = {p:.3g}, n = {len(ev[-1]['eval_correct'])})"
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--steps", type=int, default=4, help="compare steps 1..steps-1 of every run")
    args = ap.parse_args(argv)
    table = {}
    for d in args.runs:
        rows = read_jsonl(Path(d) / "metrics.jsonl")
        window = rows[1:args.steps] or rows[:1]
        table[Path(d).name] = (rows, {k: sum(r[k] for r in window) / len(window) for k in PHASES})
    first = next(iter(table))
    base = table[first][1]
    print(f"| run | generate s | generate vs {first} | recompute s | train s | push s | step s | step vs {first} "
          "| acceptance (first -> last step) | mean k chosen (first -> last step) "
          "| held-out accuracy (before -> end) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |")
    for name, (rows, m) in table.items():
        acc = [r["acceptance_rate"] for r in rows if r.get("acceptance_rate") is not None]
        ks = [r["k_mean"] for r in rows if r.get("k_mean") is not None]
        gen = f"{m['generate_s'] / base['generate_s']:.2f}" if base["generate_s"] > 0 else "-"
        print(f"| {name} | {m['generate_s']:.1f} | {gen} | {m['recompute_s']:.1f} | {m['train_s']:.1f} "
              f"| {m['push_s']:.1f} | {m['step_s']:.1f} | {m['step_s'] / base['step_s']:.2f} | "
              + (f"{acc[0]:.2f} -> {acc[-1]:.2f}" if acc else "-") + " | "
              + (f"{ks[0]:.2f} -> {ks[-1]:.2f}" if ks else "-") + " | "
              + accuracy_change(rows) + " |")
    quantized = {n: rows for n, (rows, _) in table.items() if rows and rows[0].get("quantization", "none") != "none"}
    if quantized:
        print("\n" + correction_table(quantized))
    return 0


def correction_table(runs: dict[str, list[dict]]) -> str:
    """Per run on quantized rollouts: the correction, reward (first step -> last, mean over steps), the mean over
    steps of |log p_trainer - log p_served| per token, its KL (k3), the importance weight and the fraction of tokens
    whose weight pi_old / pi_rollout is past the cap (truncated by tis, dropped by mis; with none only measured)."""
    def mean(rows, k):
        vals = [r[k] for r in rows if r.get(k) is not None]
        return sum(vals) / len(vals) if vals else float("nan")
    lines = ["| run | served | correction | reward (first -> last step) | mean reward | mean \\|dlog p\\| | KL k3 "
             "| IS weight | past the cap | held-out accuracy (before -> end) |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, rows in runs.items():
        lines.append(f"| {name} | {rows[0]['quantization']} | {rows[0].get('rollout_correction', '-')} "
                     f"| {rows[0]['reward_mean']:.3f} -> {rows[-1]['reward_mean']:.3f} "
                     f"| {mean(rows, 'reward_mean'):.3f} | {mean(rows, 'rollout_logp_mismatch'):.3f} "
                     f"| {mean(rows, 'rollout_kl_k3'):.3f} | {mean(rows, 'is_weight_mean'):.3f} "
                     f"| {mean(rows, 'is_truncated_fraction'):.1%} | {accuracy_change(rows)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
