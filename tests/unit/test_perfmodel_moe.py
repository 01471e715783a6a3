"""The performance model's mixtures of experts (perfmodel/moe.py and what reads it): arithmetic only, nothing about
how fast any GPU is."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from rollout_service.perfmodel import hardware, model, moe
from rollout_service.perfmodel.rl import push_seconds
from rollout_service.perfmodel.step import Drafter, device_weight_bytes, forward, spec_step, step_table
from tests.bench_modules import perf_module

ROOT = Path(__file__).resolve().parents[2]
A3B = model.load("qwen3-30b-a3b")
A22B = model.load("qwen3-235b-a22b")
Q8 = model.load("qwen3-8b")
HEAD = model.load("qwen3-8b-eagle3")


def test_distinct_experts_limits():
    assert moe.distinct_experts(128, 8, 0) == 0
    assert moe.distinct_experts(128, 8, 1) == pytest.approx(8)
    assert moe.distinct_experts(128, 8, 10_000) == pytest.approx(128)
    seq = [moe.distinct_experts(128, 8, t) for t in (1, 2, 4, 8, 32, 128, 1024)]
    assert seq == sorted(seq) and seq[-1] <= 128
    # a verify of 4 tokens at one sequence reads ~3.6x the experts of a plain step (E 128, top-8)
    assert moe.distinct_experts(128, 8, 4) / moe.distinct_experts(128, 8, 1) == pytest.approx(3.64, abs=0.01)
    # top-k = E: every expert at once
    assert moe.distinct_experts(8, 8, 1) == 8


def test_active_against_total_parameters_match_the_model_cards():
    assert A3B.params() == pytest.approx(30.5e9, rel=0.01)
    assert A3B.card_active_params() == pytest.approx(3.3e9, rel=0.03)
    assert A22B.params() == pytest.approx(235e9, rel=0.01)
    assert A22B.card_active_params() == pytest.approx(22e9, rel=0.03)
    ds = model.load("deepseek-v3")
    assert ds.params() == pytest.approx(671e9, rel=0.01)
    assert ds.card_active_params() == pytest.approx(37e9, rel=0.03)
    assert (ds.dense_layers, ds.moe_layers(), ds.experts, ds.shared_intermediate) == (3, 58, 256, 2048)
    assert ds.kv_bytes_per_token() == 61 * (512 + 64) * 2          # MLA caches one latent per token and layer
    assert A3B.moe_layers() == 48 and A3B.dense_layers == 0
    assert Q8.moe_layers() == 0 and Q8.card_active_params() == Q8.params()


def test_dense_layers_and_shared_experts_from_the_config():
    base = json.loads((model.CONFIGS / "qwen3-30b-a3b.json").read_text())
    half = model.from_config({**base, "decoder_sparse_step": 2})
    assert (half.dense_layers, half.moe_layers()) == (24, 24)
    only = model.from_config({**base, "mlp_only_layers": [0, 47]})
    assert only.dense_layers == 2
    # a dense layer holds an intermediate_size MLP instead of the experts
    assert A3B.params() - only.params() == 2 * (A3B.mlp_params() - 3 * 2048 * 6144)
    shared = model.from_config({**base, "shared_expert_intermediate_size": 1024})
    assert shared.active_params() - A3B.active_params() == 48 * 3 * 2048 * 1024
    assert shared.weight_bytes_read(1, 2) - A3B.weight_bytes_read(1, 2) == 2 * 48 * 3 * 2048 * 1024
    mixtral = model.from_config({"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                                 "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
                                 "num_local_experts": 8, "num_experts_per_tok": 2})
    assert mixtral.params() == pytest.approx(46.7e9, rel=0.01)          # Mixtral-8x7B: 46.7B
    assert mixtral.card_active_params() == pytest.approx(12.9e9, rel=0.02)


def test_a_verify_pass_reads_more_experts_than_a_plain_step():
    for b in (1, 8, 32):
        plain, verify = A3B.weight_bytes_read(b, 2), A3B.weight_bytes_read(4 * b, 2)
        assert verify > plain                                            # MoE: more experts
        assert Q8.weight_bytes_read(4 * b, 2) == Q8.weight_bytes_read(b, 2)  # dense: the same weights
    # once the batch alone reads every expert, a verify reads no more
    assert A3B.weight_bytes_read(4 * 1024, 2) == pytest.approx(A3B.weight_bytes_read(1024, 2), rel=1e-6)


# the old model's numbers (before perfmodel/moe.py, commit 45decda): a dense config and a MoE one without expert
# parallelism price exactly as before
GOLDEN = [("h200", "qwen3-8b", 1, (1, 1, 512), 0.007488715991251368, 0.0005245297628154115),
          ("h200", "qwen3-8b", 1, (256, 4, 4096), 0.06901440300534673, 0.001783307449826345),
          ("gb200", "qwen3-235b-a22b", 8, (8, 1, 4096), 0.012829670899929986, 0.0003528009467499942)]


@pytest.mark.parametrize("hw_name,policy,tp,cell,seconds,draft", GOLDEN)
def test_dense_configs_and_ep1_price_as_before(hw_name, policy, tp, cell, seconds, draft):
    hw, m = hardware.get(hw_name), model.load(policy)
    row = step_table(m, hw, [cell], Drafter("eagle3", HEAD), tp)["steps"][0]
    assert row["seconds"] == pytest.approx(seconds, rel=1e-12)
    assert row["draft_seconds"] == pytest.approx(draft, rel=1e-12)
    old_spec = [0.0059837153715932975, 0.007755142642104477, 0.006787538764493878, 0.008995224843286015,
                0.012775968108212403, 0.023581794609590204]
    new_spec = [spec_step(Q8, Drafter("eagle3", HEAD), hardware.GB200, b, k, 1000)
                for b in (1, 32, 256) for k in (0, 3)]
    assert new_spec == pytest.approx(old_spec, rel=1e-12)
    # expert parallelism means nothing to a dense model
    assert forward(Q8, hw, 8, 4, 512, 1, ep=8).seconds == forward(Q8, hw, 8, 4, 512, 1).seconds


def test_expected_maximum_of_binomials():
    assert moe.normal_max(1) == 0 and moe.normal_max(2) == pytest.approx(1 / 3.141592653589793 ** 0.5, rel=1e-3)
    assert moe.expected_max_binomial(16, 0.3, 1) == pytest.approx(4.8)
    assert moe.expected_max_binomial(16, 1.0, 8) == 16
    m = [moe.expected_max_binomial(16, 0.3, g) for g in (1, 2, 8, 72)]
    assert m == sorted(m) and m[-1] <= 16
    # exact small case: two fair coins, max of two = P(any 1) = 3/4
    assert moe.expected_max_binomial(1, 0.5, 2) == pytest.approx(0.75)
    big = moe.expected_max_binomial(100_000, 0.01, 8)                   # normal branch: mean + sd x E[max of 8]
    assert big == pytest.approx(1000 + (100_000 * 0.01 * 0.99) ** 0.5 * moe.normal_max(8), rel=1e-9)


def test_expert_parallelism_busiest_device_and_all_to_all():
    one = moe.busiest_device(128, 8, 64, 1)
    assert one.experts_read == pytest.approx(moe.distinct_experts(128, 8, 64)) and one.rows == 64 * 8
    for ep in (8, 72):
        d = moe.busiest_device(128, 8, 64, ep)
        local = moe.experts_per_device(128, ep)
        assert moe.distinct_experts(128, 8, 64) / ep <= d.experts_read <= local     # at least the mean share
        assert 64 * 8 / ep <= d.rows <= 64 * 8
    assert moe.experts_per_device(128, 72) == 2 and moe.fanout(8, 1) == 0
    assert moe.fanout(8, 72) == pytest.approx(71 * (1 - (71 / 72) ** 8))
    hw = hardware.GB200
    a2a = [moe.all_to_all_seconds(2048, 8, 48, t, 8, hw.link_bw, hw.push_bw, hw.nvlink_domain) for t in (64, 128)]
    lat = 48 * 2 * moe.A2A_LATENCY_S
    assert a2a[1] - lat == pytest.approx(2 * (a2a[0] - lat))                         # bytes grow with tokens
    per_way = 64 / 8 * moe.fanout(8, 8) * 2048 * 2
    assert a2a[0] == pytest.approx(48 * 2 * (per_way / (hw.link_bw * moe.A2A_EFFICIENCY) + moe.A2A_LATENCY_S))
    inside = moe.all_to_all_seconds(2048, 8, 48, 4096, 64, hw.link_bw, hw.push_bw, 72)
    outside = moe.all_to_all_seconds(2048, 8, 48, 4096, 64, hw.link_bw, hw.push_bw, 8)
    assert outside > inside                                                          # the NIC beyond NVLink


def test_forward_with_expert_parallelism():
    hw = hardware.GB200
    tp1 = forward(A22B, hw, 64, 1, 1000, 8)                                          # ep = tp: priced as tp
    assert forward(A22B, hw, 64, 1, 1000, 8, ep=8).seconds == tp1.seconds
    wide = forward(A22B, hw, 64 * 8, 1, 1000, 1, ep=8)                               # DP-attention 8 x EP 8
    assert wide.comm_s > 0                                                           # all-to-alls, no all-reduce
    assert wide.comm_s == pytest.approx(moe.all_to_all_seconds(4096, 8, 94, 512, 8, hw.link_bw, hw.push_bw, 72))
    # every device reads the whole dense part (tp 1) and its busiest share of experts
    load = moe.busiest_device(128, 8, 512, 8)
    weights = (A22B.always_read_params() + 94 * load.experts_read * A22B.expert_params()) * hw.bytes_per_param
    kv = A22B.kv_bytes_per_token() * 512 * 1001 / 8
    assert wide.memory_s == pytest.approx((weights + kv) / (hw.mem_bw * hw.mem_eff))
    # the device holds its 16 experts and all the rest
    held = device_weight_bytes(A22B, 2, 1, 8)
    assert held == pytest.approx((A22B.params() - A22B.total_expert_params() + A22B.total_expert_params() / 8) * 2)
    assert device_weight_bytes(A22B, 2, 8, 1) == pytest.approx(A22B.params() * 2 / 8)
    assert push_seconds(A22B, hw, 1, "link", ep=8) == pytest.approx(held / hw.push_bw)
    with pytest.raises(SystemExit):
        forward(A22B, hw, 8, 1, 100, 4, ep=6)


def simulate_cli(*args):
    return subprocess.run([sys.executable, "-m", "rollout_service.cli", "simulate", *args], check=False,
                          capture_output=True, text=True, timeout=120)


def test_simulate_projects_a_moe_policy_with_expert_parallelism(tmp_path):
    out = tmp_path / "sim.json"
    r = simulate_cli("--hardware", "gb200", "--policy-config", "qwen3-235b-a22b", "--drafter-config",
                     "qwen3-8b-eagle3", "--acceptance", "0.62", "--tp", "1", "--ep", "8", "--prompts", "32",
                     "--group", "8", "--engines", "2", "--concurrency", "8,512", "--k-max", "4", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "ep 8: 8 devices per engine" in r.stdout
    data = json.loads(out.read_text())
    assert data["policy"]["devices"] == 8 and data["policy"]["moe_layers"] == 94 and data["train_gpus"] == 16
    for row in data["by_concurrency"]:
        read = row["experts_read"]
        assert read[0] == pytest.approx(moe.distinct_experts(128, 8, row["concurrency"]), abs=0.05)
        assert read == sorted(read) and read[-1] <= 128
    steps = simulate_cli("--hardware", "gb200", "--policy-config", "qwen3-30b-a3b", "--tp", "1", "--ep", "4",
                         "--step-table", "4:1:512,4:4:512", "--json", "-")
    assert steps.returncode == 0, steps.stderr
    s = json.loads(steps.stdout)["steps"]
    assert s[0]["seconds"] == pytest.approx(forward(A3B, hardware.GB200, 4, 1, 512, 1, ep=4).seconds)


def test_moe_step_probe_smoke_writes_a_file_the_fit_reads(tmp_path):
    pytest.importorskip("torch")
    from rollout_service.perfmodel import fit

    out = tmp_path / "moe.json"
    r = subprocess.run([sys.executable, str(ROOT / "perf" / "moe_step_probe.py"), "--smoke", "--no-env",
                        "--batches", "1,4", "--widths", "1,3", "--out", str(out)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    data = json.loads(out.read_text())
    shape = data["target_shape"]
    assert {c["width"] for c in data["cells"]} == {1, 3} and {c["batch"] for c in data["cells"]} == {1, 4}
    for c in data["cells"] + data["moe"]:
        tokens = c["batch"] * c["width"]
        assert 0 < c["seconds"] and c["experts_read"] <= min(
            shape["experts"], tokens * shape["experts_per_tok"])
        assert c["expected"] == pytest.approx(moe.distinct_experts(shape["experts"], shape["experts_per_tok"], tokens),
                                              abs=0.01)
    probe = fit.read(out)
    m = probe.cells[0].model
    assert (m.experts, m.experts_per_tok, m.expert_intermediate) == (16, 2, 32)


def test_grouped_and_looped_experts_agree():
    torch = pytest.importorskip("torch")
    probe = perf_module("moe_step_probe")
    torch.manual_seed(0)
    grouped = probe.MoEStack(probe.TINY, "cpu", torch.float32, probe.pick_impl("auto", "cpu", torch.float32))
    looped = replace_impl(probe, grouped, "loop")
    x = torch.randn(12, probe.TINY["hidden"])
    with torch.no_grad():
        a, b = grouped.moe(x, grouped.layers[0]), looped.moe(x, grouped.layers[0])
    assert torch.allclose(a, b, atol=1e-6)


def replace_impl(probe, stack, impl):
    other = probe.MoEStack.__new__(probe.MoEStack)
    other.__dict__.update(stack.__dict__)
    other.impl = impl
    return other


def test_b200_and_nvlink_domains():
    assert hardware.get("b200").mem_bw == 8e12 and hardware.get("b200").nvlink_domain == 8
    assert hardware.GB200.nvlink_domain == 72 and hardware.H100_SXM.nvlink_domain == 8
    assert replace(hardware.GB200, nvlink_domain=8).nvlink_domain == 8
