"""ruff over the hand-written code (the rules and the exclusion of the generated stubs: pyproject.toml's
[tool.ruff]); part of the suite, so .ci/run and the README's test command run it."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing():
    ruff = Path(sys.executable).parent / "ruff"
    if not ruff.is_file():
        ruff = shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed (the dev extra: bash scripts/install.sh)")
    run = subprocess.run([str(ruff), "check", "--output-format", "concise", str(ROOT)], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
