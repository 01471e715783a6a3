"""The simulator's results as a table (stdout), JSON and a plot."""
from __future__ import annotations

import json
from pathlib import Path


def table(r: dict) -> str:
    hw, pol, dr, a, w = r["hardware"], r["policy"], r["drafter"], r["acceptance"], r["workload"]
    k_max = len(a["mean_length"]) - 1
    ep = "" if not pol.get("experts") else (
        f", {pol['experts']} experts top-{pol['experts_per_tok']}"
        + (f", ep {pol['ep']}: {pol['devices']} devices per engine" if pol["devices"] != pol["tp"] else ""))
    out = [(f"{pol['name']} ({pol['params'] / 1e9:.1f}B, {pol['active_params'] / 1e9:.1f}B active, tp {pol['tp']}{ep}) "
           f"on {hw['name']}; drafter {dr['method']} {dr['name'] or ''}"),
           (f"acceptance per position {', '.join(f'{x:.2f}' for x in a['per_position'])} ({a['source']}); "
           f"L(k) {' '.join(f'{x:.2f}' for x in a['mean_length'])}"),
           (f"mean context {w['mean_context']:.0f} tokens (prompt {w['prompt_len']}, output median "
           f"{w['median_output']}, mean {w['mean_output']:.0f}, longest {w['longest_output']})"), "",
           "speedup against plain decoding by concurrency (sequences per engine) and k:",
           f"{'conc':>5} {'bound':>8} {'plain tok/s':>12} "
           + " ".join(f"{'k=' + str(k):>6}" for k in range(1, k_max + 1))
           + f" {'best k':>7}"]
    for row in r["by_concurrency"]:
        out.append(f"{row['concurrency']:>5} {row['bound']:>8} {row['plain_tok_s']:>12.0f} "
                   + " ".join(f"{s:>6.2f}" for s in row["speedup"][1:]) + f" {row['best_k']:>7}"
                   + ("" if row.get("fits", True) else f"  (KV cache needs {row['memory_gb_per_device']} GB/device)"))
    out += ["", (f"one rollout batch ({w['sequences']} sequences over {w['engines']} engines, up to "
                f"{w['max_concurrency']} in flight each, draining to the longest):"),
            f"{'speculation':>12} {'seconds':>9} {'tok/s/engine':>13} {'speedup':>8}  steps by k"]
    for name, d in r["rollout"].items():
        out.append(f"{name:>12} {d['seconds']:>9.1f} {d['tok_s_per_engine']:>13.0f} {d['speedup']:>8.2f}  "
                   + " ".join(f"{k}:{v}" for k, v in d["k_steps"].items()))
    out += ["", f"RL step (training on {r['train_gpus']} GPUs):",
            (f"{'speculation':>12} {'mode':>14} {'generate s':>11} {'train s':>8} {'push s':>7} {'step s':>8} "
            f"{'vs sync off':>12}")]
    for x in r["rl"]:
        out.append(f"{x['speculation']:>12} {x['mode']:>14} {x['generate_s']:>11.1f} {x['train_s']:>8.1f} "
                   f"{x['push_s']:>7.1f} {x['step_s']:>8.1f} {x['speedup_vs_sync_off']:>12.2f}")
    return "\n".join(out)


def write_json(r: dict, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(r, indent=1) + "\n")


def plot(r: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = r["by_concurrency"]
    conc = [x["concurrency"] for x in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    for k in range(1, len(rows[0]["speedup"])):
        ax.plot(conc, [x["speedup"][k] for x in rows], marker=".", label=f"k={k}")
    ax.plot(conc, [x["best_speedup"] for x in rows], "k--", label="best k")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequences per engine")
    ax.set_ylabel("speedup vs plain decoding")
    ax.set_title(f"{r['policy']['name']} + {r['drafter']['method']} on {r['hardware']['name']} (modelled)")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
