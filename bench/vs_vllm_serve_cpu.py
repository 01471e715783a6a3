"""Where the CPU goes when `vllm serve` and the service serve the same batch, unstreamed unless --stream (not a test):
CPU seconds of each process (front end, engine core, worker) of both servers over one batch per arm, the idle server's
included, and of the benchmark's own client (on the same 2 cores), in the order given (default A B C A, so that the
machine's drift shows as the first arm against itself).

    .venv/bin/python bench/vs_vllm_serve_cpu.py [--concurrency 64] [--order vllm_serve,dialect,grpc,vllm_serve]
        [--stream] [--py-spy DIR] [--out /tmp/vs_vllm_serve_cpu.json]

The load is bench/vs_vllm_serve.py's (n = 4, 128 tokens, log-probs, default model) with each arm on its own prompts of
the arithmetic task. The 2026-11-27 run and the py-spy profile beside it: bench/results/vs_vllm_serve_profile.json.
"""
from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
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


def leaf_shares(raw: Path, top: int = 12) -> list[tuple[str, float]]:
    """py-spy's raw (collapsed) stacks -> the functions with the most own samples, as shares of all samples."""
    own: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        leaf = re.sub(r":\d+\)$", ")", stack.rsplit(";", 1)[-1])      # the function, whatever its line
        own[leaf] = own.get(leaf, 0) + n
    return [(f, round(n / total, 3)) for f, n in sorted(own.items(), key=lambda x: -x[1])[:top]] if total else []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--order", default="vllm_serve,dialect,grpc,vllm_serve",
                    help="arms: vllm_serve, dialect, grpc (asyncio client), grpc_threads (a client thread per request)")
    ap.add_argument("--stream", action="store_true", help="streamed requests (default: unstreamed)")
    ap.add_argument("--py-spy", default=None, metavar="DIR", help="also profile the arm's front end during its batch "
                    "(py-spy record, 100 Hz, --nonblocking): DIR/<i>-<arm>.txt, collapsed stacks, and the top own "
                    "functions in the row")
    ap.add_argument("--out", default="/tmp/vs_vllm_serve_cpu.json")
    args = ap.parse_args()

    import psutil

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
            client_before = psutil.Process().cpu_times()
            spy = raw = None
            if args.py_spy:
                raw = Path(args.py_spy) / f"{i}-{arm}.txt"
                raw.parent.mkdir(parents=True, exist_ok=True)
                front = pids["vllm_serve" if arm == "vllm_serve" else "ours"]
                spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(front),
                                        "-r", "100", "--nonblocking", "-f", "raw", "-o", str(raw)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(vs.SETTLE_S)
            r = vs.run_batch(arm.removesuffix("_threads"), targets, prompts[i * conc:(i + 1) * conc], 4, 128,
                             args.stream, "threads" if arm == "grpc_threads" else "asyncio")
            after = {k: tree_cpu(v) for k, v in pids.items()}
            client = psutil.Process().cpu_times()
            row = {"arm": arm, "tok_s": round(r["tok_s"], 1), "wall_s": round(r["wall_s"], 1),
                   "cpu_s": {k: delta(before[k], after[k]) for k in pids},
                   "client_cpu_s": round(client.user + client.system - client_before.user - client_before.system, 2)}
            if spy is not None:
                spy.send_signal(signal.SIGINT)                 # py-spy writes its file on SIGINT
                spy.wait(timeout=60)
                row["front_end_own"] = leaf_shares(raw) if raw.exists() else "py-spy wrote nothing"
            print(json.dumps(row), flush=True)
            rows.append(row)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                          "concurrency": conc, "stream": args.stream, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
