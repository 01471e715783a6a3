"""Multi-turn tool episodes against vLLM's own server (`vllm serve --enable-auto-tool-choice --tool-call-parser
hermes`), the service's vLLM dialect and its gRPC Generate, on the same model and engine settings, interleaved (not a
test).

    .venv/bin/python bench/agentic.py [--model tool|DIR] [--concurrency 1,8] [--rounds 4] [--max-turns 3]
        [--max-tokens 64] [--out bench/results/agentic.json]

The load an agent trainer sends: E concurrent episodes (E = each --concurrency level), each a calculator question with
the calculator tool, streamed turn by turn at temperature 1 with log-probs: a turn's tool calls are run and answered
with tool messages, until a turn calls no tool or --max-turns. Arms: `vllm_serve` (the conversation's messages sent
again every turn, vLLM renders and re-tokenizes them, as a user of vllm serve does), `dialect` (the same chat requests
to the service, plus prefix_token_ids: the episode's exact tokens) and `grpc` (rollout_client.Episode: chat prompts with
the exact tokens so far, one session per episode). Every arm's requests carry a session key (X-Session-ID) and vLLM's
prefix cache is on in both servers. Each round runs every arm on a fresh batch of episodes, the arm order rotating and
each batch starting after SETTLE_S idle seconds; a round's ratios are against its own `vllm_serve` batch and the
median over rounds is reported (fields ending `_ratio`).

Throughput: generated tokens (every turn's) over the batch's wall time. Time to first token: per turn, from the turn's
request to its first streamed token, split into first turns and later turns (a later turn's prompt holds the episode so
far: the prefix cache decides it). --model tool (default) is a tiny model trained in seconds to call the calculator and
answer from its result (tests/tiny_models.py): every episode really runs two or more turns, and the front ends' own
cost shows at its largest; --model DIR serves another model (the default model, SmolLM2-135M, seldom calls the tool).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

from harness import VllmServe, engine_flags, logs_dir, pct, progress, ratios, services, turns, write_result

from rollout_tasks.calculator import calculator  # the task's tool: ast-evaluated, errors as text

ARMS = ("vllm_serve", "dialect", "grpc")


def answer_calls(calls: list[dict]) -> list[dict]:
    out = []
    for c in calls:
        try:
            args = json.loads(c["function"]["arguments"] or "{}")
            result = calculator(args.get("expression", "")) if isinstance(args, dict) else "error: arguments"
        except ValueError:
            result = "error: arguments are not JSON"
        out.append({"role": "tool", "tool_call_id": c["id"], "content": result})
    return out


async def http_episode(client, url: str, question: str, tool: dict, arm: str, max_turns: int, max_tokens: int,
                       session: str) -> list[dict]:
    """One episode over an OpenAI chat endpoint, streamed; per turn: tokens, time to first token, tool calls."""
    messages = [{"role": "user", "content": question}]
    prefix: list[int] = []
    turns = []
    for _ in range(max_turns):
        body = {"model": "policy", "messages": messages, "tools": [tool], "max_tokens": max_tokens,
                "temperature": 1.0, "logprobs": True, "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True}
        if arm == "dialect" and prefix:
            body |= {"prefix_token_ids": prefix, "num_prefix_messages": len(messages) - len(turns[-1]["answers"])}
        t0 = time.perf_counter()
        first = None
        calls: dict[int, dict] = {}
        content, prompt_ids, ids, tokens = "", None, [], 0
        async with client.stream("POST", url + "/v1/chat/completions", json=body,
                                 headers={"X-Session-ID": session}) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("prompt_token_ids") and prompt_ids is None:
                    prompt_ids = chunk["prompt_token_ids"]
                for c in chunk.get("choices", []):
                    got = c.get("token_ids") or []
                    ids += got
                    d = c.get("delta") or {}
                    if first is None and (got or d.get("content") or d.get("tool_calls") or d.get("reasoning")):
                        first = time.perf_counter() - t0
                    content += d.get("content") or ""
                    for tc in d.get("tool_calls") or []:
                        slot = calls.setdefault(tc.get("index", 0), {"id": "", "type": "function",
                                                                     "function": {"name": "", "arguments": ""}})
                        slot["id"] = tc.get("id") or slot["id"]
                        fn = tc.get("function") or {}
                        slot["function"]["name"] += fn.get("name") or ""
                        slot["function"]["arguments"] += fn.get("arguments") or ""
        made = [calls[i] for i in sorted(calls)]
        answers = answer_calls(made)
        turns.append({"tokens": tokens or len(ids), "ttft": first, "calls": len(made), "answers": answers,
                      "latency": time.perf_counter() - t0})
        if not made:
            break
        messages += [{"role": "assistant", "content": content or None, "tool_calls": made}, *answers]
        if prompt_ids is not None:
            prefix = prompt_ids + ids
    return turns


async def grpc_episode(client, question: str, tool: dict, max_turns: int, max_tokens: int) -> list[dict]:
    from rollout_client import Episode, call_tools

    e = Episode([{"role": "user", "content": question}], tools=[tool])
    turns = []
    for _ in range(max_turns):
        t0 = time.perf_counter()
        first = None
        async for s in client.generate([e.prompt()], n=1, max_tokens=max_tokens, temperature=1.0,
                                       stream_tokens=True, session_id=e.session_id):
            if s.delta:
                if first is None and len(s.token_ids):
                    first = time.perf_counter() - t0
                continue
            e.record(s)
        calls = len(e.tool_calls) if not e.done else 0
        turns.append({"tokens": len(e.turns[-1].token_ids), "ttft": first, "calls": len(e.tool_calls),
                      "cached": e.turns[-1].num_cached_tokens, "latency": time.perf_counter() - t0})
        if e.done or not calls:
            break
        call_tools(e, {"calculator": calculator})
    return turns


def run_batch(arm: str, targets: dict, questions: list[str], tool: dict, max_turns: int, max_tokens: int) -> dict:
    import httpx

    async def go():
        if arm == "grpc":
            from rollout_client import AsyncRolloutClient

            client = AsyncRolloutClient(targets["grpc_target"])
            try:
                return await asyncio.gather(*(grpc_episode(client, q, tool, max_turns, max_tokens)
                                              for q in questions))
            finally:
                await client.channel.close()
        limits = httpx.Limits(max_connections=len(questions) + 4)
        async with httpx.AsyncClient(timeout=1800, limits=limits) as c:
            return await asyncio.gather(*(http_episode(c, targets[arm], q, tool, arm, max_turns, max_tokens,
                                                       f"{arm}-{i}-{time.monotonic_ns()}")
                                          for i, q in enumerate(questions)))
    t0 = time.perf_counter()
    episodes = asyncio.run(go())
    wall = time.perf_counter() - t0
    tokens = sum(t["tokens"] for e in episodes for t in e)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "episodes": len(episodes),
            "turns": sum(len(e) for e in episodes), "calls": sum(t["calls"] for e in episodes for t in e),
            "ttft_first_s": sorted(e[0]["ttft"] for e in episodes if e[0]["ttft"] is not None),
            "ttft_later_s": sorted(t["ttft"] for e in episodes for t in e[1:] if t["ttft"] is not None),
            "cached_later": [t.get("cached") for e in episodes for t in e[1:] if t.get("cached") is not None]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tool", help="`tool` (a tiny model trained to call the calculator, built in "
                    "seconds), or a model directory")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-cache-gb", type=float, default=1)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--out", default=None, help="default bench/results/agentic.json")
    args = ap.parse_args()

    from rollout_client import RolloutClient

    logs = logs_dir("agentic")
    if args.model == "tool":
        from tests.tiny_models import TOOL_CALCULATOR, TOOL_PROBLEMS, build_tiny_tool_model

        model = str(build_tiny_tool_model(logs / "tool-model"))
        tool, questions = TOOL_CALCULATOR, [q for q, _, _ in TOOL_PROBLEMS]
    else:
        from rollout_tasks.calculator import TOOL, split, user_message

        model, tool = args.model, TOOL
        questions = [user_message(p) for p in split(64)]
    levels = [int(x) for x in args.concurrency.split(",")]
    flags, env = engine_flags(model, args.dtype, args.max_model_len, args.max_num_seqs, args.kv_cache_gb)
    flags += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    ours = ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--max-num-seqs",
            str(args.max_num_seqs), "--kv-cache-gb", str(args.kv_cache_gb), "--tool-call-parser", "hermes"]
    rows = []
    with services(model, {"vllm_serve": VllmServe(model, flags, env, logs / "vllm_serve.log"), "service": ours},
                  logs) as up, RolloutClient(up["service"].target):
        targets = {"vllm_serve": up["vllm_serve"].http, "dialect": up["service"].http,
                   "grpc_target": up["service"].target}
        for arm in ARMS:                                        # warm-up: every path once
            run_batch(arm, targets, questions[:2], tool, args.max_turns, 16)
        with progress(args.rounds * len(levels) * len(ARMS)) as bar:
            for r in range(args.rounds):
                for conc in levels:
                    picked = [questions[(r * conc + i) % len(questions)] for i in range(conc)]
                    got = {}
                    for arm in turns(ARMS, r):
                        got[arm] = run_batch(arm, targets, picked, tool, args.max_turns, args.max_tokens)
                        bar.set_postfix(arm=arm, c=conc, tok_s=round(got[arm]["tok_s"], 1))
                        bar.update()
                    rows.append({"round": r, "concurrency": conc, "order": list(got), **got})
    summary = []
    for conc in levels:
        rs = [x for x in rows if x["concurrency"] == conc]
        row = {"concurrency": conc}
        for arm in ARMS:
            row[f"{arm}_tok_s"] = statistics.median(x[arm]["tok_s"] for x in rs)
            row[f"{arm}_turns_per_episode"] = sum(x[arm]["turns"] for x in rs) / sum(x[arm]["episodes"] for x in rs)
            for which in ("first", "later"):
                ts = sorted(t for x in rs for t in x[arm][f"ttft_{which}_s"])
                row[f"{arm}_ttft_{which}_p50_s"] = pct(ts, 0.5)
            if arm != "vllm_serve":
                ratio = ratios(rs, arm, "vllm_serve")
                row[f"{arm}_throughput_ratio"], row[f"{arm}_throughput_ratio_range"] = ratio["median"], [
                    ratio["min"], ratio["max"]]
                later = [statistics.median(x[arm]["ttft_later_s"]) / statistics.median(x["vllm_serve"]["ttft_later_s"])
                         for x in rs if x[arm]["ttft_later_s"] and x["vllm_serve"]["ttft_later_s"]]
                row[f"{arm}_ttft_later_ratio"] = statistics.median(later) if later else None
        cached = [c for x in rs for c in x["grpc"]["cached_later"]]
        row["grpc_later_turns_cached_tokens_mean"] = statistics.mean(cached) if cached else None
        summary.append(row)
    config = {"model": args.model, "vllm_serve_flags": flags, "max_turns": args.max_turns,
              "max_tokens": args.max_tokens}
    path = write_result("agentic", config, summary, rows, args.out)
    print(f"{'conc':>4} {'vllm tok/s':>10} {'dialect x':>9} {'grpc x':>7} {'turns/ep v/d/g':>16} "
          f"{'ttft later p50 ms v/d/g':>24} {'later x d/g':>12}")
    for s in summary:
        per_episode = "/".join(f"{s[f'{a}_turns_per_episode']:.2f}" for a in ARMS)
        later = "/".join(f"{1000 * (s[f'{a}_ttft_later_p50_s'] or 0):.0f}" for a in ARMS)
        lx = "/".join(f"{s[f'{a}_ttft_later_ratio'] or 0:.2f}" for a in ("dialect", "grpc"))
        print(f"{s['concurrency']:>4} {s['vllm_serve_tok_s']:>10.1f} {s['dialect_throughput_ratio']:>9.3f} "
              f"{s['grpc_throughput_ratio']:>7.3f} {per_episode:>16} {later:>24} {lx:>12}")
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
