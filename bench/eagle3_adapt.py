"""The EAGLE-3 head adapted online against the same head frozen, from two GRPO runs' metrics
(`bash bench/grpo_runs.sh adapt-eagle3` writes them and calls this): a per-step table of both arms (acceptance of
the step's samples and per draft position, mean k chosen, generation time, adaptation time, KL to the start
policy), the means over the last N steps with the issue's goals checked, and plots.

    python -m bench.eagle3_adapt runs/eagle3-frozen runs/eagle3-online --out bench/results/grpo-eagle3-adapt

Goals (issue 30, item 2), over the last --last steps: the adapted head's acceptance >= the frozen head's + 0.05,
its generation time no slower, and the adaptation (time on the trainer's critical path plus the UpdateDraft push)
<= 10% of a step. Writes table.md, summary.json and acceptance.png, k_and_time.png into --out.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from trainer_example.plot import read_jsonl


def generation_s(r: dict) -> float:
    """The Generate call's wall time (sync: the generate phase; async: the prefetched batch's own call)."""
    return r.get("generation_wall_s", r["generate_s"])


def adaptation_s(r: dict) -> float:
    """The adaptation's cost to the step: its time on the critical path and the drafter's push (when pushed)."""
    return r.get("adapt_s", 0.0) + (r.get("draft_push_s", 0.0) if r.get("draft_pushed") is not None else 0.0)


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _f(x, digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def positions(r: dict) -> list[float]:
    """The step's acceptance per draft position (GetStatus's stats of the versions that generated its samples); runs
    from before the trainer recorded it: the k controller's running estimate."""
    return list(r.get("position_acceptance") or r.get("draft_acceptance") or [])


def summarise(rows: list[dict], last: int) -> dict:
    window = rows[-last:] if len(rows) > 1 else rows
    window = [r for r in window if r["step"] > 0] or window          # step 0 carries warm-up
    per_pos = [positions(r) for r in window if positions(r)]
    width = max((len(p) for p in per_pos), default=0)
    return {"steps": [r["step"] for r in window],
            "acceptance": _mean([r.get("acceptance_rate") for r in window]),
            "acceptance_per_position": [_mean([p[i] for p in per_pos if len(p) > i]) for i in range(width)],
            "k_mean": _mean([r.get("k_mean") for r in window]),
            "generation_s": _mean([generation_s(r) for r in window]),
            "adaptation_s": _mean([adaptation_s(r) for r in window]),
            "head_train_s": _mean([r.get("head_train_s") for r in window]),
            "step_s": _mean([r["step_s"] for r in window]),
            "adaptation_fraction": _mean([adaptation_s(r) / r["step_s"] for r in window if r["step_s"] > 0]),
            "kl_to_start_last": rows[-1].get("kl_to_start") if rows else None,
            "head_expected_acceptance": _mean([_mean(r.get("head_expected_acceptance") or [None]) for r in window])}


def goals(frozen: dict, online: dict) -> dict:
    out = {}
    if frozen["acceptance"] is not None and online["acceptance"] is not None:
        gain = online["acceptance"] - frozen["acceptance"]
        out["acceptance_gain"] = {"value": gain, "goal": ">= 0.05", "met": gain >= 0.05}
    if frozen["generation_s"] and online["generation_s"] is not None:
        ratio = online["generation_s"] / frozen["generation_s"]
        out["generation_ratio"] = {"value": ratio, "goal": "<= 1.00", "met": ratio <= 1.0}
    if online["adaptation_fraction"] is not None:
        out["adaptation_fraction"] = {"value": online["adaptation_fraction"], "goal": "<= 0.10",
                                      "met": online["adaptation_fraction"] <= 0.10}
    return out


def step_table(runs: dict[str, list[dict]]) -> list[str]:
    names = list(runs)
    head = "| step | " + " | ".join(f"{n}: acceptance (per position) | k | gen s | adapt s | KL" for n in names) + " |"
    lines = [head, "| ---: | " + " | ".join("--- | ---: | ---: | ---: | ---:" for _ in names) + " |"]
    steps = sorted({r["step"] for rows in runs.values() for r in rows})
    by = {n: {r["step"]: r for r in rows} for n, rows in runs.items()}
    for s in steps:
        cells = []
        for n in names:
            r = by[n].get(s)
            if r is None:
                cells.append("- | - | - | - | -")
                continue
            pos = " ".join(f"{a:.2f}" for a in positions(r))
            cells.append(f"{_f(r.get('acceptance_rate'))} ({pos or '-'}) | {_f(r.get('k_mean'))} | "
                         f"{generation_s(r):.1f} | {adaptation_s(r):.1f} | {_f(r.get('kl_to_start'), 3)}")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return lines


