"""LoRA adapters as policies, measured in one run on one service (interleaved rounds, A B A B):

    .venv/bin/python bench/lora.py [--model DIR] [--rank 8] [--rounds 3] [--sequences 32] [--max-tokens 32]

- push: an adapter (PushWeights with TARGET_ADAPTER: the adapter's tensors only) against a full push of the same
  adapter merged into the base (PushWeights of every tensor), wall time each (goal: the adapter >= 20x faster);
- throughput: the same batch (`--sequences` sequences, `--max-tokens` each, ignore_eos) sampled from the base
  alone, from one adapter for the whole batch, and from 4 and 8 adapters mixed in it (one request per adapter,
  all at once); generated tokens per second of wall time (goal: mixed >= 0.9x one adapter);
- pause: generation streaming (stream_tokens) while an adapter is pushed: the longest gap between token deltas
  during each push against the median gap (an adapter push pauses nothing: vLLM adds the LoRA between steps).

`--push-only` runs the push comparison alone (A B A B) and keeps the throughput and pause results already in --out.

The service: the default model (or --model), float32, one engine, LoRA on (--max-adapters 10, rank --rank, 8 per
batch), no speculation. Results: bench/results/lora.json (bench/harness.py's schema; rounds: the throughput rows).
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness import RESULTS, logs_dir, services, turns, write_result

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base, rank: int, seed: int):
    """A PEFT LoRA model over `base` (a transformers model, shared) with small random A and B."""
    import torch
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0),
                           adapter_name=f"a{seed}")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if f"a{seed}" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def adapter_state(base_dir: str, rank: int, seed: int, merge: bool = False) -> tuple[dict, str, dict | None]:
    """(adapter tensors, adapter_config text, merged state dict with `merge`, else None) of one random adapter."""
    import torch
    from rollout_client.weights import peft_adapter
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = make_adapter(base, rank, seed)
    tensors, config = peft_adapter(model, f"a{seed}")
    tensors = {k: v.clone() for k, v in tensors.items()}
    return tensors, config, model.merge_and_unload().state_dict() if merge else None


def timed_batch(client, prompts, policies: list[str], sequences: int, max_tokens: int) -> tuple[float, int]:
    """`sequences` samples split evenly over one request per entry of `policies`, all at once: (seconds, tokens)."""
    per = sequences // len(policies)

    def one(i, policy):
        groups = client.generate_all([prompts[i % len(prompts)]], n=per, max_tokens=max_tokens, ignore_eos=True,
                                     temperature=1.0, seed=i, policy=policy)
        return sum(len(s.token_ids) for g in groups for s in g)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(policies)) as ex:
        tokens = sum(ex.map(lambda a: one(*a), enumerate(policies)))
    return time.perf_counter() - t0, tokens


def pause_during_push(client, prompt, push, pushes: int = 3) -> dict:
    """Token deltas of 8 streaming sequences; `push()` `pushes` times meanwhile: the longest delta gap inside each
    push's window against the median gap outside them."""
    arrivals, windows, done = [], [], threading.Event()

    def stream():
        for s in client.generate([prompt], n=8, max_tokens=160, ignore_eos=True, temperature=1.0, seed=1,
                                 stream_tokens=True):
            if s.delta:
                arrivals.append(time.perf_counter())
        done.set()
    t = threading.Thread(target=stream)
    t.start()
    time.sleep(2.0)
    for _ in range(pushes):
        if done.is_set():
            break
        t0 = time.perf_counter()
        push()
        windows.append((t0, time.perf_counter()))
        time.sleep(1.0)
    t.join()
    gaps = [(b - a, b) for a, b in zip(arrivals, arrivals[1:])]
    inside = [max((g for g, at in gaps if w0 <= at <= w1 + 0.5), default=0.0) for w0, w1 in windows]
    outside = [g for g, at in gaps if not any(w0 <= at <= w1 + 0.5 for w0, w1 in windows)]
    return {"pushes": len(windows), "push_s": [round(w1 - w0, 4) for w0, w1 in windows],
            "max_gap_during_push_s": [round(g, 4) for g in inside],
            "median_gap_s": round(statistics.median(outside), 4) if outside else None,
            "max_gap_outside_s": round(max(outside), 4) if outside else None}


def push_summary(pushes: list[dict]) -> dict:
    ratio = statistics.median(p["full_s"] / p["adapter_s"] for p in pushes)
    return {"adapter_push_ms": round(statistics.median(p["adapter_s"] for p in pushes) * 1e3, 1),
            "full_push_ms": round(statistics.median(p["full_s"] for p in pushes) * 1e3, 1),
            "push_speedup": round(ratio, 1), "push_goal_20x": ratio >= 20}


