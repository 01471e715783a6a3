"""The front end's ceiling: tokens/s and CPU seconds per million tokens of one front-end process whose engines answer
at once (not a test).

    .venv/bin/python bench/frontend_ceiling.py [--seconds 6] [--rounds 2] [--prompts 16] [--n 4] [--tokens 256]
                                               [--concurrency 4] [--arms grpc,grpc_stream,...] [--profile ARM]
                                               [--baseline REV] [--out bench/results/frontend_ceiling.json]
    .venv/bin/python bench/frontend_ceiling.py --vllm-output | --ray-hop | --project

Each arm is one request shape against the real service (`serve()` of server/app.py: the gRPC servicer, the pool, the
HTTP dialects) started as a process of its own on core 0, whose engines are `InstantEngine`s: a finished sample (or,
streamed, one delta per step, every sequence's step before the next) the moment it is asked for, so what is measured
is everything the service does between a request and the bytes of its answer. The client runs on core 1, keeps
--concurrency requests of --prompts prompts x --n samples x --tokens tokens in flight for --seconds, and counts the
tokens received; the server's CPU time (utime + stime of its process, every thread) over the same window gives CPU
seconds per million tokens, the figure that does not depend on how fast the client reads. Arms, run in rounds with
their order rotated (bench/harness.py):

- grpc, grpc_stream (GenerateRequest.stream_tokens: a message per sample per engine step), grpc_top5
  (top_logprobs 5), grpc_routes (return_routed_experts, a second server on the bundled tiny MoE model);
- vllm (`/v1/completions`, token prompts, `logprobs` 0: the sampled token's), vllm_top5 (`logprobs` 5), vllm_stream;
- sglang (`/generate`, `return_logprob`), sglang_top5 (`top_logprobs_num` 5).

--vllm-output measures vLLM's own output path (its OutputProcessor turning EngineCoreOutputs into RequestOutputs, in
the front end's process) followed by the engine's conversion to a SeqResult (engine/vllm_engine.py), fed at once
with --prompts x --n sequences per step; it needs no server.

--ray-hop measures what a sample costs the front end when its engine is a Ray actor (the call, the answer through
Ray, the SeqResult's decode), with an actor that answers at once. --project (also run after every arms run) projects
how many front-end processes a GB200 NVL72 rack needs, from these results and the performance model.

--profile ARM runs that arm's server under cProfile (py-spy cannot read this Python build: "Failed to find python
version") and prints the functions with the most own time. Results: bench/results/frontend_ceiling.json (with the
projection), frontend_ceiling_vllm_output.json, frontend_ceiling_ray_hop.json; what they say: docs/frontend.md.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness import RESULTS, ROOT, rotate, spread, write_result

if os.environ.get("FRONTEND_CEILING_CODE"):      # a --baseline server: the service's code of another revision
    sys.path.insert(0, os.environ["FRONTEND_CEILING_CODE"])
from rollout_service.engine.base import Engine, EngineState
from rollout_service.engine.types import Routes, SeqRequest, SeqResult, TokenDelta

GRPC_ARMS = ("grpc", "grpc_stream", "grpc_top5", "grpc_routes")
HTTP_ARMS = ("vllm", "vllm_top5", "vllm_stream", "sglang", "sglang_top5")
ARMS = GRPC_ARMS + HTTP_ARMS
SERVER_CORE, CLIENT_CORE = 0, 1


class InstantEngine(Engine):
    """An engine that answers at once: made-up tokens with log-probs (and top-k rows and routes when asked), the
    whole sample, or one delta per step with every running sequence's step taken before the next."""

    def __init__(self, engine_id: str, moe=None):
        super().__init__(engine_id)
        self.moe = moe            # model_info.MoeShape of the served model (routes) or None
        self.streams: list[list] = []     # streamed sequences running: [request, on_delta, next token, done]
        self.stepper: asyncio.Task | None = None

    async def start(self) -> None:
        self.state = EngineState.READY

    async def generate(self, req: SeqRequest, on_delta=None) -> SeqResult:
        n, k, v = req.max_tokens, req.top_logprobs, self.policy_version
        ids, lps, top_ids, top_lps = (list(x) for x in self._made(n, k))
        prompt = len(req.prompt_token_ids)
        if req.stream and on_delta is not None:      # one delta per step, from the engine's one step loop
            done = asyncio.get_running_loop().create_future()
            self.streams.append([req, on_delta, 0, done])
            if self.stepper is None or self.stepper.done():
                self.stepper = asyncio.create_task(self._steps())
            await done
        else:
            await asyncio.sleep(0)
        routes = self._routes(req.routes_from, prompt + n - 1 - req.routes_from) if req.return_routed_experts else None
        return SeqResult(token_ids=ids, logprobs=lps, finish_reason="length", policy_version=v,
                         version_spans=[(v, 0)], draft_version=self.draft_version, top_token_ids=top_ids,
                         top_logprobs=top_lps, routed_experts=routes)

    async def _steps(self) -> None:
        """The engine's step loop, as vLLM's output handler: each step hands every running sequence its next token,
        then lets the event loop run (the readers) before the next."""
        while self.streams:
            running = []
            for entry in self.streams:
                req, on_delta, i, done = entry
                ids, lps, top_ids, top_lps = self._made(req.max_tokens, req.top_logprobs)
                routes = None
                if req.return_routed_experts:
                    prompt = len(req.prompt_token_ids)
                    routes = self._routes(0, prompt) if i == 0 else self._routes(prompt + i - 1, 1)
                on_delta(TokenDelta(start=i, token_ids=ids[i:i + 1], logprobs=lps[i:i + 1],
                                    version_spans=[(self.policy_version, i)], top_token_ids=top_ids[i:i + 1],
                                    top_logprobs=top_lps[i:i + 1], routed_experts=routes))
                entry[2] = i + 1
                if i + 1 < req.max_tokens:
                    running.append(entry)
                elif not done.done():
                    done.set_result(None)
            self.streams = running
            await asyncio.sleep(0)

    @functools.lru_cache(maxsize=64)
    def _made(self, n: int, k: int) -> tuple:
        """A sample's tokens, log-probs and top-k rows, made once per shape: no engine work is measured."""
        ids = [(7 * i + 11) % 30000 for i in range(n)]
        top_ids = [[t + j for j in range(k)] for t in ids] if k else []
        return ids, [-0.5] * n, top_ids, [[-0.5 - j for j in range(k)] for _ in ids] if k else []

    def _routes(self, first: int, rows: int) -> Routes:
        m = self.moe
        return Routes(first_row=first, rows=rows, layers=m.num_layers, top_k=m.top_k, dtype="uint8",
                      data=bytes(rows * m.num_layers * m.top_k), version_spans=[(self.policy_version, first)])

    async def shutdown(self) -> None:
        self.state = EngineState.STOPPED

    async def pause(self, mode: str) -> None:
        self.state = EngineState.PAUSED

    async def resume(self) -> None:
        self.state = EngineState.READY

    async def load_weights(self, path: str, target: str) -> None:
        pass

    async def prepare_weights(self, paths: list[str], target: str) -> bool:
        return False

    async def swap_weights(self, target: str) -> None:
        pass

    async def discard_weights(self) -> None:
        pass

    async def set_versions(self, policy_version: int, draft_version: int) -> None:
        self.policy_version, self.draft_version = policy_version, draft_version


