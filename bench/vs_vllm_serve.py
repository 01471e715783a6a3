"""The service against vLLM's own server (`vllm serve`) on the same machine, model, dtype and engine settings, in one
interleaved run (not a test).

    .venv/bin/python bench/vs_vllm_serve.py [--model DIR] [--concurrency 1,8,64] [--n 4] [--max-tokens 128]
        [--rounds 2] [--streamed no,yes] [--speculation none|ngram|eagle3|draft_model] [--draft-model DIR]
        [--k-by-batch-size 1-:0]
        [--out bench/results/vs_vllm_serve.json]

Three arms on one OpenAI-completions load (prompts from rollout_tasks' arithmetic task, chat-formatted token ids; n
samples of max_tokens tokens each, ignore_eos, temperature 1.0, log-prob of every token and its id, as an RL trainer
asks): `vllm_serve` (vLLM's server, started with the engine arguments the service gives its engine), `dialect` (the
service's vLLM-dialect HTTP on the same engine settings) and `grpc` (the service's Generate, same samples). Each round
sends, per concurrency level C, C concurrent requests (one prompt each) to every arm in turn, streaming and not; the
arm order rotates every round so the machine's drift hits every arm alike, and each batch starts SETTLE_S after the one
before (vLLM's processes busy-poll for a second after their last work). Throughput is generated tokens over the
batch's wall time; time to first token is per streamed request (its first chunk that carries a token) and per sample
(each of its n samples' first token); ratios against `vllm_serve` are taken per round and their median reported. A
request's first token races its n samples' arrival at the engine (vLLM adds them one by one): a step that starts after
the first one arrived prefills it alone (~0.25 s for the default model's ~90-token prompts here), and the rest in the
next step; one that starts later prefills all n together (~0.8 s). CPU's 128-token KV blocks are longer than the
prompts, so no sample reuses another's prefill. The per-sample figure does not depend on that race. Results to
--out and a table on stdout.
`--speculation METHOD` turns speculation on in the service only (k chosen per step; eagle3 and draft_model with the
default model's prepared drafter unless --draft-model); `vllm serve` stays plain, as a user would run it (vLLM's CPU
speculation needs the service's fixes, docs/upstream.md).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time

from harness import (SETTLE_S, VllmServe, engine_flags, k_control, logs_dir, pct, progress, ratios, services, turns,
                     write_result)

ARMS = ("vllm_serve", "dialect", "grpc")
GRPC_CLIENT = "asyncio"   # run_batch's gRPC client: "asyncio" or "threads" (--grpc-client)

async def http_request(client, url: str, prompt: list[int], n: int, max_tokens: int, stream: bool) -> dict:
    body = {"model": "policy", "prompt": prompt, "n": n, "max_tokens": max_tokens, "temperature": 1.0,
            "ignore_eos": True, "logprobs": 0, "return_token_ids": True, "stream": stream}
    t0 = time.perf_counter()
    tokens = 0
    if not stream:
        r = await client.post(url + "/v1/completions", json=body)
        r.raise_for_status()
        tokens = sum(len(c["token_ids"]) for c in r.json()["choices"])
        return {"tokens": tokens, "ttft": None, "firsts": [], "latency": time.perf_counter() - t0}
    firsts: dict[int, float] = {}                              # sample index -> its first token
    chunks = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks += 1
            for c in json.loads(line[6:]).get("choices", []):
                got = len(c.get("token_ids") or [])
                if got:
                    firsts.setdefault(c["index"], time.perf_counter() - t0)
                tokens += got
    return {"tokens": tokens, "ttft": min(firsts.values(), default=None), "firsts": sorted(firsts.values()),
            "chunks": chunks, "latency": time.perf_counter() - t0}


class Tally:
    """One gRPC request's samples as they arrive: tokens, messages, each sample's first token (its first delta
    with tokens, or its whole answer when streamed), as http_request counts them."""

    def __init__(self, stream: bool):
        self.t0, self.stream = time.perf_counter(), stream
        self.firsts: dict[int, float] = {}                     # sample index -> its first token
        self.tokens = self.chunks = 0

    def add(self, s) -> None:
        self.chunks += 1
        if s.delta:
            if len(s.token_ids):
                self.firsts.setdefault(s.sample_index, time.perf_counter() - self.t0)
            return
        self.tokens += len(s.token_ids)
        if self.stream:
            self.firsts.setdefault(s.sample_index, time.perf_counter() - self.t0)

    def result(self) -> dict:
        return {"tokens": self.tokens, "ttft": min(self.firsts.values(), default=None),
                "firsts": sorted(self.firsts.values()), "chunks": self.chunks, "latency": time.perf_counter() - self.t0}


def grpc_request(client, prompt: list[int], n: int, max_tokens: int, stream: bool) -> dict:
    tally = Tally(stream)
    for s in client.generate([prompt], n=n, max_tokens=max_tokens, temperature=1.0, ignore_eos=True,
                             stream_tokens=stream):
        tally.add(s)
    return tally.result()


async def grpc_request_async(client, prompt: list[int], n: int, max_tokens: int, stream: bool) -> dict:
    """grpc_request on the asyncio client (AsyncRolloutClient)."""
    tally = Tally(stream)
    async for s in client.generate([prompt], n=n, max_tokens=max_tokens, temperature=1.0, ignore_eos=True,
                                   stream_tokens=stream):
        tally.add(s)
    return tally.result()


def run_batch(arm: str, targets: dict, prompts: list[list[int]], n: int, max_tokens: int, stream: bool,
              grpc_client: str = GRPC_CLIENT) -> dict:
    """One batch: the prompts as concurrent requests to `arm`. The gRPC arm's requests run on one asyncio loop
    (grpc_client "asyncio": AsyncRolloutClient, as the HTTP arms run on httpx's) or in a thread each ("threads":
    RolloutClient)."""
    t0 = time.perf_counter()
    if arm == "grpc" and grpc_client == "asyncio":
        from rollout_client import AsyncRolloutClient

        async def go_grpc():
            client = AsyncRolloutClient(targets["grpc_target"])
            try:
                return await asyncio.gather(*(grpc_request_async(client, p, n, max_tokens, stream) for p in prompts))
            finally:
                await client.channel.close()
        results = asyncio.run(go_grpc())
    elif arm == "grpc":
        results: list[dict] = [None] * len(prompts)

        def one(i):
            results[i] = grpc_request(targets["grpc"], prompts[i], n, max_tokens, stream)
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        import httpx

        async def go():
            limits = httpx.Limits(max_connections=len(prompts) + 4)
            async with httpx.AsyncClient(timeout=1800, limits=limits) as c:
                return await asyncio.gather(*(http_request(c, targets[arm], p, n, max_tokens, stream)
                                              for p in prompts))
        results = asyncio.run(go())
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    expected = len(prompts) * n * max_tokens
    if tokens != expected:
        raise RuntimeError(f"{arm}: {tokens} tokens generated, {expected} expected")
    ttfts = sorted(r["ttft"] for r in results if r["ttft"] is not None)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "ttft_s": ttfts,
            "sample_ttft_s": sorted(t for r in results for t in r["firsts"]),
            "latency_s": sorted(r["latency"] for r in results)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the service's default model")
    ap.add_argument("--concurrency", default="1,8,64")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--grpc-client", default=GRPC_CLIENT, choices=["asyncio", "threads"],
                    help="the gRPC arm's client: AsyncRolloutClient on one loop, or RolloutClient in a thread per "
                    "request")
    ap.add_argument("--streamed", default="no,yes", help="which rows: no (whole answers), yes (streamed) or both")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-cache-gb", type=float, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=64, help="both servers' cap on running sequences (it was the "
                    "largest --concurrency before 2026-11-28: the EAGLE-3 run at --concurrency 1,8 ran 8 at a time)")
    ap.add_argument("--speculation", default="none", choices=["none", "ngram", "eagle3", "draft_model"])
    ap.add_argument("--k-by-batch-size", default=None, metavar="FIRST-LAST:K,...", help="with --speculation: k by "
                    "batch size instead of the k controller (1-:0 holds k at 0: what a step that drafts nothing costs)")
    ap.add_argument("--draft-model", default=None, help="eagle3 / draft_model: the drafter (default: the default "
                    "model's, `rollout-service prepare-drafter --kind KIND`, prepared once and cached)")
    ap.add_argument("--out", default=None, help="default bench/results/vs_vllm_serve.json")
    args = ap.parse_args()
    if args.k_by_batch_size and args.speculation == "none":
        ap.error("--k-by-batch-size needs --speculation: without a drafter there is no k to choose")

    from rollout_client import RolloutClient
    from rollout_service.cli import resolve_model
    from rollout_service.model_info import ModelInfo
    from rollout_tasks.arithmetic import split

    model = resolve_model(args.model)
    levels = [int(x) for x in args.concurrency.split(",")]
    streams = [{"no": False, "yes": True}[x] for x in args.streamed.split(",")]
    info = ModelInfo.load(model, args.max_model_len)
    prompts = [info.encode(p.prompt, chat=True) for p in split(max(levels) * (args.rounds + 1))]
    drafter = args.draft_model
    if args.speculation in ("eagle3", "draft_model") and not drafter:
        from rollout_service.drafting.drafters import prepare_draft_model, prepare_eagle3_head

        drafter = str((prepare_eagle3_head if args.speculation == "eagle3" else prepare_draft_model)(model))
    flags, env = engine_flags(model, args.dtype, args.max_model_len, args.max_num_seqs, args.kv_cache_gb)
    ours = ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--max-num-seqs",
            str(args.max_num_seqs), "--kv-cache-gb", str(args.kv_cache_gb)]
    if args.speculation != "none":
        ours += ["--speculation", args.speculation] + (["--draft-model", drafter] if drafter else []) + \
            (["--k-by-batch-size", args.k_by_batch_size] if args.k_by_batch_size else [])
    logs = logs_dir("vs-vllm-serve")
    rows, kc = [], None
    with services(model, {"vllm_serve": VllmServe(model, flags, env, logs / "vllm_serve.log"), "service": ours},
                  logs) as up, RolloutClient(up["service"].target) as client:
        targets = {"vllm_serve": up["vllm_serve"].http, "dialect": up["service"].http, "grpc": client,
                   "grpc_target": up["service"].target}
        for arm in ARMS:                                         # warm-up: every path once, streamed and not
            for stream in (False, True):                         # (a dialect's first stream sets up its detokenizer)
                run_batch(arm, targets, prompts[:2], 1, 8, stream, args.grpc_client)
        with progress(len(levels) * args.rounds * len(streams) * len(ARMS)) as bar:
            for r in range(args.rounds):
                for conc in levels:
                    picked = prompts[r * conc:(r + 1) * conc]
                    for stream in streams:
                        got = {}
                        for arm in turns(ARMS, r):               # rotating order, SETTLE_S before each batch
                            got[arm] = run_batch(arm, targets, picked, args.n, args.max_tokens, stream,
                                                 args.grpc_client)
                            bar.set_postfix(arm=arm, c=conc, stream=stream, tok_s=round(got[arm]["tok_s"], 1))
                            bar.update()
                        rows.append({"round": r, "concurrency": conc, "stream": stream, "order": list(got), **got})
        if args.speculation != "none":                           # what the k controller chose, by batch size
            kc = k_control(client.status().k_control)
    summary = []
    for conc in levels:
        for stream in streams:
            rs = [x for x in rows if x["concurrency"] == conc and x["stream"] == stream]
            row = {"concurrency": conc, "stream": stream}
            for arm in ARMS:
                row[f"{arm}_tok_s"] = statistics.median(x[arm]["tok_s"] for x in rs)
                if stream:
                    ttfts = sorted(t for x in rs for t in x[arm]["ttft_s"])
                    row[f"{arm}_ttft_p50_s"], row[f"{arm}_ttft_p99_s"] = pct(ttfts, 0.5), pct(ttfts, 0.99)
                    each = sorted(t for x in rs for t in x[arm].get("sample_ttft_s", ()))
                    row[f"{arm}_sample_ttft_p50_s"], row[f"{arm}_sample_ttft_p99_s"] = pct(each, 0.5), pct(each, 0.99)
                if arm != "vllm_serve":
                    ratio = ratios(rs, arm, "vllm_serve")
                    row[f"{arm}_ratio"], row[f"{arm}_ratio_range"] = ratio["median"], [ratio["min"], ratio["max"]]
            summary.append(row)
    config = {"model": model, "vllm_serve_flags": flags, "n": args.n, "max_tokens": args.max_tokens,
              "speculation": args.speculation, "k_by_batch_size": args.k_by_batch_size,
              "max_num_seqs": args.max_num_seqs, "drafter": drafter,
              "grpc_client": args.grpc_client, "settle_s": SETTLE_S}
    path = write_result("vs_vllm_serve", config, summary, rows, args.out, k_control=kc)
    print(f"{'conc':>4} {'stream':>6} {'vllm tok/s':>10} {'dialect':>8} {'x':>6} {'grpc':>8} {'x':>6} "
          f"{'ttft p50 vllm/dialect/grpc (ms), request':>42} {'sample':>16}")
    for s in summary:
        ttft = each = ""
        if s["stream"]:
            ttft = "/".join(f"{1000 * (s[f'{a}_ttft_p50_s'] or 0):.0f}" for a in ARMS)
            each = "/".join(f"{1000 * (s.get(f'{a}_sample_ttft_p50_s') or 0):.0f}" for a in ARMS)
        print(f"{s['concurrency']:>4} {str(s['stream']):>6} {s['vllm_serve_tok_s']:>10.1f} {s['dialect_tok_s']:>8.1f} "
              f"{s['dialect_ratio']:>6.3f} {s['grpc_tok_s']:>8.1f} {s['grpc_ratio']:>6.3f} {ttft:>42} {each:>16}")
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
