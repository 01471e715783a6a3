"""bench/fp8_step_probe.py's FP8 arms compute the layer they stand for (checked on the CPU by its dequantized
emulation of torch._scaled_mm), so its GPU timings compare the same model in two precisions."""
from __future__ import annotations

import pytest

from tests.bench_modules import bench_module


@pytest.fixture(scope="module")
def probe():
    pytest.importorskip("torch")
    return bench_module("fp8_step_probe")


@pytest.mark.parametrize("form", [dict(static=False), dict(static=True), dict(static=True, tensorwise=True)],
                         ids=["per-token", "static", "per-tensor"])
def test_fp8_layers_compute_what_bf16_layers_do(probe, form):
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    ref = probe.gsp.Stack(probe.gsp.TINY, "cpu", torch.float32)
    torch.manual_seed(0)
    fp8 = probe.FP8Stack(probe.gsp.TINY, "cpu", torch.float32, emulate=True, **form)
    x = torch.randn(3, 5, probe.gsp.TINY["hidden"])
    for name in ("wqkv", "wgu"):
        want = F.linear(x, ref.layers[0][name])
        got = fp8.linear(x, fp8.layers[0][name])
        assert got.shape == want.shape
        cos = F.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
        assert cos > 0.998, (name, cos)                  # e4m3 keeps 3 mantissa bits: ~2-4% error per element
        assert not torch.equal(got, want)                 # it did quantize
    caches = ref.caches(2, 9)
    xs, emb = ref.inputs(2, 1)
    with torch.no_grad():
        a, b = ref.step(xs, emb, caches, 8), fp8.step(xs, emb, fp8.caches(2, 9), 8)
    assert F.cosine_similarity(a.flatten(), b.flatten(), dim=0).item() > 0.99