def serve_instant(args) -> None:
    """This process as the service, its engines InstantEngines (the --serve-instant child)."""
    os.sched_setaffinity(0, {SERVER_CORE})
    from rollout_service.config import load_config
    from rollout_service.model_info import ModelInfo
    from rollout_service.server.app import serve

    moe = ModelInfo.load(args.model, 2048).moe
    cfg = load_config(None, **{"grpc_port": args.port, "http_port": args.http_port, "engines": args.engines,
                               "max_queue": 100000, "engine.model": args.model})
    if args.profile_out:                 # the measured window only: SIGUSR1 starts the profile, SIGUSR2 writes it
        import cProfile
        import signal

        prof = cProfile.Profile()
        signal.signal(signal.SIGUSR1, lambda *_: prof.enable())
        signal.signal(signal.SIGUSR2, lambda *_: (prof.disable(), prof.dump_stats(args.profile_out)))
    asyncio.run(serve(cfg, args.model, factory=lambda engine_id: InstantEngine(engine_id, moe)))


class Server:
    """A --serve-instant child process (optionally under cProfile)."""

    def __init__(self, model: str, engines: int, log: Path, profile: Path | None = None, code: Path | None = None):
        from rollout_client.launcher import free_port

        self.port, self.http_port = free_port(), free_port()
        self.cmd = [sys.executable, str(Path(__file__).resolve()), "--serve-instant", "--model", model, "--engines",
                    str(engines), "--port", str(self.port), "--http-port", str(self.http_port),
                    *(["--profile-out", str(profile)] if profile else [])]
        self.profile, self.code = profile, code
        self.log, self.proc = log, None

    def start(self, timeout: float = 120) -> "Server":
        import httpx

        self.proc = subprocess.Popen(self.cmd, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONPATH": str(ROOT),
                                          **({"FRONTEND_CEILING_CODE": str(self.code)} if self.code else {})})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the instant server exited ({self.proc.returncode}); see {self.log}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.http_port}/readyz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the instant server did not get ready in {timeout} s; see {self.log}")

    def cpu_s(self) -> float:
        """utime + stime of the server process so far (all its threads)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def profiling(self, on: bool) -> None:
        """Start (on) or stop and write this server's profile, if it has one."""
        if self.profile:
            self.proc.send_signal(signal.SIGUSR1 if on else signal.SIGUSR2)
            if not on:
                time.sleep(1.0)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# ---- clients: one request of each arm, returning (tokens, messages) --------------------------------------------