def keep_other_results(path: Path, pushes: list[dict]) -> dict:
    """--push-only: this run's pushes (and their summary) replace those in `path`; its throughput and pause results,
    from the run that measured them (their date and settings kept beside them), stay."""
    old = json.loads(path.read_text()) if path.is_file() else {}
    kept = {k: old[k] for k in ("pause", "throughput_run") if k in old}
    if "throughput" in old or old.get("rounds"):
        kept["throughput"] = old.get("throughput") or old["rounds"]
        kept.setdefault("throughput_run", {"date": old.get("date"), "command": old.get("command"),
                                           "config": old.get("config")})
    return {"summary": (old.get("summary") or {}) | push_summary(pushes), "push_only": True, **kept}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default="bench/results/lora.json")
    ap.add_argument("--pause-only", action="store_true", help="only the pause an adapter push causes")
    ap.add_argument("--push-only", action="store_true",
                    help="only the adapter push against the full push (A B A B); keeps --out's other results")
    args = ap.parse_args()
    if args.pause_only and args.push_only:
        ap.error("--pause-only and --push-only exclude each other")

    from rollout_client import RolloutClient

    from rollout_service.cli import resolve_model

    model_dir = resolve_model(args.model)
    count = 2 if args.pause_only else 1 if args.push_only else 8
    print(f"building {count} random rank-{args.rank} adapter(s) on {model_dir} ...", flush=True)
    adapters = [adapter_state(model_dir, args.rank, seed) for seed in range(count)]
    prompts = [[1, 504, 3458, 314, 260, 9 + i] for i in range(8)]
    rank_flag = str(max(8, 1 << (args.rank - 1).bit_length()))
    extra = ["--max-adapters", "10", "--max-lora-rank", rank_flag, "--max-loras-per-batch", "8",
             "--speculation", "none", "--dtype", "float32", "--max-num-seqs", "64", "--max-queue", "256"]
    config = {"model": model_dir, "rank": args.rank, "rounds": args.rounds, "sequences": args.sequences,
              "max_tokens": args.max_tokens, "service": extra}
    out: dict = {"push": []}
    rows: list[dict] = []                                   # throughput per round
    with services(model_dir, {"lora": extra}, logs_dir("lora")) as up, RolloutClient(up["lora"].target) as c:
        for i, (tensors, adapter_config, _) in enumerate(adapters):
            c.push_adapter(f"p{i}", tensors, 1, config=adapter_config)
        merged = adapter_state(model_dir, args.rank, 0, merge=True)[2] if not args.pause_only else {}
        a_bytes = sum(t.numel() * t.element_size() for t in adapters[0][0].values())
        full_bytes = sum(t.numel() * t.element_size() for t in merged.values())
        out.update(adapter_bytes=a_bytes, full_bytes=full_bytes)
        print(f"adapter {a_bytes / 1e6:.2f} MB, merged model {full_bytes / 1e6:.1f} MB", flush=True)
        av, pv = 1, c.status().policy_version
        configs = {"base": [""] * 8, "one adapter": ["p0"] * 8, "4 adapters": [f"p{i % 4}" for i in range(8)],
                   "8 adapters": [f"p{i}" for i in range(8)]}
        if not args.push_only:
            timed_batch(c, prompts, ["p0"] * 8, args.sequences, 4)              # warm-up
        for r in range(0 if args.pause_only else args.rounds):
            # A B A B: the adapter push, then the merged full push of the same policy (p9's line)
            tensors, adapter_config, _ = adapters[r % len(adapters)]        # the merged policy: adapter 0's
            av += 1
            t0 = time.perf_counter()
            res = c.push_adapter("p9", tensors, av, config=adapter_config)
            adapter_s = time.perf_counter() - t0
            pv += 1
            t0 = time.perf_counter()
            full = c.push_weights(merged, pv)
            full_s = time.perf_counter() - t0
            out["push"].append({"round": r, "adapter_s": adapter_s, "adapter_server_s": res.total_s,
                                "adapter_receive_s": res.receive_s, "adapter_validate_s": res.validate_s,
                                "adapter_apply_s": res.apply_s, "full_s": full_s, "full_server_s": full.total_s,
                                "full_pause_s": full.pause_s})
            print(f"round {r}: adapter push {adapter_s * 1e3:.1f} ms, full push {full_s * 1e3:.0f} ms "
                  f"({full_s / adapter_s:.0f}x)", flush=True)
            if args.push_only:
                continue
            row = {"round": r}
            for name in turns(configs, r):                  # the order rotates: load drifts within a round
                s, tokens = timed_batch(c, prompts, configs[name], args.sequences, args.max_tokens)
                row[name] = tokens / s
            rows.append(row)
            print("  tok/s " + ", ".join(f"{k} {v:.0f}" for k, v in row.items() if k != "round"), flush=True)
            write_result("lora", config, None, rows, args.out, partial=True, **out)     # each round kept as it ends
        if args.push_only:
            path = Path(args.out or RESULTS / "lora.json")
            kept = keep_other_results(path, out["push"])
            write_result("lora", config, kept.pop("summary"), kept.pop("throughput", None), path, **out, **kept)
            print(json.dumps(push_summary(out["push"]), indent=1))
            return
        bump = iter(range(av + 1, av + 100))
        out["pause"] = pause_during_push(
            c, prompts[0], lambda: c.push_adapter("p9", adapters[1][0], next(bump), config=adapters[1][1]))
        print(f"pause: {out['pause']}", flush=True)
    if args.pause_only:
        write_result("lora", config, None, None, args.out, **out)
        return
    med = lambda key: statistics.median(r[key] for r in rows)          # noqa: E731
    ratio = lambda a, b: round(statistics.median(r[a] / r[b] for r in rows), 3)  # noqa: E731
    summary = {**push_summary(out["push"]), "tok_s": {k: round(med(k), 1) for k in configs},
               "mixed4_vs_one": ratio("4 adapters", "one adapter"), "mixed8_vs_one": ratio("8 adapters", "one adapter"),
               "one_vs_base": ratio("one adapter", "base")}
    summary["mixing_goal_0.9x"] = min(summary["mixed4_vs_one"], summary["mixed8_vs_one"]) >= 0.9
    print(json.dumps(summary, indent=1))
    write_result("lora", config, summary, rows, args.out, **out)


if __name__ == "__main__":
    main()
