"""Where the CPU goes when `vllm serve` and the service serve the same batch, unstreamed unless --stream (not a test):
CPU seconds of each process (front end, engine core, worker) of both servers over one batch per arm, the idle server's
included, in the order given (default A B C A, so that the machine's drift shows as the first arm against itself).

    .venv/bin/python bench/vs_vllm_serve_cpu.py [--concurrency 64] [--order vllm_serve,dialect,grpc,vllm_serve]
        [--stream] [--out /tmp/vs_vllm_serve_cpu.json]

The load is bench/vs_vllm_serve.py's (n = 4, 128 tokens, log-probs, default model) with each arm on its own prompts of
the arithmetic task. The 2026-11-27 run and the py-spy profile beside it: bench/results/vs_vllm_serve_profile.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import vs_vllm_serve as vs  # noqa: E402


def tree_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of a process and its descendants, by name (the front end as "frontend")."""
    import psutil

    out = {}
    root = psutil.Process(pid)
    for p in [root] + root.children(recursive=True):
        try:
            t = p.cpu_times()
            name = "frontend" if p.pid == pid else p.name().replace("VLLM::", "")
            out[f"{name}:{p.pid}"] = t.user + t.system
        except psutil.Error:
            pass
    return out


def delta(a: dict, b: dict) -> dict[str, float]:
    return {k.rsplit(":", 1)[0]: round(b[k] - a.get(k, 0.0), 2) for k in b if b[k] - a.get(k, 0.0) > 0.05}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--order", default="vllm_serve,dialect,grpc,vllm_serve")
    ap.add_argument("--stream", action="store_true", help="streamed requests (default: unstreamed)")
    ap.add_argument("--out", default="/tmp/vs_vllm_serve_cpu.json")
    args = ap.parse_args()

    from rollout_service.cli import resolve_model
    from rollout_service.model_info import ModelInfo
    from rollout_tasks.arithmetic import split

    order = args.order.split(",")
    conc = args.concurrency
    model = resolve_model(None)
    prompts = [ModelInfo.load(model, 1024).encode(p.prompt, chat=True) for p in split(conc * len(order))]
    rows = []
    with vs.both_servers(model, "auto", 1024, 64, 2) as (vllm, svc, targets):
        for arm in vs.ARMS:
            vs.run_batch(arm, targets, prompts[:2], 1, 8, False)
        pids = {"vllm_serve": vllm.proc.pid, "ours": svc.proc.pid}
        for i, arm in enumerate(order):
            before = {k: tree_cpu(v) for k, v in pids.items()}
            time.sleep(vs.SETTLE_S)
            r = vs.run_batch(arm, targets, prompts[i * conc:(i + 1) * conc], 4, 128, args.stream)
            after = {k: tree_cpu(v) for k, v in pids.items()}
            row = {"arm": arm, "tok_s": round(r["tok_s"], 1), "wall_s": round(r["wall_s"], 1),
                   "cpu_s": {k: delta(before[k], after[k]) for k in pids}}
            print(json.dumps(row), flush=True)
            rows.append(row)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                          "concurrency": conc, "stream": args.stream, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
