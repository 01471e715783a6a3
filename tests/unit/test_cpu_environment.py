"""The environment vLLM's CPU engine processes inherit (engine/cpu_env.prepare_cpu_environment)."""
import os

import pytest

from rollout_service.engine import cpu_env
from rollout_service.engine.cpu_env import cpu_list, prepare_cpu_environment


@pytest.mark.parametrize("cpus, text", [([0], "0"), ([0, 1], "0-1"), ([3, 0, 1, 2, 5], "0-3,5"),
                                        ([0, 2, 4], "0,2,4"), ([1, 2, 7, 8, 9], "1-2,7-9")])
def test_cpu_list_syntax(cpus, text):
    assert cpu_list(cpus) == text


@pytest.fixture
def clean_env(monkeypatch):
    for var in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "THP_MEM_ALLOC_ENABLE", "NUMBA_NUM_THREADS",
                "NUMBA_THREADING_LAYER"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LD_PRELOAD", os.environ.get("LD_PRELOAD", ""))   # restored after the test
    return monkeypatch


def test_small_machine_binds_every_usable_cpu(clean_env):
    clean_env.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    prepare_cpu_environment()
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ          # the KV cache's size is an engine argument


def test_large_machine_keeps_vllms_auto_binding(clean_env):
    many = set(range(cpu_env.SMALL_MACHINE_CPUS + 1))
    clean_env.setattr(os, "sched_getaffinity", lambda pid: many)
    prepare_cpu_environment()
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ


def test_explicit_binding_wins(clean_env):
    clean_env.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    clean_env.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    prepare_cpu_environment()
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "auto"


def test_engines_allocate_tensors_on_huge_pages_unless_told_otherwise(clean_env):
    clean_env.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    prepare_cpu_environment()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    clean_env.setenv("THP_MEM_ALLOC_ENABLE", "0")
    prepare_cpu_environment()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0"


def test_numba_gets_one_workqueue_thread_unless_told_otherwise(clean_env):
    """vLLM's n-gram proposer uses one numba thread; numba's default pool (a thread per CPU, OpenMP) competed with the
    model's threads (bench/speculation.py: n-gram under the controller 0.57x -> 0.95x of plain at 32 sequences)."""
    clean_env.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    prepare_cpu_environment()
    assert (os.environ["NUMBA_NUM_THREADS"], os.environ["NUMBA_THREADING_LAYER"]) == ("1", "workqueue")
    clean_env.setenv("NUMBA_NUM_THREADS", "2")
    prepare_cpu_environment()
    assert os.environ["NUMBA_NUM_THREADS"] == "2"