def grpc_request(arm: str, prompts: list[list[int]], n: int, tokens: int):
    from rollout_service.api import pb

    return pb.GenerateRequest(
        prompts=[pb.Prompt(token_ids=p) for p in prompts], n=n,
        sampling=pb.SamplingParams(max_tokens=tokens, ignore_eos=True),
        stream_tokens=arm == "grpc_stream", top_logprobs=5 if arm == "grpc_top5" else 0,
        return_routed_experts=arm == "grpc_routes")


async def grpc_call(stub, req) -> tuple[int, int]:
    toks = msgs = 0
    async for s in stub.Generate(req):
        msgs += 1
        if not s.delta:
            toks += len(s.token_ids)
    return toks, msgs


def http_body(arm: str, prompts: list[list[int]], n: int, tokens: int) -> tuple[str, dict]:
    if arm.startswith("vllm"):
        return "/v1/completions", {"model": "policy", "prompt": prompts, "n": n, "max_tokens": tokens,
                                   "ignore_eos": True, "logprobs": 5 if arm == "vllm_top5" else 0,
                                   "stream": arm == "vllm_stream"}
    return "/generate", {"input_ids": prompts, "return_logprob": True, "top_logprobs_num": 5 if arm == "sglang_top5"
                         else 0, "sampling_params": {"max_new_tokens": tokens, "n": n, "ignore_eos": True}}


