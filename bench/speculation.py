"""Speculation on vs off on an RL-shaped workload, plain and speculative engines interleaved (not a test).

    .venv/bin/python bench/speculation.py [--methods draft_model,eagle3,ngram,suffix,plain]
                                          [--fixed-k draft_model:3,eagle3:2,ngram:3,suffix:3]
                                          [--no-fixed] [--concurrency 1,4,8,16,32,64] [--max-tokens 128]
                                          [--samples-per-slot 2] [--min-samples 16] [--rounds 2]
                                          [--draft-model DIR] [--eagle3-head DIR[,DIR...]] [--json
                                          bench/results/speculation.json]
    .venv/bin/python bench/speculation.py --plot bench/results/speculation.json   # its table and .png, no engines

Workload: prompts from the trainer example's task (chat template), groups of 4 samples, up to --max-tokens new
tokens, temperature 1.0, natural EOS. Each concurrency C is held: C sequences stay in flight (a finished one is
replaced by the next sample) until max(--min-samples, C * --samples-per-slot) samples finished. Every draw takes
fresh prompts and seeds from one stream, as a trainer's next batch would, and each engine serves a draw once: a
drafter that remembers earlier outputs (suffix decoding) must not draft a sample it has already seen with the same
seed.

This machine drifts up to 3x within a day, so engines are not measured one after the other: one plain engine
stays up for the whole run and, per method, two speculative engines beside it: k chosen by the controller
(engine.speculation.k_control = "auto", speculation/k_controller.py) and the method's best fixed k (--no-fixed:
the controller only). A cell is --rounds draws; each draw is served by the plain engine and the speculative ones
in turn (plain, auto, fixed; then auto, fixed, plain for the next draw: bench/harness.py's turns), so the engines
are compared on the same prompts and seeds (two plain runs on different draws differed by up to 24% at 4-8
sequences in one run, the samples' lengths being set by natural EOS) and within the same minutes. A cell's rate is
all its tokens over all its wall time; the speedup per draw is kept too (`speedup_by_round`), and `plain_spread`
is how far the plain engine's draws differ. The auto engine first runs a warm-up at every concurrency, as many
samples as a draw at up to 64 tokens each: its controller measures k = 0, 1, ... in each batch-size bucket it meets,
as in the first minutes of serving (with a warm-up of one sample per slot, a draft model's first draw at 4 sequences
still ran 42 steps measuring or drafting against 0-20 in each draw after it; bench/speculation_repeat.py,
2026-11-26, retired; last at commit ed4ce89).

`--methods plain` puts a second plain engine in the auto engine's place: two identical engines measured against
each other the same way, the noise floor a cell's speedup is read against.

Per cell: speedup = spec tok/s / plain tok/s; vLLM's acceptance (accepted / drafted) and mean acceptance
length L over the drafting steps; the per-token acceptance a solved from L (speculation/speedup.py); the
drafter cost c (one drafter forward over one target forward at the same batch, timed in PyTorch; 0 for
n-gram and suffix decoding); the analytical bound (1 - a^(k+1)) / ((1 - a)(1 + c k)) at the k the cell drafted
(for auto rows the best bound over k = 0..k_max, 1.0 being k = 0); and for auto rows the share of engine steps at
each k and the share run with the drafter switched off (k = 0 where the controller found drafting loses).
Results go to --json (the cells as its summary) and a table on stdout.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import statistics
import time
from collections import defaultdict
from pathlib import Path

from harness import turns, write_result


class Workload:
    """The stream of task prompts and seeds: each measurement takes the next ones."""

    def __init__(self, tokenizer):
        self.tokenizer, self.taken = tokenizer, 0

    def take(self, n: int) -> tuple[list[list[int]], int]:
        """Prompts for n samples in groups of 4, and the first seed (sample j gets seed + j)."""
        from rollout_service.drafting.drafters import task_prompts

        first, groups = self.taken, (n + 3) // 4
        self.taken += groups
        return task_prompts(self.tokenizer, groups, start=50_000 + first), 1000 + 4 * first


class Draw:
    """One draw of n samples' prompts and seeds, served by several engines in turn (a paired comparison: each engine
    sees the draw once, so suffix decoding still never drafts from a sample it has seen)."""

    def __init__(self, work: Workload, n: int):
        self.n, self.drawn = n, work.take(n)

    def take(self, n: int) -> tuple[list[list[int]], int]:
        if n != self.n:
            raise ValueError(f"this draw holds {self.n} samples, not {n}")
        return self.drawn


async def held(eng, work: Workload | Draw, c: int, n: int, max_tokens: int, tag: str) -> dict:
    """`n` samples with `c` in flight at all times (until fewer than c are left): throughput and speculation counts."""
    from tqdm import tqdm

    from rollout_service.engine.types import SeqRequest

    prompts, seed = work.take(n)
    todo = iter(range(n))                  # sample j: prompt j // 4, so a group's samples run together
    results = []
    bar = tqdm(total=n, desc=f"    {tag} concurrency {c}", unit="sample", leave=False)

    async def slot():
        for j in todo:
            results.append(await eng.generate(SeqRequest(
                seq_id=f"{tag}-c{c}-{j}-{time.monotonic_ns()}", prompt_token_ids=prompts[j // 4], temperature=1.0,
                max_tokens=max_tokens, seed=seed + j)))
            bar.update()
    t = time.perf_counter()
    await asyncio.gather(*(slot() for _ in range(c)))
    wall = time.perf_counter() - t
    bar.close()
    return summary(sum(len(r.token_ids) for r in results), wall, sum(r.num_accepted for r in results),
                   sum(r.num_drafted for r in results), sum(r.spec_steps for r in results),
                   position_sums([r.accepted_per_pos for r in results]))


def position_sums(lists: list[list[int]]) -> list[int]:
    """Accepted drafts per draft position, summed over samples or measurements (lists of any lengths)."""
    return [sum(x[i] for x in lists if len(x) > i) for i in range(max(map(len, lists), default=0))]


def summary(tokens: int, wall: float, accepted: int, drafted: int, steps: int, per_pos: list[int]) -> dict:
    return {"tok_s": tokens / wall, "tokens": tokens, "wall": wall, "accepted": accepted, "drafted": drafted,
            "rate": accepted / drafted if drafted else 0.0, "steps": steps, "accepted_per_pos": per_pos,
            "mal": 1 + accepted / steps if steps else 1.0, "drafts_per_step": drafted / steps if steps else 0.0}


def pooled(runs: list[dict]) -> dict:
    """Several held() measurements of one engine as one: all their tokens over all their wall time."""
    return summary(*(sum(r[key] for r in runs) for key in ("tokens", "wall", "accepted", "drafted", "steps")),
                   position_sums([r["accepted_per_pos"] for r in runs]))


def drafter_cost(model: str, method: str, drafter: str, concurrency: list[int], ctx: int = 32, reps: int = 3) -> dict:
    """One drafter forward / one target forward at equal batch and length, in PyTorch (0 for n-gram)."""
    if method not in ("draft_model", "eagle3"):
        return {c: 0.0 for c in concurrency}
    import torch
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    if method == "eagle3":
        from rollout_service.drafting.eagle3 import load_head

        head = load_head(drafter, target).eval()
    else:
        head = AutoModelForCausalLM.from_pretrained(drafter, dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        for c in concurrency:
            ids = torch.randint(0, 1000, (c, ctx))
            aux = torch.randn(c, ctx, head.fc.in_features) if method == "eagle3" else None

            def run_drafter(ids=ids, aux=aux):
                return head.unroll(aux, ids, 1) if aux is not None else head(input_ids=ids)

            times = []
            for fn in (lambda ids=ids: target(input_ids=ids), run_drafter):
                fn()
                t = time.perf_counter()
                for _ in range(reps):
                    fn()
                times.append(time.perf_counter() - t)
            out[c] = times[1] / times[0]
    return out


async def start(model: str, spec, env: dict | None = None):
    """A warmed-up engine; env: variables its processes get (set around the start only, as the engines' own
    environment is taken at start)."""
    from rollout_service.config import EngineConfig
    from rollout_service.engine.cpu_env import extra_environment
    from rollout_service.engine.types import SeqRequest
    from rollout_service.engine.vllm_engine import VllmEngine

    eng = VllmEngine("bench", model, EngineConfig(max_model_len=1024, kv_cache_gb=1.5, speculation=spec))
    with extra_environment(env):
        await eng.start()
    await eng.generate(SeqRequest(seq_id=f"warm-{time.monotonic_ns()}", prompt_token_ids=[1, 2, 3], max_tokens=4))
    return eng


def cell_bound(r: dict, k, k_max: int, c: float) -> tuple[float, float]:
    """(per-token a, bound) for a measured cell; auto cells get the best bound over k = 0..k_max."""
    from rollout_service.speculation.speedup import per_token_acceptance, speedup_bound

    kd = max(1, round(r["drafts_per_step"])) if r["drafts_per_step"] else 0
    a = per_token_acceptance(r["mal"], kd) if kd else 0.0
    if k == "auto":
        return a, max([1.0] + [speedup_bound(a, kk, c) for kk in range(1, k_max + 1)])
    return a, speedup_bound(a, k, c)


def steps_share(before: dict | None, after: dict | None) -> list[float]:
    if not before or not after:
        return []
    d = [x - y for x, y in zip(after["steps_by_k"], before["steps_by_k"])]
    return [round(x / max(1, sum(d)), 3) for x in d]


def off_share(before: dict | None, after: dict | None) -> float | None:
    """The share of engine steps the controller ran with the drafter switched off (k = 0, nothing drafted)."""
    if not before or not after:
        return None
    steps = sum(after["steps_by_k"]) - sum(before["steps_by_k"])
    return round((after.get("off_steps", 0) - before.get("off_steps", 0)) / max(1, steps), 3)


async def run(args) -> list[dict]:
    from transformers import AutoTokenizer

    from rollout_service.cli import resolve_model
    from rollout_service.config import SpeculationConfig
    from rollout_service.drafting.drafters import default_drafter_dir

    model = resolve_model(args.model)
    drafters = {"draft_model": [args.draft_model or str(default_drafter_dir("draft_model"))],
                "eagle3": (args.eagle3_head or str(default_drafter_dir("eagle3"))).split(","), "ngram": [""],
                "suffix": [""], "plain": [""]}
    runs = [(m, d) for m in args.methods.split(",") for d in drafters[m]]       # several heads: one after another
    conc = [int(x) for x in args.concurrency.split(",")]
    fixed = {m: int(k) for m, k in (p.split(":") for p in args.fixed_k.split(","))}
    n_of = {c: max(args.min_samples, c * args.samples_per_slot) for c in conc}
    work = Workload(AutoTokenizer.from_pretrained(model))
    date = datetime.date.today().isoformat()
    print(f"target {model}; concurrency {conc}; max_tokens {args.max_tokens}; temperature 1.0; {date}", flush=True)
    plain = await start(model, SpeculationConfig())
    cells = []
    try:
        for method, drafter in runs:
            k = fixed.get(method, 1)
            cost = drafter_cost(model, method, drafter, conc)
            print(f"{method}: drafter {drafter or '-'}; cost c by concurrency "
                  + ", ".join(f"{c}: {v:.3f}" for c, v in cost.items()), flush=True)
            common = dict(method=method, model=drafter, num_speculative_tokens=k,
                          prompt_lookup_min=2, prompt_lookup_max=5)
            if method == "plain":                  # a second plain engine in the auto engine's place: the noise floor
                auto, fix = await start(model, SpeculationConfig()), None
            else:
                auto = await start(model, SpeculationConfig(k_control="auto", **common))
                fix = None if args.no_fixed else await start(model, SpeculationConfig(k_control="fixed", **common))
            try:
                for c in conc:                                   # the controller's first minutes of serving
                    await held(auto, work, c, n_of[c], min(64, args.max_tokens), "warm-up")
                for c in conc:
                    snap0 = await auto.k_control_snapshot()
                    runs = {"plain": [], "auto": [], k: []}
                    for rnd in range(args.rounds):          # plain and speculative on one draw; the order alternates
                        draw = Draw(work, n_of[c])
                        engines = {"plain": plain, "auto": auto} | ({k: fix} if fix else {})
                        for name in turns(engines, rnd):          # a settle pause before each
                            tag = "plain" if name == "plain" else f"{method} k={name}"
                            runs[name].append(await held(engines[name], draw, c, n_of[c], args.max_tokens, tag))
                    snap1 = await auto.k_control_snapshot()
                    plain_rates = [r["tok_s"] for r in runs["plain"]]
                    p = pooled(runs["plain"])["tok_s"]
                    for kk in ("auto", k) if fix else ("auto",):
                        r = pooled(runs[kk])
                        a, bound = cell_bound(r, kk, k, cost[c])
                        cells.append({"method": method, "drafter": Path(drafter).name, "k": kk,
                                      "concurrency": c, "plain_tok_s": round(p, 2),
                                      "spec_tok_s": round(r["tok_s"], 2), "speedup": round(r["tok_s"] / p, 3),
                                      "speedup_by_round": [round(x["tok_s"] / y["tok_s"], 3)
                                                           for x, y in zip(runs[kk], runs["plain"])],
                                      "samples": n_of[c] * args.rounds,
                                      "bound": round(bound, 3), "acceptance_rate": round(r["rate"], 3),
                                      "mean_acceptance_length": round(r["mal"], 3), "per_token_acceptance": round(a, 3),
                                      "drafts_per_drafting_step": round(r["drafts_per_step"], 2),
                                      "drafter_cost": round(cost[c], 3),
                                      "plain_spread": round((max(plain_rates) - min(plain_rates)) / p, 3),
                                      "k_share": steps_share(snap0, snap1) if kk == "auto" else [],
                                      "drafter_off_share": off_share(snap0, snap1) if kk == "auto" else None,
                                      "date": date})
                        print(f"  {method:<11} k={kk!s:<4} conc {c:>2}: plain {p:7.1f} tok/s, spec {r['tok_s']:7.1f} "
                              f"tok/s, speedup {r['tok_s'] / p:5.2f} (by round "
                              f"{' '.join(str(x) for x in cells[-1]['speedup_by_round'])}; bound {bound:4.2f}), "
                              f"L {r['mal']:.2f}",
                              flush=True)
                print(f"  {method} controller: {await auto.k_control_snapshot()}", flush=True)
                if args.json:                     # a run stopped later keeps the methods it finished
                    write_result("speculation", vars(args), cells, out=args.json, partial=True)
            finally:
                await auto.shutdown()
                if fix:
                    await fix.shutdown()
    finally:
        await plain.shutdown()
    return cells


def print_table(cells: list[dict]) -> None:
    print("\nmethod          k  conc  plain tok/s  spec tok/s  speedup  bound  speedup/bound  accepted/drafted"
          "  mean acc len"
          "  per-token a  cost c  plain spread  by round     steps by k (drafter off)")
    for x in cells:
        share = " ".join(f"{v:.2f}" for v in x["k_share"]) or "-"
        rounds = " ".join(f"{v:.2f}" for v in x.get("speedup_by_round", []))
        if x.get("drafter_off_share") is not None:
            share += f" ({x['drafter_off_share']:.2f})"
        print(f"{x['method']:<12} {x['k']!s:>4} {x['concurrency']:>5} {x['plain_tok_s']:>12.1f} "
              f"{x['spec_tok_s']:>11.1f} {x['speedup']:>8.2f} {x['bound']:>6.2f} "
              f"{x['speedup'] / x['bound']:>14.2f} {x['acceptance_rate']:>17.3f}"
              f" {x['mean_acceptance_length']:>13.2f} {x['per_token_acceptance']:>12.3f} {x['drafter_cost']:>7.2f}"
              f" {x['plain_spread']:>13.2f}  {rounds:<11}  {share}")


# ---- --plot: speedup over the plain engine by concurrency, a panel per method (and drafter), one line per k, beside
# the analytical bound, with the 1.8x goal, break-even and the 0.97 floor marked; where a cell has several paired
# draws, the controller's line carries the 95% interval of their geometric mean (Student's t over the draws' log
# ratios), and a markdown table of the same is printed
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 11: 2.20}


def interval(ratios: list[float]) -> tuple[float, float, float] | None:
    """Geometric mean of paired draws' speedups and its 95% interval (None under two draws)."""
    if len(ratios) < 2:
        return None
    logs = [math.log(r) for r in ratios]
    mean, half = statistics.fmean(logs), T95.get(len(logs) - 1, 1.96) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def read_cells(path: Path) -> list[dict]:
    """--json's cells (the summary, or a file from before bench/harness.py: a list), as rows with method, k ("auto"
    or a number), conc, speedup and bound."""
    import json

    cells = json.loads(path.read_text())
    cells = cells["summary"] if isinstance(cells, dict) else cells
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
    ap.add_argument("--model")
    ap.add_argument("--draft-model")
    ap.add_argument("--eagle3-head", help="EAGLE-3 head (default: `rollout-service prepare-drafter --kind eagle3`); "
                                          "several, comma-separated, are measured one after another")
    ap.add_argument("--methods", default="draft_model,eagle3,ngram,suffix",
                    help="speculation methods; 'plain': a second plain engine in the auto engine's place, what two "
                         "identical engines measure against each other (the noise floor of a cell)")
    ap.add_argument("--fixed-k", default="draft_model:3,eagle3:2,ngram:3,suffix:3",
                    help="each method's fixed k (its best in earlier runs); also the controller's k_max")
    ap.add_argument("--no-fixed", action="store_true",
                    help="measure only the controller's engine against plain (a quarter less time per method)")
    ap.add_argument("--concurrency", default="1,4,8,16,32,64")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--samples-per-slot", type=int, default=2,
                    help="samples per measurement per concurrent sequence")
    ap.add_argument("--min-samples", type=int, default=16, help="samples per measurement at least (low concurrency)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="draws per cell, each served by plain and speculative engines in turn (order alternating)")
    ap.add_argument("--json", default="bench/results/speculation.json",
                    help="where the cells go, as the summary of bench/harness.py's schema ('' for nowhere)")
    ap.add_argument("--plot", type=Path, metavar="CELLS", help="no engines: plot and tabulate CELLS (an earlier "
                    "--json) to CELLS.png")
    args = ap.parse_args()
    if args.plot:
        rows = read_cells(args.plot)
        print(table(rows))
        print(plot(rows, args.plot.with_suffix(".png")))
        return
    cells = asyncio.run(run(args))
    print_table(cells)
    if args.json:
        print(f"wrote {write_result('speculation', vars(args), cells, out=args.json)}")


if __name__ == "__main__":
    main()
