"""The CPU speculative-sampling fix: detection and the replacement expansion (vLLM imported, no engine)."""
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


def test_install_patches_only_what_is_broken_here():
    from vllm.platforms import current_platform

    from rollout_service.speculation import cpu_fix

    if not current_platform.is_cpu():
        pytest.skip("the fix is for vLLM's CPU platform only")
    current_platform.register_triton_kernel_overrides()     # what every vLLM worker does first
    was_broken = cpu_fix.expansion_is_broken()
    assert cpu_fix.install() == was_broken
    assert not cpu_fix.expansion_is_broken() and not cpu_fix.empty_top_k_is_broken()
