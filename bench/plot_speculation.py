"""Plot bench/speculation.py's table: speedup over the plain engine by concurrency, one line per (method, k),
beside the analytical bound, with the 1.8x goal and break-even marked (not a test).

    .venv/bin/python bench/plot_speculation.py bench/results/speculation.txt [--out bench/results/speculation.png]
"""
from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path


def read_table(path: Path) -> list[dict]:
    """The rows of the final table: method, k (a number or `dyn`), concurrency, speedup and bound."""
    rows, in_table = [], False
    for line in path.read_text().splitlines():
        if line.startswith("method ") and "speedup" in line:
            in_table = True
            continue
        f = line.split()
        if in_table and len(f) >= 11:
            rows.append({"method": f[0], "k": f[1], "conc": int(f[2]), "speedup": float(f[5]), "bound": float(f[10])})
    if not rows:
        raise SystemExit(f"{path}: no bench/speculation.py table found")
    return rows


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
            dyn = k == "dyn"
            line, = ax.plot(xs, [r["speedup"] for r in pts], marker="o", lw=3 if dyn else 1.5,
                            color="black" if dyn else None, label="k by batch size" if dyn else f"k={k}")
            if not dyn:
                ax.plot(xs, [r["bound"] for r in pts], ls=":", color=line.get_color(), lw=1)
        ax.axhline(1.0, color="grey", lw=1)
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
    ap.add_argument("table", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    print(plot(read_table(args.table), args.out or args.table.with_suffix(".png")))


if __name__ == "__main__":
    main()
