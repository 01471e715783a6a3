"""Summarise GRPO runs side by side (bench/grpo_runs.sh calls it): mean step time per phase over steps
1..N-1 of each run (step 0 carries warm-up), ratios against the first run, acceptance per drafter version,
and held-out accuracy first -> last.

    python -m bench.grpo_table runs/a runs/b ... --steps 4
"""
from __future__ import annotations

import argparse
from pathlib import Path

from trainer_example.plot import read_jsonl

PHASES = ["generate_s", "recompute_s", "train_s", "push_s", "step_s"]


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
    base = next(iter(table.values()))[1]["step_s"]
    print(f"| run | generate s | recompute s | train s | push s | step s | step vs {next(iter(table))} "
          f"| acceptance (first -> last step) | held-out accuracy (before -> end) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    for name, (rows, m) in table.items():
        acc = [r["acceptance_rate"] for r in rows if r.get("acceptance_rate") is not None]
        ev = [rows[0]["eval_before"]] + [r["eval_accuracy"] for r in rows if r.get("eval_accuracy") is not None]
        print(f"| {name} | {m['generate_s']:.1f} | {m['recompute_s']:.1f} | {m['train_s']:.1f} | {m['push_s']:.1f} "
              f"| {m['step_s']:.1f} | {m['step_s'] / base:.2f} | "
              + (f"{acc[0]:.2f} -> {acc[-1]:.2f}" if acc else "-") + " | "
              + (f"{ev[0]:.3f} -> {ev[-1]:.3f}" if ev else "-") + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
