"""The CPU machine's side of running vLLM: the environment engine processes inherit, and the dtype "auto"
means there. Imported by the engine; nothing here starts one."""
from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import sys
from pathlib import Path

# vLLM's "auto" OpenMP binding leaves one core per NUMA node to the front end; on a 2-core machine that
# halves the engine's compute. Up to this many usable CPUs, the engine's threads get all of them
# (bench/cpu_threads.py measured both side by side: bench/results/cpu_threads.txt; retired, last at commit ed4ce89).
SMALL_MACHINE_CPUS = 4


def cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5": the syntax VLLM_CPU_OMP_THREADS_BIND takes."""
    out, cpus = [], sorted(cpus)
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        out.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(out)


def prepare_cpu_environment() -> None:
    """Environment the engine's child processes inherit on CPU machines.

    Preload the venv's Intel OpenMP (vLLM warns that speculative decoding is much slower without it),
    and on small machines (<= SMALL_MACHINE_CPUS usable CPUs) bind the engine's
    OpenMP threads to all of them. PyTorch allocates tensors of 2 MB and more on transparent huge pages
    (THP_MEM_ALLOC_ENABLE; these kernels only grant them on madvise): a weight push prepares ~0.45 GB of
    fresh tensors in the worker, and at 4 KB pages the ~110k page faults took 0.4-0.5 s of a 0.7 s
    preparation (bench/weight_push.py: preparation 0.7 -> 0.25 s; generation throughput unchanged). numba (the
    n-gram proposer's) gets one thread on its workqueue layer. Settings already in the environment win. Engine
    processes get os.environ as it is when they start (spawned, or forked from engine/forkserver.py with it).
    The KV cache's size is an engine argument (VllmEngine.engine_args: kv_cache_memory_bytes), not
    VLLM_CPU_KVCACHE_SPACE, which takes whole GiB only (vLLM still lets that variable win where it is set).
    """
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    # vLLM's n-gram proposer runs numba on one thread (ngram_proposer.py caps it at 1), but numba still starts a
    # pool of one thread per CPU on its default OpenMP layer, which competes with the model's OpenMP threads: on 2
    # cores, n-gram under the k controller ran 0.93x and 0.57x of plain at 8 and 32 sequences with it, 1.08x and
    # 0.95x with one workqueue thread (bench/speculation.py, 2026-11-26; docs/speculation.md).
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) <= SMALL_MACHINE_CPUS:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_list(usable))
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    preload = os.environ.get("LD_PRELOAD", "")
    if iomp.exists() and "libiomp" not in preload:
        os.environ["LD_PRELOAD"] = f"{iomp}:{preload}" if preload else str(iomp)


def cpu_platform_environment(tensor_parallel_size: int) -> dict[str, str] | None:
    """What vLLM's CPU platform adds to the environment before it starts an engine (CpuPlatform.check_and_update_config,
    vLLM 0.32), told without importing vLLM: for a fork server started before that import (engine/forkserver.prestart),
    whose imports read some of it (torch's inductor config reads TORCHINDUCTOR_CPP_DYNAMIC_THREADS). None where vLLM
    would change LD_PRELOAD (no OpenMP runtime preloaded: it adds PyTorch's libgomp; a bundled tcmalloc), which acts
    only when an interpreter starts. Call after prepare_cpu_environment."""
    preload = os.environ.get("LD_PRELOAD", "")
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    tcmalloc = glob.glob(os.path.join(spec.submodule_search_locations[0], "libs", "libtcmalloc*.so*"))
    openmp = any(lib in preload for lib in ("libomp", "libgomp", "libiomp"))
    if not openmp or (tcmalloc and "libtcmalloc" not in preload):
        return None
    env = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn", "NUMEXPR_MAX_THREADS": str(len(os.sched_getaffinity(0))),
           "TORCHINDUCTOR_COMPILE_THREADS": "1", "VLLM_DISABLE_SHARED_EXPERTS_STREAM": "1",
           "TORCHINDUCTOR_CPP_DYNAMIC_THREADS": "1", "LOCAL_WORLD_SIZE": str(tensor_parallel_size)}
    if "VLLM_SSM_CONV_STATE_LAYOUT" not in os.environ and _cpu_has("avx512_bf16"):
        env["VLLM_SSM_CONV_STATE_LAYOUT"] = "SD"
    return env


def _cpu_has(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and flag in line.split() for line in f)
    except OSError:
        return False


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def resolve_dtype(dtype: str) -> str:
    """"auto" on a CPU without native bf16 (no AVX512-BF16/AMX) means float32: measured on these
    machines, bf16 runs 3x slower than float32 at batch 8 (oneDNN falls back to emulation)."""
    if dtype != "auto" or not is_cpu_platform():
        return dtype
    import torch

    return "auto" if torch.cpu._is_avx512_bf16_supported() else "float32"


@contextlib.contextmanager
def extra_environment(env: dict | None):
    """`env` set in this process's environment for the block, the previous values restored after it: an engine
    started inside takes them into its processes (they carry the environment as of their start)."""
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
