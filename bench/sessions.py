"""Time to first token of multi-turn conversations on two engines, with session routing against without (not a test).

    .venv/bin/python bench/sessions.py [--model DIR] [--conversations 24] [--turns 6] [--history 1024]
                                       [--user-tokens 64] [--min-tokens 4] [--max-tokens 32] [--think-s 2]
                                       [--rounds 3] [--plot bench/results/sessions.png]

One service (`serve --engines 2`, the embedded default model unless --model). Each arm runs C conversations at once;
each conversation takes T turns one after another, as an agent does: turn 1 sends a history of --history token ids,
every later turn sends the whole conversation so far (the previous prompt, the tokens the policy generated, then
--user-tokens new ids: the next user or tool message), so histories grow past 1,000 tokens. Each turn generates
--min-tokens to --max-tokens tokens (drawn per turn) and the agent then waits 0 to --think-s seconds (a tool call)
before its next turn, so conversations fall out of step as they do in agentic RL. Prompts are token ids
(random, distinct per conversation from the first token on, so no conversation shares cache with another and the
tokenizer plays no part). The arms alternate in one run (sessions, least-loaded, sessions, ...), each round with
fresh conversations:

- sessions: every request carries GenerateRequest.session_id (one per conversation): its turns go to one engine.
- least-loaded: no session_id (the routing before sessions existed): each turn goes to the engine with fewer
  sequences, wherever the conversation's history is cached.

Time to first token (TTFT) is measured by the client: from sending the request to the first token delta
(GenerateRequest.stream_tokens) of its sample. Turn 1 has nothing cached in either arm and is left out; the table is
over turns 2..T. Each sample's num_cached_tokens (vLLM's prefix-cache hit) says how much of each history was found
in the engine's cache. The ratio is taken per round (least-loaded / sessions, for the median and the mean TTFT) and
its median over rounds reported. Results: bench/results/sessions.json (--out); --plot draws each arm's TTFT
distribution (all rounds).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

from harness import logs_dir, services, spread, turns, write_result

ARMS = ("sessions", "least_loaded")


async def conversation(client, key: str, arm: str, rng: random.Random, args, vocab: int) -> list[dict]:
    """One conversation's turns, one after another; per turn: TTFT, prompt length, cached tokens, engine time."""
    history = [rng.randrange(100, vocab) for _ in range(args.history)]
    turns = []
    for turn in range(1, args.turns + 1):
        if turn > 1:
            await asyncio.sleep(rng.uniform(0, args.think_s))
        kw = dict(max_tokens=rng.randint(args.min_tokens, args.max_tokens), temperature=1.0, ignore_eos=True,
                  stream_tokens=True, seed=rng.getrandbits(31))
        if arm == "sessions":
            kw["session_id"] = key
        sent = time.perf_counter()
        first = final = None
        async for s in client.generate([history], **kw):
            if first is None:
                first = time.perf_counter()
            if not s.delta:
                final = s
        done = time.perf_counter()
        turns.append(dict(turn=turn, prompt_tokens=len(history), cached_tokens=final.num_cached_tokens,
                          ttft_s=first - sent, total_s=done - sent))
        history = history + final.token_ids.tolist() + [rng.randrange(100, vocab) for _ in range(args.user_tokens)]
    return turns