async def http_call(client, url: str, body: dict) -> tuple[int, int]:
    if body.get("stream"):
        toks = msgs = 0
        async with client.stream("POST", url, json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    msgs += 1
                    toks += sum(len(c.get("token_ids") or [0]) for c in json.loads(line[6:])["choices"])
        return toks, msgs
    r = await client.post(url, json=body)
    r.raise_for_status()
    out = r.json()
    if "usage" in out:
        return out["usage"]["completion_tokens"], 1
    outs = out if isinstance(out, list) else [out]
    return sum(len(o["output_ids"]) for o in outs), 1


async def drive(arm: str, server: Server, args) -> dict:
    """Keep --concurrency requests of this arm in flight for --seconds; tokens/s, messages/s, server CPU."""
    prompts = [[(101 * p + i) % 30000 + 1 for i in range(args.prompt_len)] for p in range(args.prompts)]
    if arm in GRPC_ARMS:
        import grpc

        from rollout_service.api import pb_grpc

        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=[
            ("grpc.max_receive_message_length", 256 << 20)])
        stub = pb_grpc.RolloutServiceStub(channel)
        req = grpc_request(arm, prompts, args.n, args.tokens)
        call = lambda: grpc_call(stub, req)  # noqa: E731
        close = channel.close
    else:
        import httpx

        client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}", timeout=120)
        url, body = http_body(arm, prompts, args.n, args.tokens)
        call = lambda: http_call(client, url, body)  # noqa: E731
        close = client.aclose
    await call()                                     # warm: connections, the first request's paths
    totals = {"tokens": 0, "messages": 0, "requests": 0}
    stop_at = time.monotonic() + args.seconds

    async def loop():
        while time.monotonic() < stop_at:
            t, m = await call()
            totals["tokens"] += t
            totals["messages"] += m
            totals["requests"] += 1

    server.profiling(True)
    cpu0, t0 = server.cpu_s(), time.monotonic()
    await asyncio.gather(*(loop() for _ in range(args.concurrency)))
    wall, cpu = time.monotonic() - t0, server.cpu_s() - cpu0
    server.profiling(False)
    await close()
    toks = totals["tokens"]
    return {"tok_s": round(toks / wall), "msg_s": round(totals["messages"] / wall), "requests": totals["requests"],
            "tokens": toks, "wall_s": round(wall, 2), "server_cpu_s": round(cpu, 2),
            "cpu_s_per_mtok": round(cpu / toks * 1e6, 3) if toks else None,
            "server_busy": round(cpu / wall, 3)}


def baseline_code(rev: str) -> Path:
    """The service's package as of git revision `rev`, unpacked beside the logs (for --baseline)."""
    out = Path(f"/tmp/frontend_ceiling-{rev}")
    if not (out / "rollout_service").is_dir():
        out.mkdir(parents=True, exist_ok=True)
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "rollout_service"], check=True,
                             capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(out)], input=tar, check=True)
    return out


def run_arms(args) -> dict:
    """Every arm against the current code (and --baseline's) in rounds with a rotated order."""
    from rollout_service.cli import resolve_model
    from rollout_service.moe_model import MOE_MODEL_NAME

    os.sched_setaffinity(0, {CLIENT_CORE})
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; choose from {','.join(ARMS)}")
    if args.profile and args.profile not in arms:
        raise SystemExit(f"--profile {args.profile}: not among --arms")
    variants = {"current": None, **({"baseline": baseline_code(args.baseline)} if args.baseline else {})}
    if args.baseline_first:            # start its servers first (a process started earlier can run slower here)
        variants = dict(reversed(list(variants.items())))
    profile = Path(args.profile_out or logs / "server.prof") if args.profile else None
    dense, moe = resolve_model(args.model), resolve_model(MOE_MODEL_NAME)

    def key(arm: str, variant: str) -> str:
        if args.profile == arm and variant == "current":
            return f"profile-{arm}"
        return f"{variant}-{'moe' if arm == 'grpc_routes' else 'dense'}"

    servers: dict[str, Server] = {}
    runs = [(a, v) for a in arms for v in variants]
    try:
        for arm, variant in runs:
            k = key(arm, variant)
            if k not in servers:
                servers[k] = Server(moe if arm == "grpc_routes" else dense, args.engines, logs / f"{k}.log",
                                    profile if k.startswith("profile") else None, variants[variant]).start()
        rows = []
        for r in range(args.rounds):
            row: dict = {a: {} for a in arms}
            for arm, variant in rotate(runs, r):
                time.sleep(0.5)
                x = row[arm][variant] = asyncio.run(drive(arm, servers[key(arm, variant)], args))
                print(f"round {r} {arm:>12} {variant:>8}: {x['tok_s']:>10,} tok/s  {x['msg_s']:>8,} msg/s  "
                      f"{x['cpu_s_per_mtok']:>7} CPU s/M tokens  server busy {x['server_busy']:.2f}", flush=True)
            rows.append(row)
    finally:
        for srv in servers.values():
            srv.stop()
    summary: dict = {}
    for a in arms:
        summary[a] = {v: {"tok_s": spread([row[a][v]["tok_s"] for row in rows], 0),
                          "cpu_s_per_mtok": spread([row[a][v]["cpu_s_per_mtok"] for row in rows], 3),
                          "msg_s": spread([row[a][v]["msg_s"] for row in rows], 0)} for v in variants}
        if args.baseline:      # per round: the baseline's CPU per token over the current code's (> 1: now cheaper)
            summary[a]["cpu_ratio_baseline_over_current"] = spread(
                [row[a]["baseline"]["cpu_s_per_mtok"] / row[a]["current"]["cpu_s_per_mtok"] for row in rows], 3)
    if args.profile:
        summary[args.profile]["profiled"] = True     # its current figures carry cProfile's overhead
        if profile.is_file():
            summary["profile"] = {"arm": args.profile, "top": top_functions(profile, 25)}
    return {"summary": summary, "rounds": rows}


