"""Time to first streamed token of ONE request with n samples, on `vllm serve`, our vLLM dialect and gRPC Generate,
interleaved (not a test): the c1 streamed row of bench/vs_vllm_serve.py, cheaply and in detail.

    .venv/bin/python bench/stream_ttft.py [--model DIR] [--rounds 6] [--n 4] [--max-tokens 32] [--gaps 0,2] [--tiny]

Same servers, engine settings and request as bench/vs_vllm_serve.py (both_servers, http_request's body); each round
sends one streamed request to every arm, the order rotating, once per --gaps value: each request after that many idle
seconds (0: at once after the arm before). Per request: time to the first chunk carrying a token, to each sample's
first token, and the whole request; medians per arm and gap; the CPU seconds both servers' processes used in each half
of the gaps. --tiny: the tests' tiny model. `--summarize OUT.json` prints the tables of a saved run again.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from vs_vllm_serve import ARMS, both_servers, grpc_request, http_request  # noqa: E402
from vs_vllm_serve_cpu import delta, tree_cpu  # noqa: E402

SPLIT_S = 0.2      # a second sample's first token this much after the first's: the engine's first step took one alone


def idle(gap: float, pids: dict[str, int]) -> dict:
    """Sleep `gap` seconds; the CPU seconds each server's processes (those over 0.05 s) used in its two halves."""
    if not gap:
        return {}
    marks = [{k: tree_cpu(v) for k, v in pids.items()}]
    for _ in range(2):
        time.sleep(gap / 2)
        marks.append({k: tree_cpu(v) for k, v in pids.items()})
    return {half: {k: delta(a[k], b[k]) for k in pids}
            for half, (a, b) in (("first_half", marks[:2]), ("second_half", marks[1:]))}


def one(arm: str, targets: dict, prompt: list[int], n: int, max_tokens: int) -> dict:
    """One streamed request (bench/vs_vllm_serve.py's), its whole time as "total"."""
    if arm == "grpc":
        r = grpc_request(targets["grpc"], prompt, n, max_tokens, True)
    else:
        import httpx

        async def go():
            async with httpx.AsyncClient(timeout=600) as client:
                return await http_request(client, targets[arm], prompt, n, max_tokens, True)
        r = asyncio.run(go())
    r["total"] = r.pop("latency")
    return r


def summarize(rows: list[dict], gaps: list[float], tokens: int) -> None:
    """Per arm and gap: the request's first token (p50, max), each sample's first token (p50; it does not depend on
    whether the engine's first step took one of the n samples or all of them, see bench/vs_vllm_serve.py), how many
    requests' first steps took one sample alone, the whole request; then the servers' CPU in the idle gaps."""
    print(f"{'arm':>10} {'gap s':>5} {'ttft p50 ms':>12} {'ttft max ms':>12} {'sample p50 ms':>14} {'split':>6} "
          f"{'total p50 s':>12} {'tok/s p50':>10}")
    for gap in gaps:
        for a in ARMS:
            here = [x[a] for x in rows if x["gap_s"] == gap]
            tt = [h["ttft"] for h in here]
            each = [t for h in here for t in h["firsts"]]
            split = sum(1 for h in here if len(h["firsts"]) > 1 and h["firsts"][1] - h["firsts"][0] > SPLIT_S)
            tot = [h["total"] for h in here]
            print(f"{a:>10} {gap:>5} {1000 * statistics.median(tt):>12.0f} {1000 * max(tt):>12.0f} "
                  f"{1000 * statistics.median(each):>14.0f} {f'{split}/{len(here)}':>6} "
                  f"{statistics.median(tot):>12.2f} {tokens / statistics.median(tot):>10.1f}")
    pids = sorted({srv for x in rows for a in ARMS if x[a].get("idle_cpu_s")
                   for srv in x[a]["idle_cpu_s"]["first_half"]})
    for half in ("first_half", "second_half"):
        for srv in pids:
            xs = [sum(x[a]["idle_cpu_s"][half][srv].values()) for x in rows for a in ARMS if x[a]["idle_cpu_s"]]
            if xs:
                print(f"{srv} CPU seconds in the {half.replace('_', ' ')} of the idle gap before a request: "
                      f"median {statistics.median(xs):.2f}, max {max(xs):.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny model")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--gaps", default="0,2", help="seconds idle before each request, each gap a pass of the round")
    ap.add_argument("--out", default=None, help="JSON of every request")
    ap.add_argument("--summarize", default=None, metavar="JSON", help="print the tables of an earlier run's --out")
    args = ap.parse_args()
    if args.summarize:
        saved = json.loads(Path(args.summarize).read_text())
        a = saved["args"]
        summarize(saved["rows"], [float(g) for g in a["gaps"].split(",")], a["n"] * a["max_tokens"])
        return 0

    from rollout_service.cli import resolve_model
    from rollout_service.model_info import ModelInfo
    from rollout_tasks.arithmetic import split

    if args.tiny:
        from tests.tiny_models import build_tiny_model
        model = str(build_tiny_model(Path(tempfile.mkdtemp(prefix="tiny-")) / "tiny"))
    else:
        model = resolve_model(args.model)
    info = ModelInfo.load(model, 1024)
    prompts = [info.encode(p.prompt, chat=True) for p in split(args.rounds + 1)]
    gaps = [float(g) for g in args.gaps.split(",")]
    rows = []
    with both_servers(model, args.dtype, 1024, 64, 2) as (vllm, svc, targets):
        pids = {"vllm_serve": vllm.proc.pid, "service": svc.proc.pid}
        for arm in ARMS:                                   # warm-up: every arm streams twice
            for _ in range(2):
                one(arm, targets, prompts[-1], args.n, 8)
        for r in range(args.rounds):
            order = ARMS[r % 3:] + ARMS[:r % 3]
            for gap in gaps:
                row = {"round": r, "gap_s": gap, "order": list(order)}
                prev = None
                for arm in order:
                    cpu = idle(gap, pids)
                    row[arm] = one(arm, targets, prompts[r], args.n, args.max_tokens)
                    row[arm]["after"], row[arm]["idle_cpu_s"] = prev, cpu
                    prev = arm
                    if row[arm]["tokens"] != args.n * args.max_tokens:
                        raise RuntimeError(f"{arm}: {row[arm]['tokens']} tokens, {args.n * args.max_tokens} expected")
                rows.append(row)
                print(f"round {r} gap {gap} s: " + "  ".join(f"{a} ttft {row[a]['ttft'] * 1000:.0f} ms total "
                                                             f"{row[a]['total']:.2f} s" for a in order), flush=True)
    summarize(rows, gaps, args.n * args.max_tokens)
    if args.out:
        Path(args.out).write_text(json.dumps({"model": model, "args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
