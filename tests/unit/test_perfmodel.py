"""The performance model (rollout_service/perfmodel): pure Python, no vLLM."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from rollout_service.perfmodel import acceptance, hardware, model
from rollout_service.perfmodel.rl import rl_step
from rollout_service.perfmodel.rollout import Engine, drain, lognormal_lengths, mean_length
from rollout_service.perfmodel.step import Drafter, forward, spec_step

Q8 = model.load("qwen3-8b")
HEAD = model.load("qwen3-8b-eagle3")


def test_shipped_configs_match_the_model_cards():
    assert Q8.params() == pytest.approx(8.19e9, rel=0.01)
    moe = model.load("qwen3-235b-a22b")
    assert moe.params() == pytest.approx(235e9, rel=0.01)
    assert moe.active_params() == pytest.approx(22e9, rel=0.05)
    assert HEAD.eagle3 and HEAD.params() < 0.06 * Q8.params()


def test_moe_reads_more_experts_for_more_tokens():
    moe = model.load("qwen3-235b-a22b")
    one, four, many = (moe.weight_bytes_read(t, 2) for t in (1, 4, 4096))
    assert one < four < many <= moe.params() * 2


def test_roofline_memory_bound_small_batch_compute_bound_large():
    hw = hardware.H100_SXM
    assert forward(Q8, hw, 1, 1, 512).bound == "memory"
    assert forward(Q8, hw, 64, 8, 512).bound == "compute"
    # below the ridge a verify of k + 1 tokens costs about one plain step
    assert forward(Q8, hw, 1, 4, 512).seconds < 1.05 * forward(Q8, hw, 1, 1, 512).seconds


def test_tensor_parallel_adds_all_reduces_and_splits_the_weights():
    hw = hardware.GB200
    one, eight = forward(Q8, hw, 1, 1, 512, tp=1), forward(Q8, hw, 1, 1, 512, tp=8)
    assert eight.comm_s > 0 and eight.memory_s == pytest.approx(one.memory_s / 8, rel=1e-6)


def compute_bound_profile():
    """A device with plenty of bandwidth and little compute: verifying costs ~k + 1 steps at large batch."""
    return replace(hardware.H100_SXM, name="slow", flops=50e12)


def test_speedup_falls_with_batch_on_a_compute_bound_profile():
    eng = Engine(Q8, compute_bound_profile(), Drafter("eagle3", HEAD), [0.7], tp=1)
    s = [eng.speedup(b, 3, 512) for b in (1, 8, 32, 128)]
    assert s == sorted(s, reverse=True) and s[-1] < 1.0 < s[0]


def test_best_k_shrinks_as_the_batch_grows():
    eng = Engine(Q8, compute_bound_profile(), Drafter("eagle3", HEAD), [0.7], tp=1)
    ks = [eng.best_k(b, 512, 7) for b in (1, 8, 32, 128)]
    assert ks == sorted(ks, reverse=True) and ks[0] > ks[-1]
    assert ks[-1] == 0                     # drafting does not pay there at all


def test_mean_length_and_acceptance_sources(tmp_path):
    assert mean_length([0.5], 3) == pytest.approx(1.875)
    assert mean_length([0.8, 0.5], 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)
    assert acceptance.parse("0.7,0.6,0.55") == [0.7, 0.6, 0.55]
    assert acceptance.conditional([0.6, 0.3]) == pytest.approx([0.6, 0.5])
    p = tmp_path / "metrics.jsonl"
    p.write_text("\n".join(json.dumps({"step": i, "draft_acceptance": [0.5 + i / 10, 0.4]}) for i in range(3)))
    assert acceptance.from_metrics(p) == pytest.approx([0.6, 0.4])


def test_draining_batch_and_the_long_tail():
    lengths = lognormal_lengths(256, 1000, 1.0, 8000)
    assert max(lengths) == 8000 and sorted(lengths)[128] < 1000        # median below mean: a long tail
    eng = Engine(Q8, hardware.GB200, Drafter("eagle3", HEAD), [0.65])
    plain = Engine(Q8, hardware.GB200)
    off, auto = drain(plain, lengths, 256, 256, 0), drain(eng, lengths, 256, 256, "auto")
    assert off.tokens == auto.tokens == sum(lengths)
    assert auto.seconds < off.seconds and auto.steps < off.steps


def test_async_step_is_never_slower_than_sync():
    for gen_drain, gen_full, train in ((60, 20, 25), (10, 9, 100), (5, 5, 5)):
        sync = rl_step("sync", gen_drain, gen_full, train, 1.0)
        asy = rl_step("async", gen_drain, gen_full, train, 1.0, pause_s=0.0, max_lag=2)
        assert asy.step_s <= sync.step_s


def test_cpu_profile_is_fitted_from_a_calibration_file(tmp_path):
    p = tmp_path / "cal.json"
    p.write_text(json.dumps({"date": "x", "fit": {"mem_bw": 2e10, "flops": 1e11, "overhead_s": 0.03,
                                                   "draft_steps": {"eagle3": [0.01, 0.001]},
                                                   "k0_overhead": {"draft_model": 0.15}}}))
    hw = hardware.get("cpu", p)
    assert hw.overhead_s == 0.03 and hw.draft_steps["eagle3"] == (0.01, 0.001)
    # a step without drafts costs what was measured at k = 0: 15% over plain for the draft model, nothing for
    # a method not measured (no k0_steps), and k0_steps drafter steps where the calibration is silent
    plain = spec_step(Q8, None, hw, 8, 0, 512)
    assert spec_step(Q8, Drafter("draft_model"), hw, 8, 0, 512) == pytest.approx(plain * 1.15)
    assert spec_step(Q8, Drafter("ngram"), hw, 8, 0, 512) == pytest.approx(plain)
    assert spec_step(Q8, Drafter("eagle3", k0_steps=1), hw, 8, 0, 512) == pytest.approx(plain + 0.01 + 0.008)
    with pytest.raises(SystemExit):
        hardware.get("cpu", tmp_path / "missing.json")


def test_cli_simulate_prints_a_table_and_writes_json(tmp_path):
    out = tmp_path / "sim.json"
    r = subprocess.run([sys.executable, "-m", "rollout_service.cli", "simulate", "--hardware", "gb200",
                        "--policy-config", str(model.CONFIGS / "qwen3-8b.json"), "--drafter-config", "qwen3-8b-eagle3",
                        "--acceptance", "0.7,0.6,0.55", "--json", str(out)], check=False, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "best k" in r.stdout and "RL step" in r.stdout
    data = json.loads(out.read_text())
    assert data["hardware"]["name"] == "gb200" and data["acceptance"]["per_position"] == [0.7, 0.6, 0.55]
    assert {row["concurrency"] for row in data["by_concurrency"]} >= {1, 256}
    assert data["rollout"]["auto"]["speedup"] > 1.0


def test_from_status_prefers_the_controller_and_falls_back_to_speculation_stats(monkeypatch):
    import types

    import rollout_client

    def fake_client(k_acc, per_pos):
        status = types.SimpleNamespace(k_control=types.SimpleNamespace(acceptance=k_acc),
                                       speculation=[types.SimpleNamespace(per_position_acceptance=per_pos)])

        class Client:
            def __init__(self, target):
                self.target = target

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def status(self):
                return status
        return Client

    monkeypatch.setattr(rollout_client, "RolloutClient", fake_client([0.7, 0.5], [0.7, 0.35]))
    assert acceptance.from_status("h:1") == [0.7, 0.5]
    monkeypatch.setattr(rollout_client, "RolloutClient", fake_client([], [0.6, 0.3]))
    assert acceptance.from_status("h:1") == pytest.approx([0.6, 0.5])
    monkeypatch.setattr(rollout_client, "RolloutClient", fake_client([], []))
    with pytest.raises(SystemExit):
        acceptance.from_status("h:1")


def test_a_push_is_priced_by_the_path_chosen():
    """8B policy in bf16: the per-device paths split over tensor parallelism, the front end's stream does not;
    nccl's published rate is capped by the NIC."""
    from rollout_service.perfmodel.rl import push_seconds

    policy = Q8
    gb200 = hardware.PROFILES["gb200"]
    nbytes = policy.params() * gb200.bytes_per_param
    assert push_seconds(policy, gb200, 1, "nccl") == pytest.approx(nbytes / 8.25e9)
    assert push_seconds(policy, gb200, 2, "nccl") == pytest.approx(nbytes / 16.5e9)
    assert push_seconds(policy, gb200, 2, "stream") == pytest.approx(nbytes / 0.3e9)
    assert push_seconds(policy, gb200, 1, "link") == pytest.approx(nbytes / gb200.push_bw)
    slow_nic = replace(gb200, push_bw=4e9)
    assert push_seconds(policy, slow_nic, 1, "nccl") == pytest.approx(nbytes / 4e9)
    assert push_seconds(policy, gb200, 1, "ipc") < push_seconds(policy, gb200, 1, "nccl") < \
        push_seconds(policy, gb200, 1, "stream")
