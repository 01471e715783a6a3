"""Turn trainer metrics (JSONL, one line per step) into PNG plots.

    python -m trainer_example.plot runs/sync/metrics.jsonl runs/async/metrics.jsonl --out plots/

Writes accuracy.png (held-out accuracy and train reward), step_time.png (time per phase, one bar per run),
acceptance.png (speculation acceptance per step, with the drafter version), kl.png (KL to the start
policy) and, for runs on an MoE policy, routing_replay.png (the rollout-against-trainer log-prob mismatch per step
with and without routing replay), and for runs of `--task calculator`, tool_use.png (reward and the episodes' tool use
per step). Each run is labelled by its directory name.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

PHASES = ["generate_s", "recompute_s", "replay_check_s", "train_s", "adapt_s", "push_s"]


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _label(path: str) -> str:
    p = Path(path)
    return p.parent.name if p.name == "metrics.jsonl" else p.stem


def plot_runs(paths: list[str], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    runs = {_label(p): read_jsonl(p) for p in paths}
    written = []

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in runs.items():
        ev = [(0.0, rows[0]["eval_before"])] if rows and "eval_before" in rows[0] else []
        ev += [(r["elapsed_s"] / 60, r["eval_accuracy"]) for r in rows if r.get("eval_accuracy") is not None]
        n = rows[0].get("eval_size") if rows else None      # error bars: one binomial standard error
        err = [(a * (1 - a) / n) ** 0.5 for _, a in ev] if n else None
        a1.errorbar([t for t, _ in ev], [a for _, a in ev], yerr=err, marker="o", capsize=3,
                    label=name + (f" (n={n})" if n else ""))
        a2.plot([r["step"] for r in rows], [r["reward_mean"] for r in rows], label=name)
    a1.set(xlabel="wall time (min)", ylabel="held-out accuracy", title="held-out accuracy")
    a2.set(xlabel="step", ylabel="mean reward", title="train reward")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend()
    written.append(_save(fig, out / "accuracy.png"))

    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(runs)), 4))
    bottoms = [0.0] * len(runs)
    for phase in PHASES:
        vals = [_mean([r.get(phase, 0.0) for r in rows[1:] or rows]) for rows in runs.values()]
        ax.bar(list(runs), vals, bottom=bottoms, label=phase.removesuffix("_s"))
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    ax.set(ylabel="seconds per step (mean, first step excluded)", title="step time by phase")
    ax.legend()
    written.append(_save(fig, out / "step_time.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rows in runs.items():
        rows = [r for r in rows if r.get("acceptance_rate") is not None]
        if rows:
            ax.plot([r["step"] for r in rows], [r["acceptance_rate"] for r in rows], marker=".", label=name)
    ax.set(xlabel="step", ylabel="draft acceptance rate", title="speculation acceptance as the policy moves")
    ax.grid(alpha=0.3)
    ax.legend()
    written.append(_save(fig, out / "acceptance.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rows in runs.items():
        rows = [r for r in rows if r.get("kl_to_start") is not None]
        ax.plot([r["step"] for r in rows], [r["kl_to_start"] for r in rows], label=name)
    ax.set(xlabel="step", ylabel="KL(policy || start policy) per token", title="policy drift")
    ax.grid(alpha=0.3)
    ax.legend()
    written.append(_save(fig, out / "kl.png"))

    moe = {name: [r for r in rows if r.get("logp_mismatch_replay") is not None] for name, rows in runs.items()}
    if any(moe.values()):
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        for name, rows in moe.items():
            steps = [r["step"] for r in rows]
            for key, style, what in (("replay", "-o", "with replay"), ("no_replay", "--x", "without replay")):
                a1.plot(steps, [r[f"logp_mismatch_{key}"] for r in rows], style, label=f"{name}: {what}")
                a2.plot(steps, [max(r[f"kl_k3_{key}"], 1e-12) for r in rows], style, label=f"{name}: {what}")
        a1.set(xlabel="step", ylabel="mean |log p_trainer - log p_rollout|", title="log-prob mismatch per token")
        a2.set(xlabel="step", ylabel="KL(rollout || trainer), k3", title="KL estimate per token", yscale="log")
        for a in (a1, a2):
            a.grid(alpha=0.3)
            a.legend()
        written.append(_save(fig, out / "routing_replay.png"))

    tools = {name: [r for r in rows if r.get("tool_call_rate") is not None] for name, rows in runs.items()}
    if any(tools.values()):
        written.append(plot_tool_use(tools, out / "tool_use.png"))
    return written


def plot_tool_use(runs: dict[str, list[dict]], path: Path) -> Path:
    """--task calculator: mean reward and accuracy per step (left); the share of episodes with a tool call the server
    parsed, with a `<tool_call>` tried, and the well-formed share of tried calls (right)."""
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (name, rows) in enumerate(runs.items()):      # a colour per run, a line style per quantity
        steps, c = [r["step"] for r in rows], f"C{i}"
        a1.plot(steps, [r["reward_mean"] for r in rows], "-o", color=c, label=f"{name}: reward")
        a1.plot(steps, [r["train_accuracy"] for r in rows], "--x", color=c, label=f"{name}: accuracy")
        a2.plot(steps, [r["tool_call_rate"] for r in rows], "-o", color=c, label=f"{name}: episodes with a parsed call")
        a2.plot(steps, [r["attempt_rate"] for r in rows], "--x", color=c,
                label=f"{name}: episodes with a <tool_call> tried")
        formed = [(s, r["well_formed_rate"]) for s, r in zip(steps, rows) if r.get("well_formed_rate") is not None]
        a2.plot([s for s, _ in formed], [f for _, f in formed], ":s", color=c, mfc="none",
                label=f"{name}: well-formed share of tries")
    a1.set(xlabel="step", ylabel="per episode", title="reward (final answer) and accuracy", ylim=(-0.05, 1.15))
    a2.set(xlabel="step", ylabel="fraction", title="tool use", ylim=(-0.05, 1.05))
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    return _save(fig, path)


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else 0.0


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("metrics", nargs="+", help="metrics.jsonl files written by trainer_example.train")
    ap.add_argument("--out", default="plots", help="output directory for the PNGs")
    args = ap.parse_args(argv)
    for p in plot_runs(args.metrics, Path(args.out)):
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