def plot(runs: dict[str, list[dict]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4))
    for name, rows in runs.items():
        acc = [r for r in rows if r.get("acceptance_rate") is not None]
        line, = a1.plot([r["step"] for r in acc], [r["acceptance_rate"] for r in acc], marker=".", label=name)
        width = max((len(positions(r)) for r in rows), default=0)
        for i in range(width):
            pts = [(r["step"], positions(r)[i]) for r in rows if len(positions(r)) > i]
            a2.plot([s for s, _ in pts], [a for _, a in pts], color=line.get_color(), alpha=1.0 - 0.25 * i,
                    linestyle=["-", "--", ":", "-."][i % 4], label=f"{name}, position {i + 1}")
    a1.set(xlabel="step", ylabel="accepted / drafted (the step's samples)", title="acceptance per step")
    a2.set(xlabel="step", ylabel="acceptance at the position", title="acceptance per draft position")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "acceptance.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    series = [("k_mean", "mean k chosen", lambda r: r.get("k_mean")),
              ("generation", "generation s", generation_s),
              ("adaptation", "adaptation s (critical path + push)", adaptation_s),
              ("kl", "KL to the start policy", lambda r: r.get("kl_to_start"))]
    for ax, (_, label, get) in zip(axes, series):
        for name, rows in runs.items():
            pts = [(r["step"], get(r)) for r in rows if get(r) is not None]
            ax.plot([s for s, _ in pts], [v for _, v in pts], marker=".", label=name)
        ax.set(xlabel="step", ylabel=label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "k_and_time.png", dpi=110)
    plt.close(fig)
    return [out / "acceptance.png", out / "k_and_time.png"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("frozen", help="run directory of the frozen head (its metrics.jsonl)")
    ap.add_argument("online", help="run directory of the head adapted online")
    ap.add_argument("--last", type=int, default=10, help="steps the summary and goals average over")
    ap.add_argument("--out", help="directory for table.md, summary.json and the plots (default: print only)")
    args = ap.parse_args(argv)
    runs = {Path(d).name: read_jsonl(Path(d) / "metrics.jsonl") for d in (args.frozen, args.online)}
    (fname, frozen_rows), (oname, online_rows) = runs.items()
    frozen, online = summarise(frozen_rows, args.last), summarise(online_rows, args.last)
    met = goals(frozen, online)
    lines = [f"Per step ({fname} frozen, {oname} adapted online):", "", *step_table(runs), "",
             f"Means over steps {frozen['steps'][0] if frozen['steps'] else '-'}-"
             f"{frozen['steps'][-1] if frozen['steps'] else '-'} (the last {args.last}, step 0 excluded):", "",
             "| run | acceptance | per position | mean k | generation s | adaptation s | of the step | head trained s "
             "| step s | KL to start (last) |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, m in ((fname, frozen), (oname, online)):
        lines.append(f"| {name} | {_f(m['acceptance'])} | {' '.join(_f(a) for a in m['acceptance_per_position'])} "
                     f"| {_f(m['k_mean'])} | {_f(m['generation_s'], 1)} | {_f(m['adaptation_s'], 1)} "
                     f"| {_f(m['adaptation_fraction'])} | {_f(m['head_train_s'], 1)} | {_f(m['step_s'], 1)} "
                     f"| {_f(m['kl_to_start_last'], 3)} |")
    lines += ["", "Goals: " + "; ".join(f"{k} {_f(v['value'])} (goal {v['goal']}): {'met' if v['met'] else 'NOT met'}"
                                        for k, v in met.items())]
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "table.md").write_text("\n".join(lines) + "\n")
        try:
            from bench.harness import write_result          # python -m bench.eagle3_adapt
        except ImportError:
            from harness import write_result                # python bench/eagle3_adapt.py
        write_result("eagle3_adapt", {"frozen": args.frozen, "online": args.online, "last": args.last},
                     {fname: frozen, oname: online, "goals": met}, out=out / "summary.json")
        for p in plot(runs, out):
            print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
