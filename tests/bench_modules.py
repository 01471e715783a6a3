"""bench/ and perf/ scripts imported as modules by the tests that check their code (neither is a package: their
scripts import their neighbours, e.g. gpu_step_probe, from beside them)."""
import importlib
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
PERF = BENCH.parent / "perf"


def bench_module(name: str, folder: Path = BENCH):
    """bench/<name>.py (or <folder>/<name>.py) as a module."""
    sys.path.insert(0, str(folder))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(folder))


def perf_module(name: str):
    """perf/<name>.py as a module."""
    return bench_module(name, PERF)
