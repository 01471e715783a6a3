"""bench/vs_vllm_serve.py starts each batch after vLLM's busy-poll of the batch before has ended (no vLLM started:
vLLM's source is read, not imported)."""
import ast
import importlib.util
import sys
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
    sys.path.insert(0, str(BENCH))
    try:
        import vs_vllm_serve
    finally:
        sys.path.remove(str(BENCH))
    assert vs_vllm_serve.SETTLE_S > vllm_busy_loop_s()
    assert "time.sleep(SETTLE_S)" in (BENCH / "vs_vllm_serve.py").read_text()   # before every measured batch