async def run_arm(target: str, arm: str, round_no: int, args, vocab: int) -> dict:
    from rollout_client import AsyncRolloutClient

    client = AsyncRolloutClient(target)
    try:
        before = await client.status()
        t = time.perf_counter()
        keys = [f"r{round_no}-{arm}-c{i}" for i in range(args.conversations)]
        convs = await asyncio.gather(*(conversation(client, k, arm, random.Random(f"{round_no}:{arm}:{k}"), args,
                                                    vocab) for k in keys))
        wall = time.perf_counter() - t
        after = await client.status()
    finally:
        await client.channel.close()
    later = [x for c in convs for x in c if x["turn"] > 1]
    took = {e.id: e.samples_finished - b.samples_finished for e, b in zip(after.engines, before.engines)}
    hits = after.sessions.hits - before.sessions.hits
    moved = (after.sessions.moved_overloaded - before.sessions.moved_overloaded
             + after.sessions.moved_unavailable - before.sessions.moved_unavailable)
    return dict(arm=arm, round=round_no, wall_s=wall, samples_per_engine=took, session_hits=hits,
                session_moves=moved,
                ttft_median_s=statistics.median(x["ttft_s"] for x in later),
                ttft_mean_s=statistics.fmean(x["ttft_s"] for x in later),
                ttft_p90_s=sorted(x["ttft_s"] for x in later)[int(0.9 * (len(later) - 1))],
                cached_share=sum(x["cached_tokens"] for x in later) / sum(x["prompt_tokens"] for x in later),
                turns_mostly_cached=sum(x["cached_tokens"] >= x["prompt_tokens"] / 2 for x in later) / len(later),
                history_tokens=[min(x["prompt_tokens"] for x in later), max(x["prompt_tokens"] for x in later)],
                conversations=convs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--history", type=int, default=1024, help="token ids of the first turn's prompt")
    ap.add_argument("--user-tokens", type=int, default=64, help="new token ids each later turn adds")
    ap.add_argument("--min-tokens", type=int, default=4, help="fewest tokens generated in a turn")
    ap.add_argument("--max-tokens", type=int, default=32, help="most tokens generated in a turn")
    ap.add_argument("--think-s", type=float, default=2.0, help="most seconds an agent waits between its turns")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (sessions, least-loaded)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-gb", type=float, default=2.0, help="KV cache per engine (serve --kv-cache-gb)")
    ap.add_argument("--out", default=None, help="default bench/results/sessions.json")
    ap.add_argument("--plot", help="also draw the TTFT distributions into this PNG")
    args = ap.parse_args()
    longest = args.history + (args.turns - 1) * (args.max_tokens + args.user_tokens) + args.max_tokens
    if longest > args.max_model_len:
        sys.exit(f"the last turn needs {longest} tokens of context; raise --max-model-len or shorten the workload")

    from rollout_client import RolloutClient

    from rollout_service.models import prepare_default_model

    model = args.model or str(prepare_default_model())
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    logs = logs_dir("bench-sessions")
    print(f"model {model}; 2 engines; {args.conversations} conversations x {args.turns} turns, history "
          f"{args.history} + {args.max_tokens + args.user_tokens} per turn (up to {longest} tokens); logs {logs}",
          flush=True)
    rows = []
    extra = ["--engines", "2", "--max-model-len", str(args.max_model_len), "--kv-cache-gb", str(args.kv_cache_gb)]
    with services(model, {"service": extra}, logs) as up:
        target = up["service"].target
        with RolloutClient(target) as c:                     # warm both engines (first-step costs) off the clock
            c.generate_all([[1, 2, 3]] * 4, max_tokens=4)
        for r in range(1, args.rounds + 1):
            for arm in turns(ARMS, r - 1):
                row = asyncio.run(run_arm(target, arm, r, args, vocab))
                rows.append(row)
                print(f"round {r} {arm:>12}: TTFT of turns 2..{args.turns} median {row['ttft_median_s']:.3f} s, "
                      f"mean {row['ttft_mean_s']:.3f} s, p90 {row['ttft_p90_s']:.3f} s; history found cached "
                      f"{100 * row['cached_share']:.0f}% (turns with most of it: "
                      f"{100 * row['turns_mostly_cached']:.0f}%); samples per engine {row['samples_per_engine']}; "
                      f"session hits {row['session_hits']}, moves {row['session_moves']}; {row['wall_s']:.1f} s",
                      flush=True)
    pairs = []
    for r in range(1, args.rounds + 1):
        on, off = (next(x for x in rows if x["round"] == r and x["arm"] == a) for a in ARMS)
        pairs.append(dict(round=r, median_ratio=off["ttft_median_s"] / on["ttft_median_s"],
                          mean_ratio=off["ttft_mean_s"] / on["ttft_mean_s"]))
    ratio = statistics.median(p["median_ratio"] for p in pairs)
    mean_ratio = statistics.median(p["mean_ratio"] for p in pairs)
    print("\nround  least-loaded / sessions TTFT (median)  (mean)")
    for p in pairs:
        print(f"{p['round']:5d}  {p['median_ratio']:36.2f}  {p['mean_ratio']:6.2f}")
    print(f"median over rounds: {ratio:.2f}x lower median time to first token with sessions, {mean_ratio:.2f}x lower "
          "mean (goal: >= 2x)")
    summary = {"ttft_ratio_median": ratio, "ttft_ratio_mean": mean_ratio,
               "ttft_ratio_spread": spread(p["median_ratio"] for p in pairs), "pairs": pairs}
    print(f"wrote {write_result('sessions', vars(args) | {'model': model, 'engines': 2}, summary, rows, args.out)}")
    if args.plot:
        print(f"wrote {plot(rows, Path(args.plot), args.turns)}")


def plot(rows: list[dict], out: Path, turns: int) -> Path:
    """Each arm's TTFT of turns 2..T, all rounds: the distribution (CDF), and the median by turn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, by_turn) = plt.subplots(1, 2, figsize=(10, 4))
    for arm, label in zip(ARMS, ("sessions (session_id)", "least-loaded (no session_id)")):
        later = [t for r in rows if r["arm"] == arm for c in r["conversations"] for t in c if t["turn"] > 1]
        xs = sorted(t["ttft_s"] for t in later)
        cdf.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
        ts = list(range(2, turns + 1))
        by_turn.plot(ts, [statistics.median(t["ttft_s"] for t in later if t["turn"] == k) for k in ts], marker="o",
                     label=label)
    cdf.set(xlabel="time to first token (s)", ylabel="share of turns", title="TTFT of turns 2..T, all rounds")
    by_turn.set(xlabel="turn", ylabel="median TTFT (s)", title="by turn", ylim=(0, None))
    for ax in (cdf, by_turn):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    main()
