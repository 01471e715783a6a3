"""Weight sync with and without deltas (perfmodel/weight_sync.py): the arithmetic against the published figures it
is checked by (docs/projections.md, "Weight sync with deltas"), and the docs' table against the code that makes it."""
from __future__ import annotations

import contextlib
import io
from dataclasses import replace
from pathlib import Path

import pytest

from rollout_service.perfmodel import hardware, model
from rollout_service.perfmodel.rl import push_seconds, swap_seconds
from rollout_service.perfmodel.weight_sync import LINKS, anchored, weight_sync
from tests.bench_modules import perf_module

ROOT = Path(__file__).resolve().parents[2]
H200 = hardware.H200
Q06, Q8, A3B, A22B = (model.load(n) for n in ("qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b", "qwen3-235b-a22b"))


def test_a_full_push_of_the_235b_is_470_gb_and_38_s_over_one_100_gbit_link():
    """TRL: a full push of Qwen3-235B-A22B is 470 GB in bf16, 38 s a step at 100 Gb/s."""
    w = weight_sync(A22B, H200, "100g", tp=8, links=1)
    assert w.full.bytes == pytest.approx(470e9, rel=0.01)
    assert w.full.transfer_s == pytest.approx(38, rel=0.02)
    assert w.full.transfer_s == pytest.approx(A22B.params() * 2 / 12.5e9)
    # a link per engine device: the tp-8 engine's shards arrive in parallel, 1/8 of the time
    assert weight_sync(A22B, H200, "100g", tp=8).full.transfer_s == pytest.approx(w.full.transfer_s / 8)


def test_a_delta_of_a_0_6b_model_at_1_percent_is_tens_of_mb_33x_smaller():
    """TRL: a Qwen3-0.6B push from 1.2 GB to 20-35 MB. A changed element is a uint32 index and a bf16 value (6 bytes
    against 2): 2 / (6 x 1%) = 33.3x fewer bytes, 16.7x at 2%."""
    w = weight_sync(Q06, H200, "100g", density=0.01, anchor_every=1_000_000)
    assert w.full.bytes == pytest.approx(1.2e9, rel=0.02)
    assert 20e6 <= w.delta.bytes <= 36e6
    assert w.delta.bytes == pytest.approx(Q06.params() * 0.01 * 6)
    assert w.ratio(w.delta) == pytest.approx(100 / 3)
    at2 = weight_sync(Q06, H200, "100g", density=0.02)
    assert at2.ratio(at2.delta) == pytest.approx(50 / 3)
    assert w.delta.transfer_s == pytest.approx(w.full.transfer_s * w.delta.bytes / w.full.bytes)


def test_a_full_push_every_n_steps_averages_bytes_and_seconds():
    """(full + (N - 1) delta) / N: at 1% with a full push every 20 steps 12.7x fewer bytes, every 30 16x."""
    w = weight_sync(Q8, H200, "400g", density=0.01, anchor_every=20)
    assert w.anchored.bytes == pytest.approx((w.full.bytes + 19 * w.delta.bytes) / 20)
    assert w.anchored.seconds == pytest.approx((w.full.seconds + 19 * w.delta.seconds) / 20)
    assert w.ratio(w.anchored) == pytest.approx(20 / (1 + 19 * 0.03))
    assert w.ratio(w.anchored) == pytest.approx(12.7, abs=0.05)
    w30 = weight_sync(Q8, H200, "400g", density=0.01, anchor_every=30)
    assert w30.ratio(w30.anchored) == pytest.approx(16.0, abs=0.1)
    assert anchored(10.0, 1.0, 1) == 10.0


@pytest.mark.parametrize("policy,tp", [(Q8, 1), (A3B, 1), (A22B, 8)], ids=["8b", "30b-a3b", "235b-a22b"])
@pytest.mark.parametrize("link", sorted(LINKS))
def test_a_delta_is_faster_than_a_full_push_on_every_link(policy, tp, link):
    w = weight_sync(policy, H200, link, tp=tp, step_s=200.0)
    assert w.delta.seconds < w.anchored.seconds < w.full.seconds
    assert w.delta.share < w.anchored.share < w.full.share < 1
    assert w.full.share == pytest.approx(w.full.seconds / (200.0 + w.full.seconds))


def test_links_build_on_the_push_paths():
    """400 Gb/s is the H100/H200 profiles' NIC (PUSH_PATHS' "link"), NVLink the profile's link_bw; a push path name
    prices the full push as rl.push_seconds does; a full push's apply is the engines' swap pause."""
    assert weight_sync(Q8, H200, "400g").full.transfer_s == pytest.approx(push_seconds(Q8, H200, 1, "link"))
    assert weight_sync(Q8, H200, "nvlink").full.transfer_s == pytest.approx(Q8.params() * 2 / 450e9)
    gb200 = hardware.GB200
    assert weight_sync(Q8, gb200, "nvlink").full.transfer_s == pytest.approx(Q8.params() * 2 / 900e9)
    assert weight_sync(A22B, H200, "nccl", tp=8).full.transfer_s == pytest.approx(push_seconds(A22B, H200, 8, "nccl"))
    assert weight_sync(A22B, H200, "100g", tp=8).full.apply_s == pytest.approx(swap_seconds(A22B, H200, 8))


def test_applying_a_delta_is_a_scatter_on_a_gpu_and_a_full_repack_on_the_cpu():
    gpu = weight_sync(A22B, H200, "100g", tp=8)
    assert gpu.delta.apply_s < gpu.full.apply_s
    at2 = weight_sync(A22B, H200, "100g", tp=8, density=0.02)
    assert at2.delta.apply_s > gpu.delta.apply_s           # more changed elements, a longer scatter
    cpu = replace(H200, name="cpu", fit=None)
    w = weight_sync(Q06, cpu, "100g")
    assert w.delta.apply_s == pytest.approx(w.full.apply_s)


def test_the_docs_table_is_what_the_code_prints():
    """docs/projections.md's weight-sync table is perf/projections.py --weight-sync's, row for row."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        perf_module("projections").weight_sync_main()
    table = [line for line in out.getvalue().splitlines() if line.startswith("|")]
    doc = (ROOT / "docs" / "projections.md").read_text().splitlines()
    start = doc.index(table[0])
    assert doc[start:start + len(table)] == table
