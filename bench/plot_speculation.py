"""Plot bench/speculation.py's cells: speedup over the plain engine by concurrency, a panel per method (and
drafter), one line per k, beside the analytical bound, with the 1.8x goal, break-even and the 0.97 floor marked
(not a test). Where a cell has several paired draws, the controller's line carries the 95% interval of their
geometric mean (Student's t over the draws' log ratios), and a markdown table of the same is printed.

    .venv/bin/python bench/plot_speculation.py bench/results/speculation.json [--out bench/results/speculation.png]
"""
from __future__ import annotations

import argparse
import math
import statistics
from collections import defaultdict
from pathlib import Path

T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 11: 2.20}


def interval(ratios: list[float]) -> tuple[float, float, float] | None:
    """Geometric mean of paired draws' speedups and its 95% interval (None under two draws)."""
    if len(ratios) < 2:
        return None
    logs = [math.log(r) for r in ratios]
    mean, half = statistics.fmean(logs), T95.get(len(logs) - 1, 1.96) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def read_cells(path: Path) -> list[dict]:
    """bench/speculation.py's JSON cells, as rows with method, k ("auto" or a number), conc, speedup and bound."""
    import json

    cells = json.loads(path.read_text())
    if not cells:
        raise SystemExit(f"{path}: no cells")
    return [{"method": c["method"] + (f" ({c['drafter']})" if c.get("drafter") else ""), "k": str(c["k"]),
             "conc": c["concurrency"], "speedup": c["speedup"], "bound": c["bound"],
             "interval": interval(c.get("speedup_by_round") or [])} for c in cells]


def table(rows: list[dict]) -> str:
    """The controller's cells as markdown: pooled speedup, and the 95% interval over the paired draws."""
    conc = sorted({r["conc"] for r in rows})
    out = ["| method | " + " | ".join(f"{c} seq" for c in conc) + " |", "| --- |" + " ---: |" * len(conc)]
    for method in dict.fromkeys(r["method"] for r in rows):
        by = {r["conc"]: r for r in rows if r["method"] == method and r["k"] == "auto"}
        if by:
            out.append(f"| {method} | " + " | ".join(
                "-" if c not in by else f"{by[c]['speedup']:.2f}" + (
                    f" ({by[c]['interval'][1]:.2f}-{by[c]['interval'][2]:.2f})" if by[c]["interval"] else "")
                for c in conc) + " |")
    return "\n".join(out)


def plot(rows: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, len(methods), figsize=(5 * len(methods), 4.2), sharey=True, squeeze=False)
    for ax, method in zip(axes[0], methods):
        lines = defaultdict(list)
        for r in rows:
            if r["method"] == method:
                lines[r["k"]].append(r)
        for k, pts in lines.items():
            pts.sort(key=lambda r: r["conc"])
            xs = [r["conc"] for r in pts]
            auto = k == "auto"
            label = f"k={k}" if not auto else "a second plain engine" if method == "plain" else "k by the controller"
            line, = ax.plot(xs, [r["speedup"] for r in pts], marker="o", lw=3 if auto else 1.5,
                            color="black" if auto else None, label=label)
            if auto and all(r["interval"] for r in pts):
                ax.errorbar(xs, [r["speedup"] for r in pts], yerr=[[r["speedup"] - r["interval"][1] for r in pts],
                                                                   [r["interval"][2] - r["speedup"] for r in pts]],
                            fmt="none", ecolor="black", capsize=3, lw=1, label="95% interval over paired draws")
            ax.plot(xs, [r["bound"] for r in pts], ls=":", color=line.get_color(), lw=1)
        ax.axhline(1.0, color="grey", lw=1)
        ax.axhline(0.97, color="grey", lw=1, ls="--")
        ax.axhline(1.8, color="red", lw=1, ls="--")
        ax.text(1, 1.82, "goal 1.8x", color="red", fontsize=8)
        ax.set_ylim(0.4, max([2.0] + [r["bound"] + 0.2 for r in rows]))   # a two-draw interval can span 0.2-5x
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["conc"] for r in rows}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("concurrent sequences")
        ax.set_title(method)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("throughput / plain engine (dotted: analytical bound)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cells", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = read_cells(args.cells)
    print(table(rows))
    print(plot(rows, args.out or args.cells.with_suffix(".png")))


if __name__ == "__main__":
    main()
