"""Plot bench/speculation.py's cells: speedup over the plain engine by concurrency, a panel per method (and
drafter), one line per k, beside the analytical bound, with the 1.8x goal, break-even and the 0.97 floor marked
(not a test).

    .venv/bin/python bench/plot_speculation.py bench/results/speculation.json [--out bench/results/speculation.png]
"""
from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path


def read_cells(path: Path) -> list[dict]:
    """bench/speculation.py's JSON cells, as rows with method, k ("auto" or a number), conc, speedup and bound."""
    import json

    cells = json.loads(path.read_text())
    if not cells:
        raise SystemExit(f"{path}: no cells")
    return [{"method": c["method"] + (f" ({c['drafter']})" if c.get("drafter") else ""), "k": str(c["k"]),
             "conc": c["concurrency"], "speedup": c["speedup"], "bound": c["bound"]} for c in cells]


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
            line, = ax.plot(xs, [r["speedup"] for r in pts], marker="o", lw=3 if auto else 1.5,
                            color="black" if auto else None, label="k chosen by the controller" if auto else f"k={k}")
            ax.plot(xs, [r["bound"] for r in pts], ls=":", color=line.get_color(), lw=1)
        ax.axhline(1.0, color="grey", lw=1)
        ax.axhline(0.97, color="grey", lw=1, ls="--")
        ax.axhline(1.8, color="red", lw=1, ls="--")
        ax.text(1, 1.82, "goal 1.8x", color="red", fontsize=8)
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
    print(plot(read_cells(args.cells), args.out or args.cells.with_suffix(".png")))


if __name__ == "__main__":
    main()