def vllm_output(args, flat: bool, k: int, stream: bool) -> dict:
    """vLLM's output path in this process, at its fastest: each engine step's EngineCoreOutputs (one new token per
    sequence, with the sampled token's log-prob and the top k) as the engine core sends them (msgpack), decoded, through
    vLLM's OutputProcessor into each request's collector, then what VllmEngine.generate does with a RequestOutput
    (engine/vllm_engine.py: a delta per step when streamed, the SeqResult at the end). CPU time of this thread only."""
    import numpy as np
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
    from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector
    from vllm.v1.outputs import LogprobsLists
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from rollout_service.engine import vllm_engine as ve

    seqs, steps = args.prompts * args.n, args.tokens
    kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    op = OutputProcessor(None, log_stats=False)
    queues = {}
    for i in range(seqs):
        rid = f"s{i}"
        params = SamplingParams(max_tokens=steps, logprobs=k, detokenize=False, flat_logprobs=flat, output_kind=kind,
                                ignore_eos=True)
        queues[rid] = RequestOutputCollector(kind, rid)
        op.add_request(EngineCoreRequest(rid, list(range(1, args.prompt_len + 1)), None, params, None, 0.0, None,
                                         None, None, external_req_id=rid), None, queue=queues[rid])
    enc, dec = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    ids = np.arange(k + 1, dtype=np.int32)[None, :] + 11
    lps = -np.arange(1, k + 2, dtype=np.float32)[None, :]
    wire = [enc.encode(EngineCoreOutputs(outputs=[
        EngineCoreOutput(rid, [11], LogprobsLists(ids, lps, np.array([1], dtype=np.int32)),
                         finish_reason=FinishReason.LENGTH if t == steps - 1 else None) for rid in queues]))
        for t in range(steps)]
    parts = {rid: ve._Parts() for rid in queues}
    results = 0
    cpu0, t0 = time.process_time(), time.perf_counter()
    for t in range(steps):
        outs = dec.decode(wire[t])
        op.process_outputs(outs.outputs)
        for rid, q in queues.items():
            out = q.get_nowait()
            if out is None:
                continue
            comp = out.outputs[0]
            if stream:
                start = parts[rid].add(comp, k)
                if not out.finished:
                    parts[rid].delta(start, [(0, start)])
                else:
                    parts[rid].result(comp, 0, 0)
                    results += 1
            else:
                ve._to_result(comp, 0, 0, k)
                results += 1
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    toks = seqs * steps
    assert results == seqs, f"{results} of {seqs} sequences finished"
    return {"tok_s": round(toks / wall), "cpu_s_per_mtok": round(cpu / toks * 1e6, 3), "tokens": toks}


