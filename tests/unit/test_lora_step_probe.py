"""perf/lora_step_probe.py's LoRA arms compute what they stand for: each token's output is the base layer's plus
its own adapter's (x A^T) B^T, in the per-adapter (SGMV) form and the gathered (BGMV) form alike, so its GPU
timings compare the same work."""
from __future__ import annotations

import pytest

from tests.bench_modules import perf_module


@pytest.fixture(scope="module")
def probe():
    pytest.importorskip("torch")
    return perf_module("lora_step_probe")


@pytest.mark.parametrize("gathered", [False, True], ids=["per-adapter", "gathered"])
def test_each_token_gets_its_own_adapter(probe, gathered):
    import torch

    torch.manual_seed(0)
    base = probe.gsp.Stack(probe.gsp.TINY, "cpu", torch.float32)
    lora = probe.LoraStack(base, rank=4, adapters=3, gathered=gathered)
    assert lora.layers[0]["wqkv"][0] is base.layers[0]["wqkv"]          # the base weights are shared
    batch, width = 5, 2
    lora.set_batch(batch, width)                                        # sequences 0-1, 2-3, 4: adapters 0, 1, 2
    x = torch.randn(batch, width, probe.gsp.TINY["hidden"])
    w, a, b = lora.layers[0]["wgu"]
    got = lora.linear(x, lora.layers[0]["wgu"]).reshape(batch * width, -1)
    flat = x.reshape(batch * width, -1)
    owner = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]                              # token -> adapter (2 tokens a sequence)
    for t, i in enumerate(owner):
        want = flat[t] @ w.T + (flat[t] @ a[i].T) @ b[i].T
        assert torch.allclose(got[t], want, atol=1e-5), (t, i)
    assert not torch.allclose(got, flat @ w.T, atol=1e-3)              # the adapters did change the output
