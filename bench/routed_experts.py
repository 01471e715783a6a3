"""What routing replay costs: generation throughput with routed experts returned against an engine that does not
capture them, in one interleaved run (not a test).

    .venv/bin/python bench/routed_experts.py [--model moe|DIR] [--concurrency 1,16] [--n 4] [--max-tokens 64]
                                             [--rounds 4] [--out bench/results/routed_experts.json]

Two services on the same mixture-of-experts model (default: the upcycled SmolLM2 MoE, `--model moe`), float32:
`on` captures routes (engine.routed_experts = auto) and every request asks for them (return_routed_experts), `off`
does not capture (engine.routed_experts = off). Rounds alternate on, off, off, on, ... (the order flips each round),
each a batch of `concurrency` prompts x n samples of max_tokens tokens (ignore_eos), from rollout_tasks; throughput
is generated tokens over the batch's wall time, the ratio on/off is taken per round and its median reported, with
the bytes of routes per generated token as they arrive (the proto's RoutedExperts.ids).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


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
    ap.add_argument("--out", default="bench/results/routed_experts.json")
    args = ap.parse_args()

    from tqdm import tqdm

    from rollout_client import RolloutClient
    from rollout_client.launcher import ServiceProcess
    from rollout_service.cli import resolve_model
    from rollout_service.model_info import ModelInfo
    from rollout_tasks.arithmetic import split

    model = resolve_model(args.model)
    info = ModelInfo.load(model, 1024)
    if info.moe is None:
        sys.exit(f"{model} is not a mixture of experts")
    prompts = [info.encode(p.prompt, chat=True) for p in split(64)]
    common = ["--dtype", "float32", "--max-model-len", "1024", "--kv-cache-gb", "2", "--max-num-seqs", "64"]
    logs = Path(tempfile.mkdtemp(prefix="routed-experts-"))
    arms = {"on": ServiceProcess(model, extra_args=common + ["--routed-experts", "auto"], log_path=logs / "on.log"),
            "off": ServiceProcess(model, extra_args=common + ["--routed-experts", "off"], log_path=logs / "off.log")}
    rows = []
    try:
        for svc in arms.values():
            svc.start()
        clients = {a: RolloutClient(svc.target) for a, svc in arms.items()}
        for c in clients.values():                           # warm-up
            c.generate_all(prompts[:2], n=1, max_tokens=8)
        levels = [int(x) for x in args.concurrency.split(",")]
        with tqdm(total=len(levels) * args.rounds * 2, desc="rounds", unit="batch") as bar:
            for conc in levels:
                for r in range(args.rounds):
                    order = ("on", "off") if r % 2 == 0 else ("off", "on")
                    picked = [prompts[(r * conc + i) % len(prompts)] for i in range(conc)]
                    got = {}
                    for arm in order:
                        got[arm] = batch(clients[arm], picked, args.n, args.max_tokens, arm == "on", seed=r)
                        bar.update()
                    rows.append({"concurrency": conc, "round": r, "order": list(order), **{
                        f"{arm}_{k}": v for arm, res in got.items() for k, v in res.items()},
                        "ratio": got["on"]["tok_s"] / got["off"]["tok_s"]})
        for c in clients.values():
            c.close()
    finally:
        for svc in arms.values():
            svc.stop()
    summary = []
    for conc in sorted({r["concurrency"] for r in rows}):
        rs = [r for r in rows if r["concurrency"] == conc]
        summary.append({"concurrency": conc, "samples_in_flight": conc * args.n,
                        "ratio_median": statistics.median(r["ratio"] for r in rs),
                        "ratio_min": min(r["ratio"] for r in rs), "ratio_max": max(r["ratio"] for r in rs),
                        "on_tok_s_median": statistics.median(r["on_tok_s"] for r in rs),
                        "off_tok_s_median": statistics.median(r["off_tok_s"] for r in rs),
                        "route_bytes_per_generated_token": sum(r["on_route_bytes"] for r in rs) /
                        sum(r["on_tokens"] for r in rs),
                        "route_bytes_per_row": sum(r["on_route_bytes"] for r in rs) / sum(r["on_rows"] for r in rs)})
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.node(),
           "command": "bench/routed_experts.py " + " ".join(sys.argv[1:]), "model": model,
           "moe": {"experts": info.moe.num_experts, "top_k": info.moe.top_k, "layers": info.moe.num_layers},
           "n": args.n, "max_tokens": args.max_tokens, "summary": summary, "rounds": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"{'conc':>5} {'in flight':>9} {'on tok/s':>9} {'off tok/s':>9} {'on/off':>7} {'range':>13} {'B/token':>8}")
    for s in summary:
        print(f"{s['concurrency']:>5} {s['samples_in_flight']:>9} {s['on_tok_s_median']:>9.1f} "
              f"{s['off_tok_s_median']:>9.1f} {s['ratio_median']:>7.3f} "
              f"{s['ratio_min']:>6.3f}-{s['ratio_max']:<6.3f} {s['route_bytes_per_generated_token']:>8.1f}")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