def run_vllm_output(args) -> dict:
    """--vllm-output: vLLM's output path with vLLM's dict log-probs and with its flat ones (what the engine asks for
    now), unstreamed and streamed, without and with the top 5, in rounds."""
    os.sched_setaffinity(0, {CLIENT_CORE})
    cases = [(flat, k, stream) for stream in (False, True) for k in (0, 5) for flat in (False, True)]
    rows = []
    for r in range(args.rounds):
        row = {}
        for flat, k, stream in rotate(cases, r):
            name = f"{'stream' if stream else 'final'}_top{k}_{'flat' if flat else 'dict'}"
            row[name] = x = vllm_output(args, flat, k, stream)
            print(f"round {r} vLLM output path {name:>18}: {x['tok_s']:>9,} tok/s  {x['cpu_s_per_mtok']:>7} CPU s/M "
                  "tokens", flush=True)
        rows.append(row)
    summary = {name: {"tok_s": spread([row[name]["tok_s"] for row in rows], 0),
                      "cpu_s_per_mtok": spread([row[name]["cpu_s_per_mtok"] for row in rows], 3)} for name in rows[0]}
    for name in rows[0]:
        if name.endswith("_flat"):
            dict_name = name[:-len("flat")] + "dict"
            summary[name]["cpu_ratio_dict_over_flat"] = spread(
                [row[dict_name]["cpu_s_per_mtok"] / row[name]["cpu_s_per_mtok"] for row in rows], 3)
    return {"summary": summary, "rounds": rows}


class HopActor:
    """A Ray actor shaped like ray_engine.EngineActor.generate: a msgpack SeqRequest in, a SeqResult out, at once."""

    def __init__(self, result: bytes):
        self.result = result

    async def generate(self, req: bytes) -> bytes:
        return self.result


def _ray_hop_rounds(args, ray) -> list[dict]:
    """--ray-hop's rounds on a connected Ray: --concurrency x --prompts x --n callers for --seconds each (after a
    second of one caller, not counted)."""
    import msgspec

    n = args.tokens
    result = msgspec.msgpack.encode(SeqResult(token_ids=[(7 * i + 11) % 30000 for i in range(n)],
                                              logprobs=[-0.5] * n, finish_reason="length", version_spans=[(0, 0)]))
    actor = ray.remote(HopActor).options(max_concurrency=1000).remote(result)
    req = msgspec.msgpack.encode(SeqRequest(seq_id="s", prompt_token_ids=list(range(args.prompt_len)), max_tokens=n))

    async def window() -> dict:
        calls = 0

        async def loop(stop_at: float):
            nonlocal calls
            while time.monotonic() < stop_at:
                msgspec.msgpack.decode(await actor.generate.remote(req), type=SeqResult)
                calls += 1
        await loop(time.monotonic() + 1.0)                 # warm: the actor, the connection
        calls = 0
        stop_at = time.monotonic() + args.seconds
        cpu0, t0 = time.process_time(), time.monotonic()
        await asyncio.gather(*(loop(stop_at) for _ in range(args.concurrency * args.prompts * args.n)))
        cpu, wall = time.process_time() - cpu0, time.monotonic() - t0
        return {"calls_s": round(calls / wall), "tok_s": round(calls * n / wall),
                "cpu_ms_per_sample": round(cpu / calls * 1e3, 4), "cpu_s_per_mtok": round(cpu / (calls * n) * 1e6, 3)}

    rows = []
    for r in range(args.rounds):
        rows.append(x := asyncio.run(window()))
        print(f"round {r} Ray hop: {x['calls_s']:,} samples/s, {x['cpu_ms_per_sample']} CPU ms a sample = "
              f"{x['cpu_s_per_mtok']} CPU s/M tokens at {n} tokens a sample", flush=True)
    return rows


def ray_hop(args) -> dict:
    """--ray-hop: what a sample costs the front end when its engine is a Ray actor (engine/ray_engine.py): the call,
    its answer through Ray, the SeqResult's msgpack decode; --concurrency x --prompts x --n calls in flight, for
    --seconds per round. CPU time of this process (the front end's side); Ray's own processes are not counted."""
    import ray

    from tests.ray_cluster import LocalRayCluster

    os.sched_setaffinity(0, {CLIENT_CORE})
    # a throwaway `ray start` cluster, as the tests use: ray.init() starting its own would also write
    # ~/.ray/auth_token, which turns token authentication on for every later cluster of this user (test_ray failed)
    with LocalRayCluster(num_cpus=1) as cluster:
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        try:
            rows = _ray_hop_rounds(args, ray)
        finally:
            ray.shutdown()
    summary = {k: spread([row[k] for row in rows], 4) for k in rows[0]}
    return {"summary": summary, "rounds": rows}


