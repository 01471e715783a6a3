"""bench/vs_vllm_serve.py (and every scenario on bench/harness.py's turns) starts each batch after vLLM's busy-poll
of the batch before has ended (no vLLM started: vLLM's source is read, not imported)."""
import ast
import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def vllm_busy_loop_s() -> float:
    """SpinCondition's busy_loop_s default in the installed vLLM: how long a shared-memory queue reader (the worker)
    keeps polling with sched_yield after its last message, the one every MessageQueue reader uses."""
    root = Path(importlib.util.find_spec("vllm").submodule_search_locations[0])
    tree = ast.parse((root / "distributed/device_communicators/shm_broadcast.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SpinCondition")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    names = [a.arg for a in init.args.args][-len(init.args.defaults):]
    return ast.literal_eval(dict(zip(names, init.args.defaults))["busy_loop_s"])


def test_each_batch_waits_out_the_busy_poll_of_the_one_before():
    import inspect

    from tests.bench_modules import bench_module

    harness = bench_module("harness")
    assert harness.SETTLE_S > vllm_busy_loop_s()
    assert inspect.signature(harness.turns).parameters["settle"].default == harness.SETTLE_S
    assert "time.sleep(settle)" in inspect.getsource(harness.turns)            # before every arm's batch
    assert "in turns(ARMS, r)" in (BENCH / "vs_vllm_serve.py").read_text()   # every measured batch
