"""engine/cpu_lora.py: vLLM's CPU LoRA ops leave rows without an adapter (index -1) alone instead of applying the
last LoRA slot's adapter to them. On vLLM's own PyTorch-native ops, unpatched and patched."""
import importlib

import torch

from rollout_service.engine.cpu_lora import keep_rows_without_adapter


def ops():
    return importlib.import_module("vllm.lora.ops.torch_ops.lora_ops")


def unpatched(name: str):
    """vLLM's own op, also after another test installed the patches in this process (the wrapper keeps it)."""
    op = getattr(ops(), name)
    return op.__wrapped__ if getattr(op, "rollout_masked", False) else op


def test_rows_without_an_adapter_keep_their_output():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, generator=g)
    a = torch.randn(2, 1, 4, 16, generator=g)             # two LoRA slots, rank 4
    b = torch.randn(2, 1, 8, 4, generator=g)
    idx = torch.tensor([0, -1, 1, -1])                    # rows 1 and 3: the base policy
    base = torch.randn(4, 8, generator=g)

    def run(shrink, expand, expand_slice):
        buf = torch.zeros(4, 4)
        shrink(x, a, buf, idx, 0.5)
        y = base.clone()
        expand(buf, b, y, idx, True)
        z = base.clone()
        expand_slice(buf, b[:, :, :4], z, idx, 2, 4, False)
        return buf, y, z

    names = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
    buf, y, z = run(*(unpatched(n) for n in names))
    assert not torch.equal(y[1], base[1])                 # vLLM's: the last slot's adapter applied to a base row
    fixed = [keep_rows_without_adapter(unpatched(n)) for n in names]
    fbuf, fy, fz = run(*fixed)
    for rows in ([1, 3],):
        assert torch.equal(fbuf[rows], torch.zeros(2, 4)) and torch.equal(fy[rows], base[rows])
        assert torch.equal(fz[rows], base[rows])
    for r in (0, 2):                                      # rows with an adapter: exactly vLLM's
        assert torch.equal(fbuf[r], buf[r]) and torch.equal(fy[r], y[r]) and torch.equal(fz[r], z[r])
        want = base[r] + 0.5 * (b[idx[r], 0] @ (a[idx[r], 0] @ x[r]))
        torch.testing.assert_close(fy[r], want, rtol=1e-5, atol=1e-5)
    assert keep_rows_without_adapter(fixed[0]) is fixed[0]   # wrapping twice wraps once


def test_install_replaces_the_ops_where_the_cpu_punica_wrapper_and_the_prefill_ops_find_them(monkeypatch):
    lora_ops = ops()
    from vllm.lora.ops import torch_ops
    from vllm.lora.punica_wrapper import punica_cpu

    from rollout_service.engine import cpu_lora

    for name in cpu_lora.OPS:
        for module in (lora_ops, torch_ops, punica_cpu):
            monkeypatch.setattr(module, name, getattr(module, name))   # undone after the test
    assert cpu_lora.install()
    for name in cpu_lora.OPS:
        assert all(getattr(m, name).rollout_masked for m in (lora_ops, torch_ops, punica_cpu))
    x, a, idx = torch.ones(3, 2), torch.ones(1, 1, 2, 2), torch.tensor([0, -1, 0])
    buf = torch.full((3, 2), 7.0)
    lora_ops.sgmv_shrink(x, a, buf, None, torch.tensor([1, 1, 1]), idx, 3, 1, 3, 1.0)   # a prefill batch
    assert buf.tolist() == [[2.0, 2.0], [7.0, 7.0], [2.0, 2.0]]