RACK_GPUS = 72          # a GB200 NVL72 rack
# policy -> (its EAGLE-3 head, GPUs per engine, the engine's layout): docs/projections.md's layouts
RACK_POLICIES = {"qwen3-8b": ("qwen3-8b-eagle3", 1, ["--tp", "1"]),
                 "qwen3-30b-a3b": ("qwen3-30b-a3b-eagle3", 8, ["--tp", "1", "--ep", "8"])}


def rack_rate(policy: str, drafter: str, gpus: int, layout: list[str], concurrency: int, acceptance: float) -> dict:
    """A GB200 NVL72 rack's decode rate by the performance model (`rollout-service simulate`): every engine of `gpus`
    GPUs at `concurrency` sequences per GPU, speculation at its best k."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sim.json"
        subprocess.run([sys.executable, "-m", "rollout_service.cli", "simulate", "--hardware", "gb200",
                        "--policy-config", policy, "--drafter-config", drafter, "--acceptance", str(acceptance),
                        "--concurrency", str(concurrency * gpus), "--prompts", "64", "--group", "16", *layout,
                        "--json", str(out)], check=True, capture_output=True, cwd=ROOT)
        sim = json.loads(out.read_text())
    row = sim["by_concurrency"][0]
    engines = RACK_GPUS // gpus
    return {"engines": engines, "gpus_per_engine": gpus, "sequences_per_gpu": concurrency,
            "plain_tok_s_per_engine": round(row["plain_tok_s"]), "best_k": row["best_k"],
            "speedup": row["best_speedup"],
            "rack_tok_s": round(engines * row["plain_tok_s"] * row["best_speedup"])}


def projection(ceiling: dict, output_path: dict, concurrency: int, acceptance: float, hop: dict | None) -> dict:
    """Front-end processes a GB200 NVL72 rack needs, per request shape: the rack's decode rate (performance model)
    times the CPU seconds a million tokens cost (this run's medians): the service's own (the instant-engine arms), plus
    vLLM's output path where the engines' AsyncLLM lives in the front end's process (embedded engines; a Ray engine
    runs it in its actor; `hop`: --ray-hop's summary, a sample's Ray call, added to the Ray column when measured).
    One process is one core at most (Python), assumed as fast as this machine's."""
    own = {a: v["current"]["cpu_s_per_mtok"]["median"] for a, v in ceiling.items() if isinstance(v, dict)
           and "current" in v}
    vllm_path = {"final": output_path["final_top0_flat"]["cpu_s_per_mtok"]["median"],
                 "final_top5": output_path["final_top5_flat"]["cpu_s_per_mtok"]["median"],
                 "stream": output_path["stream_top0_flat"]["cpu_s_per_mtok"]["median"]}
    path_of = {"grpc": "final", "grpc_top5": "final_top5", "grpc_stream": "stream", "grpc_routes": "final",
               "vllm": "final", "vllm_top5": "final_top5", "vllm_stream": "stream", "sglang": "final",
               "sglang_top5": "final_top5"}
    out = {}
    for policy, (drafter, gpus, layout) in RACK_POLICIES.items():
        rack = rack_rate(policy, drafter, gpus, layout, concurrency, acceptance)
        mtok_s = rack["rack_tok_s"] / 1e6
        shapes = {}
        for arm, cpu in own.items():
            embedded = cpu + vllm_path[path_of[arm]]
            ray = cpu + (hop["cpu_s_per_mtok"]["median"] if hop else 0.0)
            shapes[arm] = {"ray_engines": round(mtok_s * ray, 2), "embedded_engines": round(mtok_s * embedded, 2)}
        out[policy] = {**rack, "processes": shapes}
        print(f"{policy} on a GB200 NVL72 rack: {rack['engines']} engines x {rack['plain_tok_s_per_engine']:,} tok/s "
              f"plain x {rack['speedup']:.2f} (k={rack['best_k']}) at {concurrency} sequences per GPU = "
              f"{rack['rack_tok_s'] / 1e6:.2f} M tok/s; front-end cores (processes) needed:")
        for arm, x in shapes.items():
            print(f"  {arm:>12}: {x['ray_engines']:6.2f} with Ray engines, {x['embedded_engines']:6.2f} with engines "
                  "in the front end's process")
    return out


