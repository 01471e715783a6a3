"""What routing replay costs: generation throughput with routed experts returned against an engine that does not
capture them, in one interleaved run (not a test).

    .venv/bin/python bench/routed_experts.py [--model moe|DIR] [--concurrency 1,16] [--n 4] [--max-tokens 64]
                                             [--rounds 4] [--out bench/results/routed_experts.json]

Two services on the same mixture-of-experts model (default: the upcycled SmolLM2 MoE, `--model moe`), float32:
`on` captures routes (engine.routed_experts = auto) and every request asks for them (return_routed_experts), `off`
does not capture (engine.routed_experts = off). Rounds alternate on, off, off, on, ... (bench/harness.py's turns),
each a batch of `concurrency` prompts x n samples of max_tokens tokens (ignore_eos), from rollout_tasks; throughput
is generated tokens over the batch's wall time, the ratio on/off is taken per round and its median reported, with
the bytes of routes per generated token as they arrive (the proto's RoutedExperts.ids).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from harness import logs_dir, progress, ratios, services, turns, write_result


def batch(client, prompts, n: int, max_tokens: int, routes: bool, seed: int) -> dict:
    t0 = time.perf_counter()
    groups = client.generate_all(prompts, n=n, max_tokens=max_tokens, ignore_eos=True, temperature=1.0, seed=seed,
                                 return_routed_experts=routes)
    wall = time.perf_counter() - t0
    samples = [s for g in groups for s in g]
    tokens = sum(len(s.token_ids) for s in samples)
    route_bytes = sum(s.routed_experts.ids.nbytes for s in samples if s.routed_experts is not None)
    rows = sum(len(s.routed_experts.ids) for s in samples if s.routed_experts is not None)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "route_bytes": route_bytes, "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="moe")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=None, help="default bench/results/routed_experts.json")
    args = ap.parse_args()

    from rollout_client import RolloutClient
    from rollout_service.cli import resolve_model
    from rollout_service.model_info import ModelInfo
    from rollout_tasks.arithmetic import split

    model = resolve_model(args.model)
    info = ModelInfo.load(model, 1024)
    if info.moe is None:
        sys.exit(f"{model} is not a mixture of experts")
    prompts = [info.encode(p.prompt, chat=True) for p in split(64)]
    common = ["--dtype", "float32", "--max-model-len", "1024", "--kv-cache-gb", "2", "--max-num-seqs", "64"]
    levels = [int(x) for x in args.concurrency.split(",")]
    rows = []
    with services(model, {"on": common + ["--routed-experts", "auto"], "off": common + ["--routed-experts", "off"]},
                  logs_dir("routed-experts")) as up:
        clients = {a: RolloutClient(svc.target) for a, svc in up.items()}
        for c in clients.values():                           # warm-up
            c.generate_all(prompts[:2], n=1, max_tokens=8)
        with progress(len(levels) * args.rounds * 2, "rounds") as bar:
            for conc in levels:
                for r in range(args.rounds):
                    picked = [prompts[(r * conc + i) % len(prompts)] for i in range(conc)]
                    got = {}
                    for arm in turns(("on", "off"), r):
                        got[arm] = batch(clients[arm], picked, args.n, args.max_tokens, arm == "on", seed=r)
                        bar.update()
                    rows.append({"concurrency": conc, "round": r, "order": list(got), **got,
                                 "ratio": got["on"]["tok_s"] / got["off"]["tok_s"]})
        for c in clients.values():
            c.close()
    summary = []
    for conc in levels:
        rs = [r for r in rows if r["concurrency"] == conc]
        ratio, route_bytes = ratios(rs, "on", "off"), sum(r["on"]["route_bytes"] for r in rs)
        summary.append({"concurrency": conc, "samples_in_flight": conc * args.n, "ratio_median": ratio["median"],
                        "ratio_min": ratio["min"], "ratio_max": ratio["max"],
                        "on_tok_s_median": statistics.median(r["on"]["tok_s"] for r in rs),
                        "off_tok_s_median": statistics.median(r["off"]["tok_s"] for r in rs),
                        "route_bytes_per_generated_token": route_bytes / sum(r["on"]["tokens"] for r in rs),
                        "route_bytes_per_row": route_bytes / sum(r["on"]["rows"] for r in rs)})
    config = {"model": model, "moe": {"experts": info.moe.num_experts, "top_k": info.moe.top_k,
                                      "layers": info.moe.num_layers}, "n": args.n, "max_tokens": args.max_tokens}
    path = write_result("routed_experts", config, summary, rows, args.out)
    print(f"{'conc':>5} {'in flight':>9} {'on tok/s':>9} {'off tok/s':>9} {'on/off':>7} {'range':>13} {'B/token':>8}")
    for s in summary:
        print(f"{s['concurrency']:>5} {s['samples_in_flight']:>9} {s['on_tok_s_median']:>9.1f} "
              f"{s['off_tok_s_median']:>9.1f} {s['ratio_median']:>7.3f} "
              f"{s['ratio_min']:>6.3f}-{s['ratio_max']:<6.3f} {s['route_bytes_per_generated_token']:>8.1f}")
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
