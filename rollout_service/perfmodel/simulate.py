"""`rollout-service simulate`: what k, and is speculation worth it, for a model on given hardware.

    rollout-service simulate --hardware gb200 --policy-config qwen3-8b --drafter-config qwen3-8b-eagle3 \\
        --acceptance 0.62 [--from-status HOST:PORT | --from-metrics metrics.jsonl] [--json out.json --plot out.png]
    rollout-service simulate --hardware h200 --policy-config qwen3-8b [--drafter-config qwen3-8b-eagle3] \\
        --step-table 1:1:512,64:4:2048 --json -        # single step times: {"steps": [{batch, width, context,
                                                       # seconds, draft_seconds}]}
    --hardware-from FILE: a profile fitted to a perf/gpu_step_probe.py file instead of --hardware (perfmodel/fit.py)
    rollout-service simulate --hardware gb200 --policy-config qwen3-235b-a22b --drafter-config qwen3-8b-eagle3 \
        --acceptance 0.62 --tp 1 --ep 72 --engines 1 --max-concurrency 9216   # MoE: experts over an NVL72 domain
"""
from __future__ import annotations

import argparse
import json

from rollout_service.perfmodel import acceptance as acc
from rollout_service.perfmodel import hardware, model, report
from rollout_service.perfmodel.rl import PUSH_PATHS, push_seconds, rl_step, swap_seconds, train_seconds
from rollout_service.perfmodel.rollout import Engine, drain, lognormal_lengths, mean_length, steady_context
from rollout_service.perfmodel.moe import distinct_experts
from rollout_service.perfmodel.step import Drafter, data_groups, device_weight_bytes, devices, step_table


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hardware", default="gb200", help="cpu (fitted to --calibration), h100, h200 or gb200")
    p.add_argument("--hardware-from", metavar="FILE",
                   help="a GPU profile fitted to this perf/gpu_step_probe.py file (or ../shared/reference/"
                        "h200-steps.json) instead of --hardware: its own bandwidth, FLOP/s and step costs")
    p.add_argument("--calibration",
                   help="cpu: perf/calibrate_cpu.py's JSON (default bench/results/cpu_calibration.json)")
    p.add_argument("--policy-config", required=True,
                   help="the policy's config.json (or its directory, or a shipped name: qwen3-8b, qwen3-14b, "
                        "qwen3-30b-a3b, qwen3-235b-a22b, deepseek-v3)")
    p.add_argument("--drafter-config", help="the drafter's config.json (EAGLE-3 head or draft model; shipped: "
                                            "qwen3-8b-eagle3); none with --method ngram")
    p.add_argument("--method", choices=["eagle3", "draft_model", "ngram"],
                   help="default: eagle3 for an EAGLE-3 head's config, draft_model for another, ngram without one")
    p.add_argument("--step-table", metavar="B:W:N,...",
                   help="print single step times instead: batch B, width W new tokens per sequence (k + 1 for a "
                        "verify), context N; seconds = one forward (its overhead included, sampling and drafting "
                        "not), draft_seconds = one drafter step at B and N (with --drafter-config); --json - prints "
                        "{\"steps\": [...]}")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--acceptance", help="per-position acceptance a_1,a_2,... (positions past the list reuse the "
                                          "last value), e.g. 0.7,0.6,0.55")
    src.add_argument("--from-status", metavar="HOST:PORT", help="read it from a running service's GetStatus")
    src.add_argument("--from-metrics", metavar="PATH", help="read it from a trainer's metrics.jsonl (draft_acceptance)")
    p.add_argument("--k-max", type=int, default=7)
    p.add_argument("--tp", type=int, help="devices per engine (default: the fewest powers of two holding the weights)")
    p.add_argument("--ep", type=int, default=1,
                   help="MoE policies: spread the experts over this many devices by expert parallelism, attention "
                        "data-parallel over ep / tp groups (an engine is then ep devices; up to 72 in one GB200 NVL72 "
                        "NVLink domain; each MoE layer adds an all-to-all); default 1: experts split by tp like the "
                        "rest (perfmodel/moe.py)")
    p.add_argument("--concurrency", default="1,8,32,64,128,256", help="batch sizes of the speedup table")
    p.add_argument("--prompts", type=int, default=128, help="prompts per RL step")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--mean-output", type=float, default=2048, help="mean output length (tokens)")
    p.add_argument("--output-sigma", type=float, default=1.0, help="log-normal sigma of output lengths (the tail)")
    p.add_argument("--max-tokens", type=int, default=16384, help="output length cap")
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--max-concurrency", type=int, default=256, help="sequences in flight per engine")
    p.add_argument("--train-gpus", type=int, help="GPUs training (default: the engines' GPUs; async splits the same "
                                                  "GPUs between engines and trainer)")
    p.add_argument("--train-s-per-token", type=float, help="measured training seconds per token (default: from FLOPs)")
    p.add_argument("--max-lag", type=int, default=2, help="async: maximum policy lag")
    p.add_argument("--push-path", choices=sorted(PUSH_PATHS), default="nccl",
                   help="how each step's weights reach the engines: nccl (weight-transfer group across nodes, 8.25 "
                        "GB/s per GPU as published), ipc (trainer on the same GPUs), stream (PushWeights), gloo (CPU), "
                        "link (the NIC line rate); sources in perfmodel/rl.py")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="write a plot of speedup by concurrency and k here (matplotlib)")


