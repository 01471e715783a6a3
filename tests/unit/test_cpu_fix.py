"""The CPU speculative-sampling fix: detection and the replacement expansion (vLLM imported, no engine)."""
import subprocess
import sys

import pytest
import torch

from rollout_service.speculation.cpu_fix import _expand_fixed


def test_fixed_expansion_keeps_dtype_and_replaces():
    out = torch.empty(5)
    _expand_fixed(out, torch.tensor([0.5, 0.0, 0.9]), torch.tensor([2, 3, 5], dtype=torch.int32), 0, 1)
    assert torch.equal(out, torch.tensor([0.5, 0.5, 1.0, 0.9, 0.9]))
    k = torch.empty(4, dtype=torch.int32)
    _expand_fixed(k, torch.tensor([7, 3], dtype=torch.int32), torch.tensor([1, 4], dtype=torch.int32), 0, 0)
    assert k.tolist() == [7, 3, 3, 3] and k.dtype == torch.int32


INSTALL_CHECK = """
from vllm.platforms import current_platform
from rollout_service.speculation import cpu_fix
if not current_platform.is_cpu():
    print("not-cpu")
    raise SystemExit(0)
current_platform.register_triton_kernel_overrides()     # what every vLLM worker does first
was_broken = cpu_fix.expansion_is_broken()
assert cpu_fix.install_expansion_fix() == was_broken
cpu_fix.install_empty_top_k_guard()
assert not cpu_fix.expansion_is_broken() and not cpu_fix.empty_top_k_is_broken()
print("ok")
"""


def test_install_patches_only_what_is_broken_here():
    # In a fresh process, as in a vLLM worker: vLLM's kernel registration scans every loaded module, and in the
    # suite's process other tests have loaded flask (AReaL's client), whose request proxies raise on that scan.
    run = subprocess.run([sys.executable, "-c", INSTALL_CHECK], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    if run.stdout.strip().endswith("not-cpu"):
        pytest.skip("the fix is for vLLM's CPU platform only")
    assert run.stdout.strip().endswith("ok"), run.stdout[-2000:]
