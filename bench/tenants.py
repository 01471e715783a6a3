"""A small tenant's latency while another tenant floods the pool, with the fair gate (pool/fair.py) and without:

    .venv/bin/python bench/tenants.py [--model DIR] [--rounds 3] [--requests 8] [--flood 4] [--max-num-seqs 16]
    .venv/bin/python bench/tenants.py --smoke        # the tests' tiny model, 1 round, a few requests (a check)

Two services on one model, started side by side, each one engine of `--max-num-seqs`, LoRA on, float32:
- `fair`: two tenants in security.tenants (their own tokens over gRPC, each its own rank-8 adapter), so the fair gate
  shares the engine's slots between them;
- `off`: the same two adapters, no tenants (the client and admin tokens): no gate, vLLM's first-come queue.
In each, `flood` keeps `--flood` requests of n = 8 (`--flood-tokens` each, ignore_eos) in flight all the time (more
sequences than the engine batches: some always wait); `small` sends one prompt, n = 1, `--small-tokens` tokens,
`--requests` times one after another, streamed (the first token's time splits waiting + prefill from decoding).
Rounds rotate the arms' order (bench/harness.py); in each arm small runs alone, then during the flood. The result
per arm: small's median latency during the flood over alone (goal: at most 2x with the gate). Results:
bench/results/tenants.json (--smoke: a temporary file unless --out).

Measured 2026-11-28 (--rounds 2, default model, 16 slots, machine load 4-5): small's p50 1.62x and 1.90x with the
gate (it starts at once; decoding in a batch of 16 costs the rest), 8.2x and 11.0x without (docs/lora.md, Tenants);
--arms fair --previous-tree (the gate before its reserve): 7.6x and 6.6x against 1.59x and 1.74x with it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

from harness import logs_dir, services, turns, write_result

PROMPT = [1, 504, 3458, 314, 260, 9]
ARMS = ("fair", "off")


def write_config(tmp: Path, tokens: dict, tenants: bool) -> Path:
    cfg = tmp / f"server-{'tenants' if tenants else 'plain'}.toml"
    text = f'[security]\ntoken_file = "{tmp / "client"}"\nadmin_token_file = "{tmp / "admin"}"\n'
    if tenants:
        text += "".join(f'[[security.tenants]]\nname = "{t}"\ntoken_file = "{tmp / t}"\npolicies = ["{t}"]\n'
                        for t in ("flood", "small"))
    cfg.write_text(text)
    return cfg


def small_latencies(client, args) -> tuple[list[float], list[float]]:
    """(latency, time to the first token) of `--requests` single samples, one after another."""
    lat, first = [], []
    for i in range(args.requests):
        t0 = time.perf_counter()
        t_first = None
        n = 0
        for s in client.generate([PROMPT], max_tokens=args.small_tokens, ignore_eos=True, temperature=1.0, seed=i,
                                 policy="small", stream_tokens=True):
            if s.delta and t_first is None:
                t_first = time.perf_counter() - t0
            if not s.delta:
                n = len(s.token_ids)
        lat.append(time.perf_counter() - t0)
        first.append(t_first if t_first is not None else lat[-1])
        assert n == args.small_tokens, n
    return lat, first


def flood_round(clients, args) -> dict:
    """small alone, then small while `flood` keeps its requests in flight; queue depth sampled during the flood."""
    import grpc

    alone, alone_first = small_latencies(clients["small"], args)
    stop = threading.Event()
    errors: list[str] = []
    depth: list[int] = []
    finished: list[float] = []                             # when each flood request (8 samples) ended

    def flood(i):
        k = 0
        while not stop.is_set():
            try:
                clients["flood"].generate_all([PROMPT], n=8, max_tokens=args.flood_tokens, ignore_eos=True,
                                              temperature=1.0, seed=1000 * i + k, policy="flood")
                finished.append(time.perf_counter())
            except grpc.RpcError as e:                     # its quota or the queue: back off
                errors.append(e.code().name)
                time.sleep(0.2)
            k += 1

    def watch():
        while not stop.is_set():
            depth.append(clients["small"].status().queue_depth)
            stop.wait(0.5)
    threads = [threading.Thread(target=flood, args=(i,)) for i in range(args.flood)]
    for t in threads:
        t.start()
    time.sleep(args.fill_s)                                # the flood fills the engine
    watcher = threading.Thread(target=watch)
    watcher.start()
    t0 = time.perf_counter()
    during, during_first = small_latencies(clients["small"], args)
    t1 = time.perf_counter()
    stop.set()
    for t in threads + [watcher]:
        t.join()
    row = {"alone_p50_s": statistics.median(alone), "flood_p50_s": statistics.median(during),
           "alone_first_p50_s": statistics.median(alone_first), "flood_first_p50_s": statistics.median(during_first),
           "alone_s": [round(x, 3) for x in alone], "flood_s": [round(x, 3) for x in during],
           "flood_first_s": [round(x, 3) for x in during_first],
           "queue_depth_min": min(depth, default=0), "queue_depth_median": statistics.median(depth or [0]),
           "flood_errors": len(errors),
           "flood_samples_per_s": round(8 * sum(t0 <= t <= t1 for t in finished) / (t1 - t0), 2)}
    row["ratio"] = row["flood_p50_s"] / row["alone_p50_s"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="a model directory (default: the default model)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=8, help="small's requests per phase")
    ap.add_argument("--flood", type=int, default=4, help="flood requests in flight (n = 8 each)")
    ap.add_argument("--flood-tokens", type=int, default=64)
    ap.add_argument("--small-tokens", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=16, help="each engine's batch: the fair gate's slots")
    ap.add_argument("--arms", default=",".join(ARMS), help="which of fair,off to run")
    ap.add_argument("--previous-tree", default="", help="one more arm, `previous`: the fair arm's service run from "
                                                        "this source tree (PYTHONPATH; e.g. an older gate)")
    ap.add_argument("--fill-s", type=float, default=3.0, help="seconds the flood runs before small starts")
    ap.add_argument("--smoke", action="store_true", help="the tests' tiny model, 1 round, 3 requests, a flood of "
                                                         "2 x 8 over 4 slots; results to a temporary file")
    ap.add_argument("--out", default=None, help="default bench/results/tenants.json")
    args = ap.parse_args()
    arms = tuple(a for a in ARMS if a in args.arms.split(","))
    if not arms or set(args.arms.split(",")) - set(ARMS):
        ap.error(f"--arms {args.arms}: a comma-separated subset of {','.join(ARMS)}")
    if args.previous_tree:
        if not (Path(args.previous_tree) / "rollout_service" / "pool" / "fair.py").is_file():
            ap.error(f"--previous-tree {args.previous_tree}: no rollout_service/pool/fair.py there")
        arms += ("previous",)
    if args.smoke:
        from tests.tiny_models import build_tiny_model

        args.model = str(build_tiny_model(Path(tempfile.mkdtemp(prefix="tenants-tiny-")) / "tiny-llama"))
        args.rounds, args.requests, args.flood, args.max_num_seqs, args.fill_s = 1, 3, 2, 4, 1.0
        args.flood_tokens, args.small_tokens = 32, 8
    out_path = args.out or (tempfile.mkdtemp(prefix="tenants-smoke-") + "/tenants.json" if args.smoke else None)

    from lora import adapter_state                                 # bench/lora.py
    from rollout_client import RolloutClient

    from rollout_service.cli import resolve_model

    model_dir = resolve_model(args.model)
    tmp = logs_dir("tenants-bench")
    tokens = {"client": "c" * 24, "admin": "a" * 24, "flood": "f" * 24, "small": "s" * 24}
    for k, v in tokens.items():
        (tmp / k).write_text(v)
    extra = ["--max-adapters", "4", "--max-lora-rank", "8", "--speculation", "none", "--dtype", "float32",
             "--max-num-seqs", str(args.max_num_seqs), "--max-queue", "512", "--kv-cache-gb", "1"]
    config = {"model": model_dir, "smoke": args.smoke, "max_num_seqs": args.max_num_seqs, "flood_requests": args.flood,
              "flood_sequences": 8 * args.flood, "flood_tokens": args.flood_tokens, "small_tokens": args.small_tokens,
              "requests": args.requests, "previous_tree": args.previous_tree or None}
    rows, extra_out = [], {}
    arm_args = {arm: ["--config", str(write_config(tmp, tokens, arm != "off")), *extra] for arm in arms}
    env = {"previous": {"PYTHONPATH": str(Path(args.previous_tree).resolve())}} if args.previous_tree else None
    with services(model_dir, arm_args, tmp, env) as up:
        clients = {}
        for arm, svc in up.items():
            if arm != "off":       # each tenant's own token, for sampling and for pushing its adapter
                clients[arm] = {t: RolloutClient(svc.target, token=tokens[t], admin_token=tokens[t])
                                for t in ("flood", "small")}
            else:
                clients[arm] = {t: RolloutClient(svc.target, token=tokens["client"], admin_token=tokens["admin"])
                                for t in ("flood", "small")}
            for seed, (t, c) in enumerate(clients[arm].items(), 1):
                tensors, adapter_config, _ = adapter_state(model_dir, 8, seed=seed)
                c.push_adapter(t, tensors, 1, config=adapter_config)
            small_latencies(clients[arm]["small"], args)             # warm-up
        for r in range(args.rounds):
            for arm in turns(arms, r):
                row = {"round": r, "arm": arm, **flood_round(clients[arm], args)}
                rows.append(row)
                print(f"round {r} {arm}: small p50 alone {row['alone_p50_s']:.2f} s, during the flood "
                      f"{row['flood_p50_s']:.2f} s ({row['ratio']:.2f}x; first token {row['alone_first_p50_s']:.2f}"
                      f" -> {row['flood_first_p50_s']:.2f} s; queue depth {row['queue_depth_median']}; flood "
                      f"{row['flood_samples_per_s']} samples/s)", flush=True)
        if "fair" in clients:
            status = clients["fair"]["small"].status()
            extra_out["tenants"] = [{"name": t.name, "samples_total": t.samples_total} for t in status.tenants]
    summary = {}
    for arm in arms:
        ratio = [r["ratio"] for r in rows if r["arm"] == arm]
        summary[f"{arm}_p50_ratio"] = round(statistics.median(ratio), 2)
        summary[f"{arm}_p50_ratio_range"] = [round(min(ratio), 2), round(max(ratio), 2)]
    if "fair" in arms:
        summary["goal_2x_with_gate"] = summary["fair_p50_ratio"] <= 2.0
    print(json.dumps(summary))
    print("results:", write_result("tenants", config, summary, rows, out_path, **extra_out))


if __name__ == "__main__":
    main()
