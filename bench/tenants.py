"""A small tenant's latency while another floods the pool (tenants with the fair gate, pool/fair.py), in one run:

    .venv/bin/python bench/tenants.py [--model DIR] [--rounds 3] [--requests 8] [--max-num-seqs 16]

Two tenants, each with its own rank-8 adapter: `flood` keeps `--flood` requests of n = 8 (64 tokens each) in flight
all the time; `small` sends one prompt, n = 1, 16 tokens, `--requests` times one after another. Rounds alternate
small alone and small during the flood; the result is small's median latency during the flood over alone (goal: at
most 2x). Results: bench/results/tenants.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--flood", type=int, default=4, help="flood requests in flight (n = 8 each)")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="each engine's batch: the fair gate's slots")
    ap.add_argument("--out", default="bench/results/tenants.json")
    args = ap.parse_args()

    import grpc
    from rollout_client import RolloutClient
    from rollout_client.launcher import ServiceProcess

    from rollout_service.cli import resolve_model

    sys.path.insert(0, str(Path(__file__).parent))
    from lora import adapter_state                                 # bench/lora.py

    model_dir = resolve_model(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="tenants-bench-"))
    tokens = {"client": "c" * 24, "admin": "a" * 24, "flood": "f" * 24, "small": "s" * 24}
    for k, v in tokens.items():
        (tmp / k).write_text(v)
    cfg = tmp / "server.toml"
    cfg.write_text(f'[security]\ntoken_file = "{tmp / "client"}"\nadmin_token_file = "{tmp / "admin"}"\n' + "".join(
        f'[[security.tenants]]\nname = "{t}"\ntoken_file = "{tmp / t}"\npolicies = ["{t}"]\n'
        for t in ("flood", "small")))
    extra = ["--config", str(cfg), "--max-adapters", "4", "--max-lora-rank", "8", "--speculation", "none",
             "--dtype", "float32", "--max-num-seqs", str(args.max_num_seqs), "--max-queue", "512"]
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "model": model_dir, "max_num_seqs": args.max_num_seqs,
           "flood_requests": args.flood, "rounds": [], "load_avg_start": os.getloadavg()[0]}
    prompt = [1, 504, 3458, 314, 260, 9]
    with ServiceProcess(model_dir, extra_args=extra, log_path="bench/results/tenants-service.log") as svc:
        clients = {t: RolloutClient(svc.target, token=tokens[t], admin_token=tokens[t]) for t in ("flood", "small")}
        for t, c in clients.items():
            tensors, config, _ = adapter_state(model_dir, 8, seed=len(t))
            c.push_adapter(t, tensors, 1, config=config)

        def small_latencies() -> list[float]:
            lat = []
            for i in range(args.requests):
                t0 = time.perf_counter()
                clients["small"].generate_all([prompt], max_tokens=16, ignore_eos=True, temperature=1.0, seed=i,
                                              policy="small")
                lat.append(time.perf_counter() - t0)
            return lat

        small_latencies()                                          # warm-up
        for r in range(args.rounds):
            alone = small_latencies()
            stop = threading.Event()

            def flood(i):
                while not stop.is_set():
                    try:
                        clients["flood"].generate_all([prompt], n=8, max_tokens=64, ignore_eos=True,
                                                      temperature=1.0, seed=i, policy="flood")
                    except grpc.RpcError as e:                     # its quota or the queue: back off
                        print("flood:", e.code().name, flush=True)
                        time.sleep(0.2)
            threads = [threading.Thread(target=flood, args=(i,)) for i in range(args.flood)]
            for t in threads:
                t.start()
            time.sleep(3.0)                                        # the flood fills the engine
            during = small_latencies()
            stop.set()
            for t in threads:
                t.join()
            row = {"round": r, "alone_p50_s": statistics.median(alone), "flood_p50_s": statistics.median(during),
                   "alone_s": alone, "flood_s": during}
            row["ratio"] = row["flood_p50_s"] / row["alone_p50_s"]
            out["rounds"].append(row)
            print(f"round {r}: small p50 alone {row['alone_p50_s']:.2f} s, during the flood "
                  f"{row['flood_p50_s']:.2f} s ({row['ratio']:.2f}x)", flush=True)
        status = clients["small"].status()
        out["tenants"] = [{"name": t.name, "samples_total": t.samples_total} for t in status.tenants]
    ratio = statistics.median(r["ratio"] for r in out["rounds"])
    out["summary"] = {"p50_ratio": round(ratio, 2), "goal_2x": ratio <= 2.0, "load_avg_end": os.getloadavg()[0]}
    print(json.dumps(out["summary"]))
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
