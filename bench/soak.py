"""Hours of RL-shaped traffic and faults on real services: memory, descriptors, threads, latency, and every sample
checked (issue 58; not a test).

    .venv/bin/python bench/soak.py [--minutes 120] [--engines 1] [--sample-s 60] [--step-s 20] [--warmup 0.1]
                                   [--no-faults] [--out bench/results/soak.json] [--plot bench/results/soak.png]
    .venv/bin/python bench/soak.py --minutes 5 --out /tmp/soak.json --plot /tmp/soak.png     # a smoke run

Two services, each a real `rollout-service serve` process (bench/harness.py's ServiceProcess) on the tests' tiny
models (tests/tiny_models.py, built in seconds, float32):
- `policy`: the tiny Llama with a draft model (a noisy copy of it, `--speculation draft_model`, k chosen per step),
  LoRA on (two tenants, each with its own token and adapter: security.tenants), `--state-dir`, `--max-sessions 32`
  (so the session table's bound is reached), `--engines` engines;
- `moe`: the tiny Qwen3-MoE, routes captured (return_routed_experts).

Traffic, all at once in threads (sync clients), light enough for 2 cores:
- trainer: a GRPO-like loop, one step every --step-s: sync steps (a batch of 4 prompts x n 4, min_policy_version =
  the last commit, then a push in `wait` mode: every sample must carry exactly that version) alternate with async
  steps (the batch generates while the push commits in `keep` mode: spans of the old then the new version). The
  pushes cycle full, delta, delta, partial (rollout_client.delta.WeightDeltas: a delta after a push it did not make
  is refused and sent full, as a trainer's would be; partial: one decoder layer, PushHeader.partial); every third
  step a drafter update (UpdateDraft). After each commit the server's fingerprint must equal the trainer's tensors'.
- streams: streamed requests (stream_tokens; the deltas must join into the whole sample) and top-k log-prob requests
  (each token's log-prob must equal its entry in the top-k rows);
- sessions: conversations of 3 turns with a session_id each (a new key per conversation);
- tenants: two LoRA tenants sampling their adapter and pushing a new version of it every --tenant-push-s;
- moe: requests with routes (their rows: prompt + generated - 1, version spans of committed versions), a push of
  some experts and the routers (partial, `keep`) every --moe-push-s;
- probe: one small request every 2 s (its latency is the p99 drift series).
Every request has a request_id and is retried under it on a retriable status (UNAVAILABLE, RESOURCE_EXHAUSTED,
ABORTED, DEADLINE_EXCEEDED) for up to --retry-s; anything else, or a request that never completes, is lost.

Faults on a schedule (fractions of the run; each recorded with its recovery time): a front-end SIGKILL and restart
on its state_dir on the same ports (it must come back at the last committed policy, drafter and adapter versions and
fingerprints), an engine process killed (the supervisor must restart it at the committed versions), a trainer
killed mid-push (a subprocess that sends half a push and is SIGKILLed: nothing may change), a client that
disconnects mid-stream (then the same request_id must run again to its end).

Every --sample-s a row: RSS of each front end and its engines (the process tree, psutil), the front ends' open fds
and threads, bytes in the staging folder (/dev/shm/rollout-service-<pid>) and the state_dir, GetStatus's tables
(sessions, adapters and their loaded versions, queue depth, restarts), p50/p99 of the interval's requests and
probes, commits, faults. Every sample's versions are checked at the end against the versions committed (a push
answered OK, or seen in GetStatus). Summary: duration_s, rss_growth (after --warmup: the last window's median over
the first window's, within the last process of each role), fd and thread growth, p99 drift of the probe outside
fault windows, lost and mislabelled samples, commits, faults injected and recovered, and the issue's goals each met
or not. Results: bench/results/soak.json (bench/harness.py's schema; rounds: the rows); --plot draws the series.

Measured 2026-12-07, `--minutes 15` (now in soak.json's history; the later runs: docs/reliability.md): 4,940 requests,
11,084 samples, 114 commits, 8 faults, all recovered; none lost, mislabelled or wrong; fds and threads flat, probe p99
drift +4.5%; RSS growth missed (front ends +11% and +8%). Found and fixed: an engine that died during a commit left the
pool serving nothing for good (the commit waited for an answer vLLM never sends, holding the push lock the restart
needs; engine/base.py unless_dead), and each engine restart left the front end ~40 MB larger (glibc kept the freed heap;
VllmEngine.shutdown now collects and trims).
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from harness import logs_dir, progress, write_result

RETRIABLE = frozenset({"UNAVAILABLE", "RESOURCE_EXHAUSTED", "ABORTED", "DEADLINE_EXCEEDED"})
GOALS = {"rss_growth_max": 0.05, "p99_drift_max": 0.10, "fds_slack": 4, "threads_slack": 2}
PROBE = [1, 504, 3458, 314, 260, 9]
SERVICE_ARGS = ["--max-model-len", "512", "--kv-cache-gb", "0.25", "--dtype", "float32", "--max-num-seqs", "32",
                "--max-queue", "512"]


# ---- pure checks and summaries (tests/unit/test_soak.py) -------------------------------------------------------------
def classify(code: str) -> str:
    """A gRPC status code's name -> "ok", "retriable" (the contract says retry: the server restarting, an engine
    dying, the queue full, a commit aborting the request) or "fatal" (a wrong answer or a refusal of a valid
    request: the request is lost)."""
    if code == "OK":
        return "ok"
    return "retriable" if code in RETRIABLE else "fatal"


def span_problems(spans, n_tokens: int, committed, *, single: bool = False) -> list[str]:
    """What is wrong with a whole sample's version_spans [(version, first_token)]: empty while tokens were generated,
    not starting at token 0, first tokens not increasing or past the end, versions going back, a version never
    committed (`committed`: a set, or None to skip that check), or more than one span where one is due (`single`:
    an adapter's sample runs on one version)."""
    out = []
    spans = [(int(v), int(t)) for v, t in spans]
    if not spans:
        return ["no version spans"] if n_tokens else []
    if spans[0][1] != 0:
        out.append(f"first span starts at token {spans[0][1]}")
    for (v0, t0), (v1, t1) in zip(spans, spans[1:]):
        if t1 <= t0:
            out.append(f"span first tokens not increasing: {spans}")
        if v1 < v0:
            out.append(f"versions go back: {spans}")
    if spans[-1][1] >= max(n_tokens, 1) and len(spans) > 1:
        out.append(f"a span starts past the sample's {n_tokens} tokens: {spans}")
    if single and len(spans) > 1:
        out.append(f"several versions in a sample that runs on one: {spans}")
    if committed is not None:
        out += [f"version {v} was never committed" for v in sorted({v for v, _ in spans} - set(committed))]
    return out


def uncommitted(labels: dict, committed: dict) -> dict:
    """labels: (service, line, versions) -> samples that carried them; committed: (service, line) -> versions.
    Returns the labels naming a version not committed on their line, with their counts (version 0, what a service
    starts with, is committed on every line)."""
    return {k: n for k, n in labels.items() if set(k[2]) - {0} - set(committed.get(k[:2], ()))}


def stream_problems(deltas: list[tuple[int, list[int]]], final_tokens: list[int]) -> list[str]:
    """Token deltas [(delta_start, token_ids)] of one sample against its whole sample: each delta starts where the
    ones before ended and together they are a prefix of the whole sample (the last message may hold tokens no delta
    carried)."""
    joined: list[int] = []
    for start, toks in deltas:
        if start != len(joined):
            return [f"a delta starts at {start} after {len(joined)} tokens"]
        joined += list(toks)
    if joined != list(final_tokens[:len(joined)]):
        return ["the deltas differ from the whole sample"]
    return []


def topk_problems(token_ids, logprobs, top_ids, top_lps, k: int, atol: float = 1e-3) -> list[str]:
    """Top-k rows [len, k] against the sampled tokens: the shape, rows most likely first, and a sampled token found
    in its row carrying the same log-prob there."""
    n = len(token_ids)
    if n == 0:
        return []
    if top_ids is None or top_lps is None or len(top_ids) != n or any(len(r) != k for r in top_ids):
        return [f"top-k rows missing or not [{n}, {k}]"]
    out = []
    for i, (t, lp, ids, lps) in enumerate(zip(token_ids, logprobs, top_ids, top_lps)):
        if any(b > a + atol for a, b in zip(lps, lps[1:]) if math.isfinite(b)):
            out.append(f"token {i}: top-k not most likely first")
        ids = list(ids)
        if t in ids and abs(float(lps[ids.index(t)]) - float(lp)) > atol:
            out.append(f"token {i}: log-prob {lp:.5f} but {float(lps[ids.index(t)]):.5f} in its top-k row")
        if float(lp) > float(lps[0]) + atol:
            out.append(f"token {i}: log-prob {lp:.5f} above the top-1's {float(lps[0]):.5f}")
    return out[:3]


def percentile(xs, q: float) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def windows(n: int, warmup: float, window: float) -> tuple[range, range]:
    """(first, last) windows of row indices after the first `warmup` share of n rows, each `window` of the rows
    after it (at least one row)."""
    start = min(n - 1, int(math.ceil(warmup * n))) if n else 0
    w = max(1, int(round(window * (n - start))))
    return range(start, min(n, start + w)), range(max(start, n - w), n)


def growth(values, warmup: float = 0.1, window: float = 0.1) -> float | None:
    """The last window's median over the first window's, minus 1, after warm-up (None: no data)."""
    first, last = windows(len(values), warmup, window)
    a = [values[i] for i in first if values[i] is not None]
    b = [values[i] for i in last if values[i] is not None]
    if not a or not b or statistics.median(a) == 0:
        return None
    return statistics.median(b) / statistics.median(a) - 1


def last_segment(rows: list[dict], key: str, pid_key: str, start: int = 0) -> list:
    """rows[i][key] over the last run of rows from `start` on with the same rows[i][pid_key] (one process's life:
    growth across a restart would compare two processes)."""
    seg: list = []
    pid = object()
    for r in rows[start:]:
        if r.get(pid_key) != pid:
            seg, pid = [], r.get(pid_key)
        seg.append(r.get(key))
    return seg


def role_growth(rows: list[dict], key: str, pid_key: str, warmup: float, window: float = 0.1) -> dict:
    """Growth of `key` over the last process of its role after warm-up: {growth, rows (its length), of (rows after
    warm-up), first, last (window medians)}."""
    start = int(math.ceil(warmup * len(rows)))
    seg = last_segment(rows, key, pid_key, start)
    first, last = windows(len(seg), 0.0, window)
    med = lambda idx: statistics.median([seg[i] for i in idx if seg[i] is not None] or [0])   # noqa: E731
    g = growth(seg, 0.0, window)
    return {"growth": None if g is None else round(g, 4), "rows": len(seg), "of": len(rows) - start,
            "first": round(med(first), 2) if seg else None, "last": round(med(last), 2) if seg else None}


def flat(info: dict, slack: float) -> bool | None:
    """Flat: the last window's median at most `slack` above the first's (and 2% of it)."""
    if info["first"] is None:
        return None
    return info["last"] <= info["first"] + max(slack, 0.02 * info["first"])


def p99_drift(rows: list[dict], warmup: float, window: float = 0.1, key: str = "probe_s") -> dict:
    """The probe's p99 in the last window over the first window's, minus 1, after warm-up; rows with a fault in
    them (row["fault"]) left out (a restart's stall is not drift)."""
    quiet = [r for i, r in enumerate(rows) if i >= math.ceil(warmup * len(rows)) and not r.get("fault")]
    first, last = windows(len(quiet), 0.0, window)
    a = [x for i in first for x in quiet[i].get(key, [])]
    b = [x for i in last for x in quiet[i].get(key, [])]
    pa, pb = percentile(a, 0.99), percentile(b, 0.99)
    return {"drift": round(pb / pa - 1, 4) if pa and pb else None, "first_p99_s": pa, "last_p99_s": pb,
            "first_n": len(a), "last_n": len(b), "quiet_rows": len(quiet)}


def fault_schedule(duration_s: float, *, frontend=(0.05,), engine=((0.35, "policy"), (0.6, "moe")),
                   trainer=(0.3, 15.0), disconnect=(0.1, 3.0), floor_s: float = 75.0, end: float = 0.9) -> list:
    """[(t_s, kind, service)] sorted: the front-end restarts at these fractions of the run (not before floor_s, when
    the first commits are in), engine kills at theirs, a trainer killed mid-push and a client disconnecting from the
    first fraction on every so many minutes; nothing after `end` of the run (its last window stays quiet)."""
    out = [(max(f * duration_s, floor_s), "frontend_restart", "policy") for f in frontend]
    out += [(max(f * duration_s, floor_s), "engine_kill", svc) for f, svc in engine]
    for kind, (first, every_min) in (("trainer_kill", trainer), ("disconnect", disconnect)):
        t = first * duration_s
        while t < end * duration_s:
            out.append((t, kind, "policy"))
            t += every_min * 60
    return sorted((t, k, s) for t, k, s in out if t < end * duration_s or k == "frontend_restart")


def summarize(rows: list[dict], totals: dict, faults: list[dict], warmup: float, window: float = 0.1) -> dict:
    """The run's summary and the issue's goals, from the rows, the request/sample counters and the faults."""
    rss, fds, threads = {}, {}, {}
    for svc in sorted({k.split(".")[0] for r in rows for k in r if k.endswith(".fe_rss_mb")}):
        rss[f"{svc}.front_end"] = role_growth(rows, f"{svc}.fe_rss_mb", f"{svc}.fe_pid", warmup, window)
        rss[f"{svc}.engines"] = role_growth(rows, f"{svc}.engines_rss_mb", f"{svc}.engine_pids", warmup, window)
        fds[svc] = role_growth(rows, f"{svc}.fds", f"{svc}.fe_pid", warmup, window)
        threads[svc] = role_growth(rows, f"{svc}.threads", f"{svc}.fe_pid", warmup, window)
    drift = p99_drift(rows, warmup, window)
    worst = max((abs(v["growth"]) for v in rss.values() if v["growth"] is not None), default=None)
    by_kind = collections.Counter(f["kind"] for f in faults)
    recovered = collections.Counter(f["kind"] for f in faults if f.get("recovered"))
    goals = {
        "rss_growth_at_most_5pct": None if worst is None else worst <= GOALS["rss_growth_max"],
        "fds_flat": all(flat(v, GOALS["fds_slack"]) is not False for v in fds.values()),
        "threads_flat": all(flat(v, GOALS["threads_slack"]) is not False for v in threads.values()),
        "p99_drift_at_most_10pct": None if drift["drift"] is None else drift["drift"] <= GOALS["p99_drift_max"],
        "zero_lost_samples": totals.get("lost_samples", 0) == 0,
        "zero_mislabelled_samples": totals.get("mislabelled_samples", 0) == 0,
        "zero_wrong_answers": totals.get("wrong_samples", 0) + totals.get("wrong_weights", 0) == 0,
        "every_fault_recovered": all(recovered[k] == n for k, n in by_kind.items()),
    }
    return {"duration_s": round(rows[-1]["t_s"], 1) if rows else 0.0, "rows": len(rows),
            "rss_growth": {k: v["growth"] for k, v in rss.items()}, "rss_worst_growth": worst, "rss": rss,
            "fds": fds, "threads": threads, "p99_drift": drift["drift"], "probe_p99": drift,
            **{k: totals.get(k, 0) for k in ("requests", "samples", "lost_requests", "lost_samples",
                                             "mislabelled_samples", "wrong_samples", "wrong_weights", "retries",
                                             "commits")},
            "faults_injected": dict(by_kind), "faults_recovered": dict(recovered), "goals": goals,
            "goals_met": all(v is not False for v in goals.values())}


# ---- the run ---------------------------------------------------------------------------------------------------------
class Ledger:
    """Versions committed per (service, line): line "policy", "drafter", "adapter:<name>". A version is committed
    when its push answered OK or GetStatus showed it (a push that failed yet committed is counted apart)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.committed: dict[tuple, set] = collections.defaultdict(lambda: {0})
        self.last: dict[tuple, int] = collections.defaultdict(int)
        self.commits = collections.Counter()

    def commit(self, svc: str, line: str, v: int, how: str = "ok") -> None:
        with self.lock:
            self.committed[(svc, line)].add(v)
            self.last[(svc, line)] = max(self.last[(svc, line)], v)
            self.commits[how] += 1

    def seen(self, svc: str, st) -> None:
        """What GetStatus says is served: committed by definition."""
        with self.lock:
            self.committed[(svc, "policy")].add(st.policy_version)
            self.committed[(svc, "drafter")].add(st.draft_version)
            for a in st.adapters:
                self.committed[(svc, f"adapter:{a.name}")].update(a.loaded_versions)


class Stats:
    """Counters, latencies and the labels every sample carried (checked against the ledger at the end)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.c = collections.Counter()
        self.codes = collections.Counter()
        self.labels = collections.Counter()          # (service, line, versions) -> samples
        self.lat: list[tuple[float, float, str]] = []        # (monotonic end, seconds, kind): successes
        self.problems: list[str] = []
        self.fault_until = 0.0                       # monotonic: latencies before it are a fault's

    def add(self, **kw) -> None:
        with self.lock:
            self.c.update(kw)

    def problem(self, counter: str, n: int, msg: str) -> None:
        with self.lock:
            self.c[counter] += n
            if len(self.problems) < 200:
                self.problems.append(f"{time.strftime('%H:%M:%S')} {counter} {n}: {msg}")
        print(f"[soak] {counter} {n}: {msg}", flush=True)


class Service:
    """A `rollout-service serve` process that can be SIGKILLed and restarted on the same ports, and its clients
    (recreated after a restart: a channel that saw the server gone backs off its reconnects)."""

    # A service is started from this one long-lived thread: it gets SIGTERM when the thread that started it ends
    # (PR_SET_PDEATHSIG follows the thread, rollout_service/launcher.py), and a fault thread ends before the run.
    launcher = None

    def __init__(self, name: str, model: str, args: list[str], log: Path, tokens: dict | None = None):
        from concurrent.futures import ThreadPoolExecutor

        from rollout_client.launcher import ServiceProcess

        if Service.launcher is None:
            Service.launcher = ThreadPoolExecutor(1, thread_name_prefix="launcher")

        self.name, self.model, self.args, self.log, self.tokens = name, model, args, log, tokens or {}
        self.proc = ServiceProcess(model, extra_args=args, log_path=log)
        self.push_lock = threading.RLock()          # one push at a time from this soak (versions stay in order)
        self.gen, self._clients, self._old_clients, self._lock = 0, {}, [], threading.Lock()
        self.ready = threading.Event()

    def start(self) -> None:
        self.launcher.submit(self.proc.start).result()
        self.ready.set()

    def restart(self) -> float:
        """SIGKILL the front end (its engines follow it), start it again on the same ports; seconds to ready."""
        from rollout_client.launcher import ServiceProcess

        import psutil

        self.ready.clear()
        old = self.proc
        children = psutil.Process(old.proc.pid).children(recursive=True)
        old.proc.send_signal(signal.SIGKILL)
        old.proc.wait(60)
        t0 = time.monotonic()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and [p for p in children if p.is_running() and
                                               p.status() != psutil.STATUS_ZOMBIE]:
            time.sleep(0.2)
        orphans = [p.pid for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        new = ServiceProcess(self.model, extra_args=self.args, log_path=self.log)
        new.grpc_port, new.http_port, new.target, new.http = old.grpc_port, old.http_port, old.target, old.http
        self.launcher.submit(new.start).result()
        with self._lock:          # the old clients are closed at the end: a call on one may still be failing over
            self.proc, self.gen = new, self.gen + 1
            self._old_clients += self._clients.values()
            self._clients = {}
        self.ready.set()
        if orphans:
            raise RuntimeError(f"engine processes {orphans} outlived the killed front end")
        return time.monotonic() - t0

    def client(self, who: str = "client"):
        """A RolloutClient with `who`'s token (client, admin or a tenant's) for data and pushes."""
        from rollout_client import RolloutClient

        with self._lock:
            if who not in self._clients:
                tok = self.tokens.get(who)
                admin = self.tokens.get("admin") if who == "client" else tok
                self._clients[who] = RolloutClient(self.proc.target, token=tok, admin_token=admin)
            return self._clients[who]

    def status(self, timeout: float = 10.0):
        return self.client().status(timeout=timeout)

    def status_when_up(self, deadline_s: float = 300.0):
        """GetStatus once the service answers (retrying through a restart)."""
        import grpc

        end = time.monotonic() + deadline_s
        while True:
            self.ready.wait(max(0.0, end - time.monotonic()))
            try:
                return self.status()
            except grpc.RpcError:
                if time.monotonic() > end:
                    raise
                time.sleep(1.0)

    def stop(self) -> None:
        for c in [*self._old_clients, *self._clients.values()]:
            c.close()
        self.proc.stop()


class Soak:
    def __init__(self, args, services: dict, models: dict, tmp: Path):
        self.args, self.svc, self.models, self.tmp = args, services, models, tmp
        self.ledger, self.stats = Ledger(), Stats()
        self.stop = threading.Event()
        self.t0 = time.monotonic()
        self.faults: list[dict] = []
        self.rows: list[dict] = []
        self.rng = random.Random(args.seed)
        self.committed_fp: dict[str, str] = {}      # line -> the fingerprint of what the trainer last committed
        self.vocab = 4000

    # -- requests ------------------------------------------------------------------------------------------------
    def prompts(self, rng: random.Random, k: int) -> list[list[int]]:
        return [[1] + [rng.randrange(100, self.vocab) for _ in range(rng.randint(5, 20))] for _ in range(k)]

    def request(self, svc: Service, kind: str, prompts, *, n: int = 1, who: str = "client", check=None, **kw):
        """One Generate, retried under its request_id on a retriable status for up to --retry-s. Returns the whole
        samples ({(prompt, sample): Sample}) and the deltas, or None when it was lost (counted)."""
        import grpc

        rid = f"{kind}-{uuid.uuid4().hex[:12]}"
        expect = len(prompts) * n
        t0 = time.monotonic()
        attempts = 0
        while True:
            attempts += 1
            whole, deltas = {}, collections.defaultdict(list)
            try:
                svc.ready.wait(self.args.retry_s)
                for s in svc.client(who).generate(prompts, n=n, request_id=rid, timeout=self.args.request_timeout_s,
                                                  **kw):
                    key = (s.prompt_index, s.sample_index)
                    if s.delta:
                        deltas[key].append((s.delta_start, s.token_ids.tolist()))
                    elif key in whole:
                        self.stats.problem("wrong_samples", 1, f"{kind} {rid}: sample {key} sent twice")
                    else:
                        whole[key] = s
                break
            except grpc.RpcError as e:
                code = e.code().name
                with self.stats.lock:
                    self.stats.codes[f"{kind}:{code}"] += 1
                if classify(code) == "retriable" and time.monotonic() - t0 < self.args.retry_s:
                    self.stats.add(retries=1)
                    time.sleep(min(5.0, 0.5 * attempts))
                    continue
                self.stats.problem("lost_samples", expect, f"{kind} {rid}: {code} {e.details()!r} after {attempts} "
                                                           "attempts")
                self.stats.add(lost_requests=1, requests=1)
                return None
        done = time.monotonic()
        missing = expect - len(whole)
        self.stats.add(requests=1, samples=len(whole))
        if missing:
            self.stats.problem("lost_samples", missing, f"{kind} {rid}: {len(whole)} of {expect} samples")
        with self.stats.lock:
            self.stats.codes[f"{kind}:OK"] += 1
            if attempts == 1:
                self.stats.lat.append((done, done - t0, kind))
        max_tokens = kw.get("max_tokens")
        for key, s in whole.items():
            problems = []
            if len(s.logprobs) != len(s.token_ids):
                problems.append(f"{len(s.token_ids)} tokens, {len(s.logprobs)} log-probs")
            if any((not math.isfinite(x)) or x > 1e-4 for x in s.logprobs):
                problems.append("a log-prob above 0 or not finite")
            if max_tokens and (len(s.token_ids) > max_tokens or
                               (kw.get("ignore_eos") and len(s.token_ids) != max_tokens)):
                problems.append(f"{len(s.token_ids)} tokens for max_tokens {max_tokens}")
            if s.finish_reason not in ("stop", "length"):
                problems.append(f"finish_reason {s.finish_reason}")
            if key in deltas:
                problems += stream_problems(deltas[key], s.token_ids.tolist())
            if kw.get("top_logprobs"):
                problems += topk_problems(s.token_ids.tolist(), s.logprobs.tolist(),
                                          None if s.top_token_ids is None else s.top_token_ids.tolist(),
                                          None if s.top_logprobs is None else s.top_logprobs.tolist(),
                                          kw["top_logprobs"])
            if problems:
                self.stats.problem("wrong_samples", 1, f"{kind} {rid} {key}: {problems[:3]}")
            line = f"adapter:{s.policy}" if s.policy else "policy"
            if s.policy != kw.get("policy", ""):
                self.stats.problem("mislabelled_samples", 1, f"{kind} {rid}: policy {s.policy!r} for "
                                                              f"{kw.get('policy', '')!r}")
            spans = span_problems(s.version_spans, len(s.token_ids), None, single=bool(s.policy))
            if spans:
                self.stats.problem("mislabelled_samples", 1, f"{kind} {rid} {key}: {spans}")
            with self.stats.lock:
                self.stats.labels[(svc.name, line, tuple(sorted({v for v, _ in s.version_spans})))] += 1
                if s.draft_version:
                    self.stats.labels[(svc.name, "drafter", (s.draft_version,))] += 1
                if s.routed_experts is not None:
                    self.stats.labels[(svc.name, "policy",
                                       tuple(sorted({v for v, _ in s.routed_experts.version_spans})))] += 1
            if check is not None:
                msg = check(s)
                if msg:
                    self.stats.problem("mislabelled_samples", 1, f"{kind} {rid} {key}: {msg}")
        return whole, deltas

    def every(self, period_s: float, fn, *args) -> None:
        """Run fn(*args) every period_s (from its start) until the soak stops; an exception is a problem, and the
        loop goes on."""
        while not self.stop.is_set():
            t = time.monotonic()
            try:
                fn(*args)
            except Exception as e:                                      # noqa: BLE001 - recorded, the soak goes on
                self.stats.problem("worker_errors", 1, f"{getattr(fn, '__name__', fn)}: {type(e).__name__}: {e}")
                time.sleep(2.0)
            self.stop.wait(max(0.0, period_s - (time.monotonic() - t)))

    # -- pushes --------------------------------------------------------------------------------------------------
    def push(self, svc: Service, line: str, version: int, fn, expect_fp: str | None = None, fp_field: str = ""):
        """Run a push (fn() -> PushResult) under the service's push lock; retried on a retriable status unless
        GetStatus shows it committed. Returns the result, "committed" (it committed though its call failed) or
        None (failed: counted)."""
        import grpc

        t0 = time.monotonic()
        with svc.push_lock:
            while True:
                try:
                    svc.ready.wait(self.args.retry_s)
                    res = fn()
                    self.ledger.commit(svc.name, line, version)
                    if expect_fp and res.fingerprint and res.fingerprint != expect_fp:
                        self.stats.problem("wrong_weights", 1, f"{svc.name} {line} v{version}: the server's "
                                                              "fingerprint is not the pushed tensors'")
                    return res
                except grpc.RpcError as e:
                    code = e.code().name
                    with self.stats.lock:
                        self.stats.codes[f"push:{code}"] += 1
                    try:
                        st = svc.status_when_up(self.args.retry_s)
                    except grpc.RpcError:
                        st = None
                    if st is not None and served_version(st, line) >= version:
                        self.ledger.commit(svc.name, line, version, how="committed_despite_error")
                        self.stats.problem("push_committed_despite_error", 1, f"{svc.name} {line} v{version}: "
                                                                              f"{code} {e.details()!r}")
                        return "committed"
                    if classify(code) == "retriable" and time.monotonic() - t0 < self.args.retry_s:
                        self.stats.add(push_retries=1)
                        time.sleep(1.0)
                        continue
                    self.stats.problem("push_failures", 1, f"{svc.name} {line} v{version}: {code} {e.details()!r}")
                    return None

    # -- workloads -----------------------------------------------------------------------------------------------
    def trainer(self) -> None:
        """The GRPO-like loop: sync and async steps, full / delta / partial pushes, drafter updates."""
        import torch
        from rollout_client.delta import WeightDeltas, fingerprint
        from safetensors.torch import load_file

        svc = self.svc["policy"]
        rng = random.Random(self.args.seed + 1)
        gen = torch.Generator().manual_seed(self.args.seed)
        W = {k: v.clone() for k, v in load_file(str(Path(self.models["policy"]) / "model.safetensors")).items()}
        D = {k: v.clone() for k, v in load_file(str(Path(self.models["drafter"]) / "model.safetensors")).items()}

        class Live:                 # WeightDeltas' client: the service's admin client of the moment
            def __getattr__(_, name):
                return getattr(svc.client("admin"), name)
        deltas = WeightDeltas(Live(), anchor_every=50,
                              full_push=lambda w, v, mode, timeout: svc.client("admin").push_weights(
                                  w, v, mode=mode, timeout=timeout))
        layers = sorted({k.split(".layers.")[1].split(".")[0] for k in W if ".layers." in k})
        kinds = ("full", "delta", "delta", "partial")
        need_full = False
        step = 0
        while not self.stop.is_set():
            t_step = time.monotonic()
            v_before = self.ledger.last[("policy", "policy")]
            sync = step % 2 == 0
            prompts = self.prompts(rng, 4)
            kind = "full" if need_full else kinds[step % len(kinds)]
            # the trainer's update: sparse changes (most elements keep their value between steps), or one layer
            if kind == "partial":
                layer = rng.choice(layers)
                names = [k for k in W if f".layers.{layer}." in k]
            else:
                names = rng.sample(sorted(W), 3)
            for name in names:
                t = W[name].view(-1)
                idx = torch.randint(0, t.numel(), (max(1, t.numel() // 200),), generator=gen)
                t[idx] += torch.randn(len(idx), generator=gen) * 0.01
            v = v_before + 1
            mode = "wait" if sync else "keep"
            out: dict = {}

            def batch(min_version: int, check):
                out["r"] = self.request(svc, "trainer_sync" if sync else "trainer_async", prompts, n=4,
                                        max_tokens=self.args.max_tokens, temperature=1.0,
                                        min_policy_version=min_version, check=check)
            if sync:
                batch(v_before, lambda s, vb=v_before: None if [x for x, _ in s.version_spans] == [vb] else
                      f"a sync step's sample carries {s.version_spans}, not [{vb}]")
            else:
                runner = threading.Thread(target=batch, args=(0, lambda s, vb=v_before, va=v: None if all(
                    vb <= x <= va for x, _ in s.version_spans) else f"an async sample carries {s.version_spans} "
                    f"outside [{vb}, {va}]"))
                runner.start()
                time.sleep(0.3)
            fp = fingerprint(W)
            if kind == "partial":
                sub = {k: W[k] for k in names}
                res = self.push(svc, "policy", v, lambda: svc.client("admin").push_weights(
                    sub, v, mode=mode, partial=True, timeout=120), fp)
            elif kind == "delta":
                res = self.push(svc, "policy", v, lambda: deltas.push(W, v, mode=mode, timeout=120), fp)
                if res is not None and res != "committed":
                    self.stats.add(**{f"delta_sent_as_{deltas.last_kind.replace(' ', '_')}": 1})
            else:
                res = self.push(svc, "policy", v, lambda: svc.client("admin").push_weights(W, v, mode=mode,
                                                                                          timeout=120), fp)
            need_full = res is None
            if res is not None:
                self.committed_fp["policy"] = fp
            self.stats.add(**{f"push_{kind}": 1, f"push_mode_{mode}": 1})
            if not sync:
                runner.join()
            if step % 3 == 2 and self.args.drafter:
                name = rng.choice(sorted(D))
                t = D[name].view(-1)
                idx = torch.randint(0, t.numel(), (max(1, t.numel() // 200),), generator=gen)
                t[idx] += torch.randn(len(idx), generator=gen) * 0.01
                dv = self.ledger.last[("policy", "drafter")] + 1
                dfp = fingerprint(D)
                if self.push(svc, "drafter", dv, lambda: svc.client("admin").update_draft(D, dv, mode="keep",
                                                                                         timeout=120), dfp):
                    self.committed_fp["drafter"] = dfp
                self.stats.add(push_drafter=1)
            step += 1
            self.stop.wait(max(0.0, self.args.step_s - (time.monotonic() - t_step)))

    def streams(self, rng: random.Random) -> None:
        """A streamed request, a top-k one, or both at once."""
        svc = self.svc["policy"]
        what = rng.choice(("stream", "topk", "stream_topk"))
        kw = dict(max_tokens=self.args.max_tokens, temperature=1.0, ignore_eos=True)
        if "stream" in what:
            kw["stream_tokens"] = True
        if "topk" in what:
            kw["top_logprobs"] = 5
        self.request(svc, what, self.prompts(rng, 2), n=2, **kw)

    def session(self, rng: random.Random) -> None:
        """A conversation of 3 turns on one session_id, each turn's prompt the whole conversation so far."""
        svc = self.svc["policy"]
        key = f"conv-{uuid.uuid4().hex[:10]}"
        history = self.prompts(rng, 1)[0]
        for _ in range(3):
            got = self.request(svc, "session", [history], max_tokens=8, temperature=1.0, session_id=key)
            if got is None:
                return
            s = got[0].get((0, 0))
            history = history + (s.token_ids.tolist() if s is not None else []) + self.prompts(rng, 1)[0][1:5]
            time.sleep(rng.uniform(0, 0.5))

    def tenant(self, name: str, rng: random.Random) -> None:
        """A LoRA tenant: samples its adapter; pushes a new version every --tenant-push-s."""
        import torch
        from lora import adapter_state                                 # bench/lora.py

        svc = self.svc["policy"]
        tensors, config, _ = adapter_state(self.models["policy"], 8, seed=1 + int(name[-1]))
        gen = torch.Generator().manual_seed(int(name[-1]))
        line = f"adapter:{name}"
        last_push = -math.inf
        while not self.stop.is_set():
            if time.monotonic() - last_push >= self.args.tenant_push_s:
                for t in rng.sample(sorted(tensors), 4):
                    tensors[t] += torch.randn(tensors[t].shape, generator=gen) * 0.005
                v = self.ledger.last[("policy", line)] + 1
                if self.push(svc, line, v, lambda: svc.client(name).push_adapter(name, tensors, v, config=config,
                                                                                timeout=120)):
                    self.stats.add(push_adapter=1)
                last_push = time.monotonic()
            if self.ledger.last[("policy", line)]:
                self.request(svc, f"tenant_{name}", self.prompts(rng, 1), n=2, who=name, policy=name,
                             max_tokens=12, temperature=1.0)
            self.stop.wait(rng.uniform(1.0, 3.0))

    def moe(self, rng: random.Random) -> None:
        """Requests with routes; a push of some experts and the routers every --moe-push-s."""
        import torch
        from rollout_client.delta import fingerprint
        from safetensors.torch import load_file

        svc = self.svc["moe"]
        W = {k: v.clone() for k, v in load_file(str(Path(self.models["moe"]) / "model.safetensors")).items()}
        gen = torch.Generator().manual_seed(self.args.seed + 7)
        last_push = time.monotonic()
        pushing: list[threading.Thread] = []

        def check(s):
            r = s.routed_experts
            if r is None:
                return "no routes"
            rows = s.num_prompt_tokens + len(s.token_ids) - 1
            if r.ids.shape[0] != rows or r.first_row != 0:
                return f"{r.ids.shape[0]} route rows (from {r.first_row}) for {rows}"
            probs = span_problems(r.version_spans, rows, None)
            return "; ".join(probs) if probs else None
        while not self.stop.is_set():
            if time.monotonic() - last_push >= self.args.moe_push_s and not any(t.is_alive() for t in pushing):
                experts = rng.sample(range(8), 2)
                sub = {}
                for name, t in W.items():
                    ex = ".mlp.experts." in name and int(name.split(".mlp.experts.")[1].split(".")[0]) in experts
                    if ex or name.endswith(".mlp.gate.weight"):
                        t += torch.randn(t.shape, generator=gen) * t.std() * 0.05
                        sub[name] = t
                v = self.ledger.last[("moe", "policy")] + 1
                fp = fingerprint(W)
                push = threading.Thread(target=lambda: self.push(svc, "policy", v, lambda: svc.client(
                    "admin").push_weights(sub, v, mode="keep", partial=True, timeout=120), fp) and
                    self.stats.add(push_moe=1))
                push.start()
                pushing = [push]
                last_push = time.monotonic()
            kw = dict(max_tokens=self.args.max_tokens, temperature=1.0, return_routed_experts=True, ignore_eos=True)
            if rng.random() < 0.5:
                kw["stream_tokens"] = True
            self.request(svc, "moe_routes", self.prompts(rng, 2), n=2, check=check, **kw)
            self.stop.wait(rng.uniform(0.5, 1.5))
        for t in pushing:
            t.join()

    def probe(self) -> None:
        self.request(self.svc["policy"], "probe", [PROBE], max_tokens=8, temperature=1.0, seed=1)

    # -- faults --------------------------------------------------------------------------------------------------
    def fault(self, kind: str, target: str) -> dict:
        svc = self.svc[target]
        rec = {"kind": kind, "service": target, "t_s": round(time.monotonic() - self.t0, 1), "recovered": False}
        heavy = kind != "disconnect"            # a cancelled stream stalls nobody: its rows stay in the drift
        if heavy:
            self.stats.fault_until = math.inf
        t0 = time.monotonic()
        try:
            rec.update(getattr(self, f"_{kind}")(svc))
        except Exception as e:                                          # noqa: BLE001 - a fault that failed
            rec["error"] = f"{type(e).__name__}: {e}"
            self.stats.problem("fault_errors", 1, f"{kind} on {target}: {rec['error']}")
        rec["took_s"] = round(time.monotonic() - t0, 2)
        if heavy:
            self.stats.fault_until = time.monotonic() + self.args.fault_settle_s
        print(f"[soak] fault {json.dumps(rec)}", flush=True)
        return rec

    def _frontend_restart(self, svc: Service) -> dict:
        """SIGKILL the front end between pushes, restart it on its state_dir: it must serve the last committed
        versions and weights before it says ready."""
        with svc.push_lock:
            last = {line: v for (s, line), v in self.ledger.last.items() if s == svc.name}
            took = svc.restart()
            st = svc.status_when_up()
            deadline = time.monotonic() + 60          # fingerprints: computed in a thread after start, one by one
            fps = lambda st: {"policy": st.policy_fingerprint, "drafter": st.draft_fingerprint}     # noqa: E731
            while not all(fps(st)[k] for k in self.committed_fp) and time.monotonic() < deadline:
                time.sleep(1.0)
                st = svc.status()
            served = {"policy": st.policy_version, "drafter": st.draft_version,
                      **{f"adapter:{a.name}": a.version for a in st.adapters}}
            wrong = {line: (v, served.get(line, 0)) for line, v in last.items() if served.get(line, 0) != v}
            served_fp = fps(st)
            fp_ok = all(served_fp[k] == fp for k, fp in self.committed_fp.items())
            if not fp_ok:
                missing = [k for k in self.committed_fp if not served_fp[k]]
                self.stats.problem("fingerprint_missing" if missing else "wrong_weights", 1,
                                   f"the restarted front end's fingerprints {served_fp} against the last committed "
                                   f"{self.committed_fp}" + (f" ({missing} not computed in 60 s)" if missing else ""))
            if wrong:
                self.stats.problem("restart_state_wrong", 1, f"committed -> served: {wrong}")
            return {"ready_s": round(took, 1), "served": served, "recovered": st.ready and not wrong and fp_ok,
                    "restored_policy_version": st.durability.restored_policy_version}

    def _engine_kill(self, svc: Service) -> dict:
        """SIGKILL an engine core: the supervisor restarts it at the committed versions."""
        st = svc.status_when_up()
        before = sum(e.restarts for e in st.engines)
        cores = engine_cores(svc.proc.proc.pid)
        if not cores:
            raise RuntimeError("no EngineCore process found")
        victim = self.rng.choice(cores)
        t0 = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        deadline = t0 + 300
        while time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                st = svc.status()
            except Exception:                                           # noqa: BLE001 - still restarting
                continue
            if sum(e.restarts for e in st.engines) > before and st.ready:
                versions = {(e.policy_version, e.draft_version) for e in st.engines}
                ok = versions == {(st.policy_version, st.draft_version)}
                return {"pid": victim.pid, "restart_s": round(time.monotonic() - t0, 1), "recovered": ok,
                        "engine_versions": sorted(versions)}
        return {"pid": victim.pid, "recovered": False, "error": "no restart within 300 s"}

    def _trainer_kill(self, svc: Service) -> dict:
        """A trainer process that sends half of a push and is SIGKILLed: nothing may change, and the same version
        must commit afterwards (the trainer's next push)."""
        from safetensors.torch import save_file

        with svc.push_lock:
            st = svc.status_when_up()
            v = self.ledger.last[(svc.name, "policy")] + 1
            path = self.tmp / "killed_trainer.safetensors"
            from safetensors.torch import load_file
            W = load_file(str(Path(self.models["policy"]) / "model.safetensors"))
            save_file({k: t.contiguous() for k, t in W.items()}, str(path))
            env = {**os.environ, "ROLLOUT_ADMIN_TOKEN": svc.tokens.get("admin", "")}
            proc = subprocess.Popen([sys.executable, "-c", KILLED_TRAINER, svc.proc.target, str(path), str(v)],
                                    stdout=subprocess.PIPE, env=env)
            ready, _, _ = select.select([proc.stdout], [], [], 120)
            said = proc.stdout.readline().decode().strip() if ready else ""
            time.sleep(0.3)
            proc.kill()
            proc.wait()
            time.sleep(2.0)
            after = svc.status_when_up()
            same = (after.policy_version == st.policy_version and after.policy_fingerprint == st.policy_fingerprint)
            if not same:
                self.stats.problem("wrong_weights", 1, f"a killed push changed the policy: v{st.policy_version} -> "
                                                       f"v{after.policy_version}")
            return {"version": v, "mid_stream": said == "mid", "recovered": same and said == "mid"}

    def _disconnect(self, svc: Service) -> dict:
        """A client reads 2 messages of a streamed request, then cancels it; the same request_id must then run to
        its end (the record was released)."""
        from rollout_client import build_request

        rid = f"disconnect-{uuid.uuid4().hex[:10]}"
        c = svc.client()
        prompts = self.prompts(self.rng, 2)
        req = build_request(prompts, n=2, max_tokens=64, ignore_eos=True, temperature=1.0, stream_tokens=True,
                            request_id=rid)
        call = c.stub.Generate(req, timeout=120, metadata=c.auth.data())
        got = 0
        for _ in call:
            got += 1
            if got >= 2:
                break
        call.cancel()
        time.sleep(1.0)
        whole = c.generate_all(prompts, n=2, max_tokens=64, ignore_eos=True, temperature=1.0, request_id=rid,
                               timeout=120)
        complete = all(s is not None and len(s.token_ids) == 64 for g in whole for s in g)
        return {"messages_before_cancel": got, "recovered": complete}

    def faults_loop(self, schedule: list) -> None:
        for t_s, kind, target in schedule:
            if self.stop.wait(max(0.0, self.t0 + t_s - time.monotonic())):
                return
            self.faults.append(self.fault(kind, target))

    # -- the rows ------------------------------------------------------------------------------------------------
    def row(self, since: float) -> dict:
        now = time.monotonic()
        r = {"t_s": round(now - self.t0, 1), "fault": self.stats.fault_until > since}
        for name, svc in self.svc.items():
            r.update({f"{name}.{k}": v for k, v in proc_tree(svc.proc.proc.pid).items()})
            r[f"{name}.staging_bytes"] = dir_bytes(staging_dir(svc.proc.proc.pid))
            if name == "policy":
                r[f"{name}.state_bytes"] = dir_bytes(Path(self.args_state_dir))
            try:
                st = svc.status(timeout=20)
                self.ledger.seen(name, st)
                r.update({f"{name}.queue_depth": st.queue_depth, f"{name}.sessions": st.sessions.sessions,
                          f"{name}.adapters": len(st.adapters),
                          f"{name}.adapter_versions": sum(len(a.loaded_versions) for a in st.adapters),
                          f"{name}.restarts": sum(e.restarts for e in st.engines),
                          f"{name}.policy_version": st.policy_version, f"{name}.draft_version": st.draft_version,
                          f"{name}.tenants_running": sum(getattr(t, "running_sequences", 0) for t in st.tenants)})
            except Exception as e:                                      # noqa: BLE001 - restarting
                r[f"{name}.status_error"] = type(e).__name__
        with self.stats.lock:
            lat = [(d, k) for t, d, k in self.stats.lat if since < t <= now]
            c = dict(self.stats.c)
        probe = [round(d, 4) for d, k in lat if k == "probe"]
        every = [d for d, _ in lat]
        r.update({"probe_s": probe, "probe_p50_s": percentile(probe, 0.5), "probe_p99_s": percentile(probe, 0.99),
                  "p50_s": percentile(every, 0.5), "p99_s": percentile(every, 0.99), "requests_in_row": len(every),
                  "commits": sum(self.ledger.commits.values()), "requests": c.get("requests", 0),
                  "samples": c.get("samples", 0), "lost_samples": c.get("lost_samples", 0),
                  "faults": len(self.faults), "load_average": os.getloadavg()[0], "orphans": orphans()})
        return r

    def sampler(self, bar) -> None:
        since = self.t0
        end = self.t0 + self.args.minutes * 60
        while True:
            wait = min(self.args.sample_s, end - time.monotonic())
            if wait > 0 and self.stop.wait(wait):
                return
            row = self.row(since)
            since = time.monotonic()
            self.rows.append(row)
            bar.update(1)
            fe = row.get("policy.fe_rss_mb")
            bar.set_postfix_str(f"fe {fe} MB, probe p99 {row['probe_p99_s']}, commits {row['commits']}, "
                                f"lost {row['lost_samples']}")
            if len(self.rows) % 5 == 0:
                self.write(partial=True)
            if time.monotonic() >= end:
                return

    def write(self, partial: bool = False):
        totals = self.totals()
        summary = summarize(self.rows, totals, self.faults, self.args.warmup)
        config = {k: v for k, v in vars(self.args).items() if k not in ("out", "plot")} | {
            "models": {k: str(v) for k, v in self.models.items()}, "service_args": {
                k: s.args for k, s in self.svc.items()}}
        with self.stats.lock:
            extra = {"faults": self.faults, "problems": list(self.stats.problems),
                     "codes": dict(sorted(self.stats.codes.items())),
                     "counters": dict(sorted(self.stats.c.items())),
                     "committed": {f"{s}/{line}": sorted(v) for (s, line), v in self.ledger.committed.items()},
                     "commits": dict(self.ledger.commits)}
        return write_result("soak", config, summary, self.rows, self.args.out, partial=partial, **extra), summary

    def totals(self) -> dict:
        with self.stats.lock:
            labels = dict(self.stats.labels)
            c = dict(self.stats.c)
        with self.ledger.lock:
            committed = {k: set(v) for k, v in self.ledger.committed.items()}
        bad = uncommitted(labels, committed)
        self.uncommitted_labels = {f"{k[0]}/{k[1]}/{list(k[2])}": n for k, n in bad.items()}
        return {**c, "mislabelled_samples": c.get("mislabelled_samples", 0) + sum(bad.values()),
                "commits": sum(self.ledger.commits.values())}


KILLED_TRAINER = r"""
import sys, time
from safetensors.torch import load_file
from rollout_client import RolloutClient
from rollout_client.api import pb
from rollout_client.weights import push_stream
target, path, version = sys.argv[1], sys.argv[2], int(sys.argv[3])
msgs = list(push_stream(load_file(path), version, target=pb.TARGET_POLICY, chunk_bytes=1 << 16, pack_bytes=0))
def stream():
    yield from msgs[: len(msgs) // 2]
    print("mid", flush=True)
    time.sleep(3600)
    yield from msgs[len(msgs) // 2:]
c = RolloutClient(target)
c.stub.PushWeights(stream(), metadata=c.auth.admin())
"""


def served_version(st, line: str) -> int:
    if line == "policy":
        return st.policy_version
    if line == "drafter":
        return st.draft_version
    name = line.split(":", 1)[1]
    return next((a.version for a in st.adapters if a.name == name), 0)


def engine_cores(pid: int) -> list:
    import psutil

    out = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            pass
    return out


def proc_tree(pid: int) -> dict:
    """The front end's RSS, fds and threads, and its engines' RSS (every descendant of an EngineCore process, and
    the others' apart: the engine fork server)."""
    import psutil

    out: dict = {"fe_pid": pid}
    try:
        fe = psutil.Process(pid)
        out.update(fe_rss_mb=round(fe.memory_info().rss / 2**20, 1), fds=fe.num_fds(), threads=fe.num_threads())
        kids = fe.children(recursive=True)
    except psutil.Error:
        return out
    cores = {p.pid for p in kids if _is_core(p)}
    engine, other, pids = 0, 0, []
    for p in kids:
        try:
            rss = p.memory_info().rss
            parents = {q.pid for q in p.parents()}
        except psutil.Error:
            continue
        if p.pid in cores or parents & cores:
            engine += rss
            pids.append(p.pid)
        else:
            other += rss
    out.update(engines_rss_mb=round(engine / 2**20, 1) if pids else None, others_rss_mb=round(other / 2**20, 1),
               engine_pids=" ".join(map(str, sorted(pids))), processes=len(kids) + 1)
    return out


def orphans() -> int:
    """vLLM processes (engine cores, workers) that lost their parent (reparented to init): what a killed engine or
    front end must not leave behind."""
    import psutil

    n = 0
    for p in psutil.process_iter(["name", "ppid"]):
        if p.info["ppid"] == 1 and (p.info["name"] or "").startswith("VLLM"):
            n += 1
    return n


def _is_core(p) -> bool:
    try:
        return "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline()[:2])
    except Exception:                                                  # noqa: BLE001 - gone
        return False


def staging_dir(pid: int) -> Path:
    from rollout_service.scratch import ROOT_PREFIX                   # on /dev/shm where there is one

    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
    return base / f"{ROOT_PREFIX}{pid}"


def dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def write_config(tmp: Path, tokens: dict) -> Path:
    cfg = tmp / "server.toml"
    for k, v in tokens.items():
        (tmp / f"token-{k}").write_text(v)
    text = f'[security]\ntoken_file = "{tmp / "token-client"}"\nadmin_token_file = "{tmp / "token-admin"}"\n'
    text += "".join(f'[[security.tenants]]\nname = "{t}"\ntoken_file = "{tmp / f"token-{t}"}"\npolicies = ["{t}"]\n'
                    for t in tokens if t.startswith("t"))
    cfg.write_text(text)
    return cfg


def plot(rows: list[dict], faults: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t_s"] / 60 for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(12, 7), sharex=True)
    (rss, fds), (lat, com) = axes
    for svc in ("policy", "moe"):
        rss.plot(t, [r.get(f"{svc}.fe_rss_mb") for r in rows], label=f"{svc} front end")
        rss.plot(t, [r.get(f"{svc}.engines_rss_mb") for r in rows], "--", label=f"{svc} engines")
        fds.plot(t, [r.get(f"{svc}.fds") for r in rows], label=f"{svc} fds")
        fds.plot(t, [r.get(f"{svc}.threads") for r in rows], "--", label=f"{svc} threads")
    lat.plot(t, [r.get("probe_p50_s") for r in rows], label="probe p50")
    lat.plot(t, [r.get("probe_p99_s") for r in rows], label="probe p99")
    lat.plot(t, [r.get("p99_s") for r in rows], ":", label="all requests p99")
    com.plot(t, [r.get("commits") for r in rows], label="commits")
    com.plot(t, [r.get("requests", 0) / 100 for r in rows], label="requests / 100")
    com.plot(t, [r.get("policy.restarts") for r in rows], label="policy engine restarts")
    rss.set(ylabel="RSS (MB)", title="memory")
    fds.set(ylabel="count", title="front ends' open fds and threads")
    lat.set(ylabel="seconds", xlabel="minutes", title="latency (per row)", yscale="log")
    com.set(ylabel="count", xlabel="minutes", title="commits, requests, restarts")
    for ax in axes.flat:
        for f in faults:
            ax.axvline(f["t_s"] / 60, color="red" if f["kind"] != "disconnect" else "grey", alpha=0.25, lw=1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("soak (red: front-end restart, engine and trainer kills; grey: disconnects)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=120.0, help="how long the traffic runs")
    ap.add_argument("--engines", type=int, default=1, help="engines of the policy service")
    ap.add_argument("--sample-s", type=float, default=60.0, help="seconds between rows")
    ap.add_argument("--step-s", type=float, default=20.0, help="seconds per trainer step (generate, then push)")
    ap.add_argument("--tenant-push-s", type=float, default=45.0, help="seconds between a tenant's adapter pushes")
    ap.add_argument("--moe-push-s", type=float, default=60.0, help="seconds between the MoE service's pushes")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens per sample (sessions: 8)")
    ap.add_argument("--warmup", type=float, default=0.1, help="share of the run before growth is measured")
    ap.add_argument("--retry-s", type=float, default=300.0, help="how long a request is retried under its id")
    ap.add_argument("--request-timeout-s", type=float, default=120.0, help="deadline of one attempt")
    ap.add_argument("--fault-settle-s", type=float, default=30.0,
                    help="seconds after a fault during which rows count as the fault's (left out of p99 drift)")
    ap.add_argument("--no-faults", action="store_true", help="traffic only")
    ap.add_argument("--no-drafter", dest="drafter", action="store_false", help="no draft model, no UpdateDraft")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="default bench/results/soak.json")
    ap.add_argument("--plot", help="draw the series into this PNG")
    args = ap.parse_args()

    from tests.tiny_models import build_tiny_model, build_tiny_moe_model, perturbed_copy

    tmp = logs_dir("soak")
    print(f"logs and models in {tmp}", flush=True)
    models = {"policy": build_tiny_model(tmp / "tiny-llama"), "moe": build_tiny_moe_model(tmp / "tiny-moe")}
    models["drafter"] = perturbed_copy(models["policy"], tmp / "drafter", scale=0.05, seed=1)
    tokens = {"client": "c" * 24, "admin": "a" * 24, "t0": "x" * 24, "t1": "y" * 24}
    state = tmp / "state"
    policy_args = [*SERVICE_ARGS, "--engines", str(args.engines), "--state-dir", str(state), "--max-sessions", "32",
                   "--max-adapters", "2", "--max-lora-rank", "8", "--config", str(write_config(tmp, tokens))]
    if args.drafter:
        policy_args += ["--speculation", "draft_model", "--draft-model", str(models["drafter"]),
                        "--num-speculative-tokens", "2"]
    svcs = {"policy": Service("policy", str(models["policy"]), policy_args, tmp / "policy.log", tokens),
            "moe": Service("moe", str(models["moe"]), list(SERVICE_ARGS), tmp / "moe.log")}
    duration = args.minutes * 60
    schedule = [] if args.no_faults else fault_schedule(duration)
    print("fault schedule: " + ", ".join(f"{k}@{t / 60:.1f}min({s})" for t, k, s in schedule), flush=True)
    try:
        for s in svcs.values():
            s.start()
            print(f"{s.name}: ready on {s.proc.target}; process tree "
                  f"{proc_tree(s.proc.proc.pid)}", flush=True)
        soak = Soak(args, svcs, models, tmp)
        soak.args_state_dir = state
        rng = random.Random(args.seed)
        workers = [threading.Thread(target=soak.trainer, name="trainer"),
                   threading.Thread(target=soak.every, args=(1.0, soak.streams, random.Random(rng.random())),
                                    name="streams"),
                   threading.Thread(target=soak.every, args=(1.0, soak.session, random.Random(rng.random())),
                                    name="sessions"),
                   threading.Thread(target=soak.every, args=(2.0, soak.probe), name="probe"),
                   threading.Thread(target=soak.moe, args=(random.Random(rng.random()),), name="moe"),
                   *[threading.Thread(target=soak.tenant, args=(f"t{i}", random.Random(rng.random())),
                                      name=f"tenant-t{i}") for i in range(2)],
                   threading.Thread(target=soak.faults_loop, args=(schedule,), name="faults")]
        soak.t0 = time.monotonic()
        for w in workers:
            w.start()
        bar = progress(int(math.ceil(duration / args.sample_s)), "rows")
        try:
            soak.sampler(bar)
        finally:
            soak.stop.set()
            bar.close()
            for w in workers:
                w.join(args.retry_s + 60)
        for name, svc in svcs.items():            # idle now: nothing may be left admitted
            try:
                st = svc.status_when_up(60)
            except Exception as e:                                      # noqa: BLE001 - recorded
                soak.stats.problem("end_status_errors", 1, f"{name}: {type(e).__name__}: {e}")
                continue
            soak.ledger.seen(name, st)
            if st.queue_depth:
                soak.stats.problem("leaked_sequences", st.queue_depth, f"{name}: queue depth {st.queue_depth} "
                                                                       "with no request in flight")
        path, summary = soak.write()
    finally:
        for s in svcs.values():
            s.stop()
        Service.launcher.shutdown()
    print(json.dumps({k: v for k, v in summary.items() if k not in ("rss", "fds", "threads", "probe_p99")},
                     indent=1))
    if soak.uncommitted_labels:
        print(f"labels naming uncommitted versions: {soak.uncommitted_labels}")
    print(f"wrote {path}")
    if args.plot:
        print(f"wrote {plot(soak.rows, soak.faults, Path(args.plot))}")


if __name__ == "__main__":
    main()
