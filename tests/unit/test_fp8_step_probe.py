"""perf/fp8_step_probe.py's FP8 arms compute the layer they stand for (checked on the CPU by its dequantized
emulation of torch._scaled_mm), so its GPU timings compare the same model in two precisions."""
from __future__ import annotations

import pytest

from tests.bench_modules import PERF as BENCH_DIR
from tests.bench_modules import perf_module


@pytest.fixture(scope="module")
def probe():
    pytest.importorskip("torch")
    return perf_module("fp8_step_probe")


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


def test_the_dry_run_writes_the_models_column_without_the_package_installed(tmp_path):
    """The GPU machine runs `python perf/fp8_step_probe.py` from a copy of the repository with plain PyTorch, the
    package not installed: the probe finds rollout_service's perfmodel beside it and fills model_ratio_h200 (it came
    back empty from an H100 while it needed the installed package)."""
    import json
    import subprocess
    import sys
    import sysconfig

    pytest.importorskip("torch")
    bench = BENCH_DIR / "fp8_step_probe.py"
    # -S: no site, so no .pth files and no editable install; the site-packages directory on PYTHONPATH gives torch
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    bare = subprocess.run([sys.executable, "-S", "-c", "import torch, rollout_service"], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
    assert bare.returncode != 0 and "rollout_service" in bare.stderr, "the package is importable without the repo"
    out = tmp_path / "probe.json"
    run = subprocess.run([sys.executable, "-S", str(bench), "--dry-run", "--batches", "1", "--widths", "1",
                          "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    cells = json.loads(out.read_text())["cells"]
    assert [c["model_ratio_h200"] for c in cells] == [pytest.approx(perf_module("fp8_step_probe").model_ratio(
        1, 1, 1024))]
    assert 1.0 < cells[0]["model_ratio_h200"] < 2.0