def top_functions(path: Path, count: int) -> list[dict]:
    """The functions with the most own time in a cProfile file, printed and returned."""
    import pstats

    st = pstats.Stats(str(path))
    total = sum(v[2] for v in st.stats.values())
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:count]
    out = []
    print(f"cProfile of the server, {total:.2f} s of own time in all; most own time:")
    for (file, line, fn), (_, calls, tt, ct, _) in rows:
        where = f"{Path(file).name}:{line}({fn})"
        out.append({"function": where, "calls": calls, "own_s": round(tt, 3), "share": round(tt / total, 4)})
        print(f"  {tt / total:6.1%} {tt:8.3f} s {calls:>9} calls  {where}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=6.0, help="each arm's window per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16, help="prompts per request")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--tokens", type=int, default=256, help="tokens per sample")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--engines", type=int, default=1, help="instant engines in the pool")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--model", default=None, help="the served model (tokenizer, shape); default: the embedded one")
    p.add_argument("--profile", default="", help="run this arm's server under cProfile")
    p.add_argument("--baseline", default="", help="a git revision: run every arm against its code too (ratios)")
    p.add_argument("--baseline-first", action="store_true", help="start the baseline's servers before the current's")
    p.add_argument("--profile-out", default="", help="where the profile goes (default: beside the logs)")
    p.add_argument("--logs", default="/tmp/frontend_ceiling")
    p.add_argument("--out", default=None)
    p.add_argument("--vllm-output", action="store_true", help="measure vLLM's output path in this process instead")
    p.add_argument("--ray-hop", action="store_true", help="measure a sample's Ray call from an engine actor instead")
    p.add_argument("--project", action="store_true", help="only the GB200 NVL72 rack projection, from the results")
    p.add_argument("--rack-concurrency", type=int, default=256, help="sequences per GPU in the projection")
    p.add_argument("--acceptance", type=float, default=0.62, help="EAGLE-3 acceptance per position (projection)")
    p.add_argument("--serve-instant", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--http-port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_instant:
        serve_instant(args)
        return
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs 2 cores: the server on one, the client on the other")
    if args.project:
        project_only(args)
        return
    result = (run_vllm_output(args) if args.vllm_output else ray_hop(args) if args.ray_hop else run_arms(args))
    config = {k: getattr(args, k) for k in ("seconds", "rounds", "prompts", "n", "tokens", "prompt_len",
                                            "concurrency", "engines", "arms", "baseline")}
    name = ("frontend_ceiling_vllm_output" if args.vllm_output else "frontend_ceiling_ray_hop" if args.ray_hop
            else "frontend_ceiling")
    path = write_result(name, config, result["summary"], result["rounds"], out=args.out)
    print(f"wrote {path}")
    if name == "frontend_ceiling" and (RESULTS / "frontend_ceiling_vllm_output.json").is_file():
        project_only(args)


def project_only(args) -> None:
    """--project: the rack projection again from the current results files (no run); written into the ceiling's."""
    files = [Path(args.out or RESULTS / "frontend_ceiling.json"), RESULTS / "frontend_ceiling_vllm_output.json"]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise SystemExit(f"--project needs {' and '.join(missing)}: run this script without --project first (and "
                         "with --vllm-output)")
    ceiling = json.loads(files[0].read_text())
    hop = RESULTS / "frontend_ceiling_ray_hop.json"
    ceiling["projection"] = projection(ceiling["summary"], json.loads(files[1].read_text())["summary"],
                                       args.rack_concurrency, args.acceptance,
                                       json.loads(hop.read_text())["summary"] if hop.is_file() else None)
    files[0].write_text(json.dumps(ceiling, indent=1) + "\n")
    print(f"wrote the projection into {files[0]}")


if __name__ == "__main__":
    main()