def profile(args) -> hardware.Hardware:
    if getattr(args, "hardware_from", None):
        from rollout_service.perfmodel.fit import from_probe

        return from_probe(args.hardware_from)
    return hardware.get(args.hardware, args.calibration)


def auto_tp(policy: model.Transformer, hw: hardware.Hardware, ep: int = 1) -> int:
    """The fewest powers of two of devices holding the weights in 60% of their memory (with expert parallelism:
    each device's experts and its tp share of the rest)."""
    tp = 1
    while device_weight_bytes(policy, hw.bytes_per_param, tp, max(ep, tp)) > 0.6 * hw.mem_bytes and tp < 1024:
        tp *= 2
    return tp


def parse_step_table(text: str) -> list[tuple[int, int, int]]:
    """"1:1:512,64:4:2048" -> [(1, 1, 512), (64, 4, 2048)]."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        parts = item.split(":")
        if len(parts) != 3 or not all(x.isdigit() and int(x) > 0 for x in parts):
            raise SystemExit(f"--step-table {item!r}: BATCH:WIDTH:CONTEXT, positive integers (e.g. 64:4:2048)")
        out.append(tuple(int(x) for x in parts))
    if not out:
        raise SystemExit("--step-table: at least one BATCH:WIDTH:CONTEXT")
    return out


def run_step_table(args) -> int:
    hw = profile(args)
    policy = model.load(args.policy_config)
    dm = model.load(args.drafter_config) if args.drafter_config else None
    drafter = None
    if dm is not None:
        drafter = Drafter(args.method or ("eagle3" if dm.eagle3 else "draft_model"), dm)
    result = step_table(policy, hw, parse_step_table(args.step_table), drafter,
                        args.tp or auto_tp(policy, hw, args.ep), args.ep)
    if args.json == "-":
        print(json.dumps(result))
        return 0
    print(f"{policy.name} on {hw.name}" + (f", drafter {dm.name}" if dm else "") + ":")
    print(f"{'batch':>6} {'width':>6} {'context':>8} {'step ms':>9}" + (f" {'draft ms':>9}" if dm else ""))
    for r in result["steps"]:
        print(f"{r['batch']:>6} {r['width']:>6} {r['context']:>8} {r['seconds'] * 1e3:>9.3f}"
              + (f" {r['draft_seconds'] * 1e3:>9.3f}" if dm else ""))
    if args.json:
        report.write_json(result, args.json)
        print(f"wrote {args.json}")
    return 0


def build(args) -> dict:
    hw = profile(args)
    policy = model.load(args.policy_config)
    dm = model.load(args.drafter_config) if args.drafter_config else None
    method = args.method or ("ngram" if dm is None else "eagle3" if dm.eagle3 else "draft_model")
    if method != "ngram" and dm is None:
        raise SystemExit(f"--method {method} needs --drafter-config")
    if not (args.acceptance or args.from_status or args.from_metrics):
        raise SystemExit("simulate needs the acceptance: --acceptance, --from-status or --from-metrics "
                         "(or --step-table for single step times)")
    if args.acceptance:
        a, source = acc.parse(args.acceptance), "typed"
    elif args.from_status:
        a, source = acc.from_status(args.from_status), f"GetStatus of {args.from_status}"
    else:
        a, source = acc.from_metrics(args.from_metrics), f"{args.from_metrics}"
    tp, ep = args.tp or auto_tp(policy, hw, args.ep), args.ep
    dev, groups = devices(tp, ep, policy), data_groups(tp, ep, policy)
    drafter = Drafter(method, dm if method != "ngram" else None)
    eng = Engine(policy, hw, drafter, a, tp, ep)
    plain = Engine(policy, hw, None, [], tp, ep)
    n_seq = args.prompts * args.group
    lengths = lognormal_lengths(n_seq, args.mean_output, args.output_sigma, args.max_tokens)
    ctx = steady_context(lengths, args.prompt_len)
    ks = range(args.k_max + 1)
    rows = []
    for b in (int(x) for x in args.concurrency.split(",")):
        best = eng.best_k(b, ctx, args.k_max)
        mem = (device_weight_bytes(policy, hw.bytes_per_param, tp, ep)
               + b * ctx * policy.kv_bytes_per_token() / (policy.kv_shards(tp) * groups))
        row = {"concurrency": b, "bound": plain.bound(b, ctx), "plain_tok_s": round(plain.rate(b, 0, ctx), 1),
               "memory_gb_per_device": round(mem / 1e9, 1), "fits": mem <= 0.9 * hw.mem_bytes,
               "step_ms": [round(eng.step(b, k, ctx) * 1e3, 3) for k in ks],
               "speedup": [round(eng.speedup(b, k, ctx), 3) for k in ks],
               "best_k": best, "best_speedup": round(eng.speedup(b, best, ctx), 3)}
        if policy.experts:                    # experts read per MoE layer by a step verifying k drafts
            row["experts_read"] = [round(distinct_experts(policy.experts, policy.experts_per_tok, b * (k + 1)), 1)
                                   for k in ks]
        rows.append(row)
    # one engine's share of the RL batch, draining; engines are identical
    share = lengths[:: max(1, args.engines)] if args.engines > 1 else lengths
    share_tokens = sum(share)
    drains = {"off": drain(plain, share, args.prompt_len, args.max_concurrency, 0, args.k_max)}
    for k in range(1, args.k_max + 1):
        drains[f"k={k}"] = drain(eng, share, args.prompt_len, args.max_concurrency, k, args.k_max)
    drains["auto"] = drain(eng, share, args.prompt_len, args.max_concurrency, "auto", args.k_max)
    fixed_k = min(range(1, args.k_max + 1), key=lambda k: drains[f"k={k}"].seconds)
    full_b = args.max_concurrency
    full = {"off": share_tokens / plain.rate(full_b, 0, ctx),
            f"k={fixed_k}": share_tokens / eng.rate(full_b, fixed_k, ctx),
            "auto": share_tokens / eng.rate(full_b, eng.best_k(full_b, ctx, args.k_max), ctx)}
    tokens = n_seq * (args.prompt_len + args.mean_output)
    train_gpus = args.train_gpus or args.engines * dev
    train_s = train_seconds(policy, hw, tokens, train_gpus, args.train_s_per_token)
    push_s = push_seconds(policy, hw, tp, args.push_path, ep)
    pause_s = swap_seconds(policy, hw, tp, ep)
    rl = []
    for spec in ("off", f"k={fixed_k}", "auto"):
        d = drains[spec]
        for mode in ("sync", "async"):
            r = rl_step(mode, d.seconds, full[spec], train_s, push_s, pause_s, args.max_lag)
            rl.append({"speculation": spec, **r.as_dict()})
    base = rl[0]["step_s"]
    for r in rl:
        r["speedup_vs_sync_off"] = round(base / r["step_s"], 3)
    return {
        "hardware": {"name": hw.name, "source": hw.source, "mem_bw": hw.mem_bw, "flops": hw.flops,
                     "overhead_s": hw.overhead_s, "draft_overhead_s": hw.draft_overhead_s, "mem_eff": hw.mem_eff,
                     "flop_eff": hw.flop_eff, "train_mfu": hw.train_mfu,
                     "step_fit": ({k: v for k, v in vars(hw.fit).items()} if hw.fit else None)},
        "policy": {"name": policy.name, "params": policy.params(), "active_params": policy.active_params(), "tp": tp,
                   **({"ep": ep, "devices": dev, "experts": policy.experts, "experts_per_tok": policy.experts_per_tok,
                       "moe_layers": policy.moe_layers(), "card_active_params": policy.card_active_params()}
                      if policy.experts else {})},
        "drafter": {"method": method, "name": dm.name if dm else None, "params": dm.params() if dm else 0},
        "acceptance": {"per_position": a, "source": source,
                       "mean_length": [round(mean_length(a, k), 3) for k in ks]},
        "workload": {"sequences": n_seq, "prompt_len": args.prompt_len, "mean_output": args.mean_output,
                     "output_sigma": args.output_sigma, "max_tokens": args.max_tokens, "engines": args.engines,
                     "max_concurrency": args.max_concurrency, "mean_context": round(ctx, 1),
                     "longest_output": max(lengths), "median_output": sorted(lengths)[len(lengths) // 2]},
        "by_concurrency": rows,
        "rollout": {name: {"seconds": round(d.seconds, 2), "tok_s_per_engine": round(d.tok_s, 1),
                           "speedup": round(drains["off"].seconds / d.seconds, 3),
                           "k_steps": {str(k): v for k, v in sorted(d.k_steps.items())}}
                    for name, d in drains.items()},
        "rl": rl, "train_gpus": train_gpus, "push": {"path": args.push_path, "seconds": round(push_s, 3)},
    }


def run(args) -> int:
    if args.step_table:
        return run_step_table(args)
    result = build(args)
    print(report.table(result))
    if args.json:
        report.write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        report.plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rollout-service simulate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
