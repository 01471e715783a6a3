"""bench/ scripts imported as modules by the tests that check their code (bench/ is not a package: its scripts
import their neighbours, e.g. gpu_step_probe, from beside them)."""
import importlib
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench_module(name: str):
    """bench/<name>.py as a module."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))
