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
    # far below the ridge a verify of k + 1 tokens costs about one plain step (an H200 measured 1.10 at k = 3)
    assert forward(Q8, hw, 1, 4, 512).seconds < 1.15 * forward(Q8, hw, 1, 1, 512).seconds


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


# ---- GPU steps (issue 31): the form fitted to measured H200 steps ---------------------------------------------
ROOT = model.CONFIGS.parents[2]
REFERENCE = ROOT.parent / "shared" / "reference" / "h200-steps.json"      # the shared reference, where present
PROBE = ROOT / "bench" / "results" / "gpu_step_probe_h200.json"             # the same grid, probed here (committed)
HELD_OUT = [ROOT / "bench" / "results" / f"gpu_step_probe_h200_{x}.json" for x in ("heldout", "qwen3-14b")]


def ratio_errors(r):
    return sorted(abs(x["error"]) for x in r["ratios"] + r["drafter"])


@pytest.mark.parametrize("path", [REFERENCE, PROBE], ids=["shared reference", "committed probe"])
def test_fitted_model_meets_the_goals_on_measured_h200_steps(path):
    """Issue 31: T(w)/T(1) and drafter/target step ratios within 5% at the median and 15% at most, under the
    file's own efficiency (the profile fitted to it)."""
    from statistics import median

    from rollout_service.perfmodel import fit

    if not path.exists():
        pytest.skip(f"{path} is not on this machine")
    probe = fit.read(path)
    r = fit.comparisons(probe, fit.fit(probe))
    errs = ratio_errors(r)
    assert len(r["ratios"]) == 64 and len(r["drafter"]) == 32
    assert median(errs) <= 0.05 and max(errs) <= 0.15, (median(errs), max(errs))
    assert median(abs(x["error"]) for x in r["steps"]) <= 0.05


def test_the_form_predicts_held_out_batches_contexts_and_shapes():
    """Fitted to one grid (Qwen3-8B, batch 1-256, context 512/2048), the form predicts other batches (3-192),
    contexts (1024, 4096) and a Qwen3-14B shape measured on the same H200, without refitting."""
    from statistics import median

    from rollout_service.perfmodel import fit

    hw = fit.from_probe(REFERENCE if REFERENCE.exists() else PROBE)
    for path in HELD_OUT:
        errs = ratio_errors(fit.comparisons(fit.read(path), hw))
        assert median(errs) <= 0.05 and max(errs) <= 0.15, (path.name, median(errs), max(errs))


def test_shipped_gpu_constants_are_the_fit_of_the_shared_reference():
    from rollout_service.perfmodel import fit

    if not REFERENCE.exists():
        pytest.skip(f"{REFERENCE} is not on this machine")
    hw = fit.from_probe(REFERENCE, datasheet="h200")
    g = hardware.GPU_FIT
    assert hw.mem_eff == pytest.approx(hardware.H200.mem_eff, abs=0.005)
    assert hw.flop_eff == pytest.approx(hardware.H200.flop_eff, abs=0.005)
    assert hw.fit.layer_s == pytest.approx(g.layer_s, rel=0.02)
    assert hw.fit.verify_layer_s == pytest.approx(g.verify_layer_s, rel=0.05)
    assert hw.fit.overlap == pytest.approx(g.overlap, abs=0.01)
    assert hw.fit.sampler_passes == pytest.approx(g.sampler_passes, rel=0.02)


def test_gpu_profiles_share_the_fitted_form_and_cite_datasheets():
    h200 = hardware.get("h200")
    assert (h200.mem_bw, h200.flops, h200.mem_bytes) == (4.8e12, 989e12, 141e9) and "datasheet" in h200.source
    for name in ("h100", "h200", "gb200"):
        assert hardware.get(name).fit is hardware.GPU_FIT
    assert "h200-steps.json" in hardware.GPU_FIT.source
    assert hardware.GPU_FIT.attn_cta_bw is None           # vLLM's decode attention splits the cache


def test_a_verify_step_costs_more_gradually_than_the_sharp_roofline():
    """H200 measured: a width-2..5 step costs 5-10% more than a plain one at small batch, and the cost rises from
    about 64 tokens per step (the sharp roofline said 1.00 up to ~200 tokens, then jumped)."""
    hw = hardware.H200
    one = forward(Q8, hw, 1, 1, 512).seconds
    assert 1.03 < forward(Q8, hw, 1, 4, 512).seconds / one < 1.15
    r = [forward(Q8, hw, b, 5, 512).seconds / forward(Q8, hw, b, 1, 512).seconds for b in (8, 32, 64, 128, 256)]
    assert r == sorted(r) and r[0] < 1.15 and 1.3 < r[2] < 2.0 and r[-1] > 2.3


def test_cpu_profile_keeps_the_plain_roofline():
    """The CPU profile (fit None) prices a step exactly as before issue 31: overhead + max(bytes, FLOPs)."""
    cal = ROOT / "bench" / "results" / "cpu_calibration.json"
    hw = hardware.cpu_from_calibration(cal)
    assert hw.fit is None
    m = model.from_config(json.loads(cal.read_text())["model_config"])
    for b, w, n in ((1, 1, 100), (16, 4, 300), (64, 1, 900), (8, 8, 2000)):
        t = b * w
        mem = ((m.weight_bytes_read(t, hw.bytes_per_param) + m.kv_bytes_per_token() * b * (n + w))
               / (hw.mem_bw * hw.mem_eff))
        comp = m.flops(t, n + w / 2) / (hw.flops * hw.flop_eff)
        assert forward(m, hw, b, w, n).seconds == pytest.approx(max(mem, comp) + hw.overhead_s, rel=1e-12)
    assert spec_step(m, None, hw, 8, 0, 300) == pytest.approx(forward(m, hw, 8, 1, 300).seconds, rel=1e-12)


def test_gpu_engine_steps_pay_for_sampling_their_rows():
    from rollout_service.perfmodel.step import sample_seconds

    hw = hardware.H200
    plain = spec_step(Q8, None, hw, 64, 0, 512)
    assert plain == pytest.approx(forward(Q8, hw, 64, 1, 512).seconds + sample_seconds(Q8, hw, 64))
    assert sample_seconds(Q8, hw, 256) == pytest.approx(4 * sample_seconds(Q8, hw, 64))
    # the reference's sampler: 1024 rows of 151,936 float32 logits took 2.06 ms on the H200
    assert 1.5e-3 < sample_seconds(Q8, hw, 1024) < 2.5e-3


def simulate_cli(*args):
    return subprocess.run([sys.executable, "-m", "rollout_service.cli", "simulate", *args], check=False,
                          capture_output=True, text=True, timeout=60)


def test_step_table_prints_the_steps_as_json():
    r = simulate_cli("--hardware", "h200", "--policy-config", "qwen3-8b", "--drafter-config", "qwen3-8b-eagle3",
                     "--step-table", "1:1:512,64:4:2048,256:5:512", "--json", "-")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert list(data) == ["steps"] and len(data["steps"]) == 3
    for row, (b, w, n) in zip(data["steps"], ((1, 1, 512), (64, 4, 2048), (256, 5, 512))):
        assert set(row) == {"batch", "width", "context", "seconds", "draft_seconds"}
        assert (row["batch"], row["width"], row["context"]) == (b, w, n)
        assert 0 < row["draft_seconds"] < row["seconds"]
    assert data["steps"][0]["seconds"] == pytest.approx(forward(Q8, hardware.H200, 1, 1, 512).seconds)
    plain = simulate_cli("--hardware", "h100", "--policy-config", "qwen3-8b", "--step-table", "8:2:1024", "--json", "-")
    assert plain.returncode == 0 and set(json.loads(plain.stdout)["steps"][0]) == {"batch", "width", "context",
                                                                                  "seconds"}
    bad = simulate_cli("--hardware", "h100", "--policy-config", "qwen3-8b", "--step-table", "8:2")
    assert bad.returncode != 0 and "BATCH:WIDTH:CONTEXT" in bad.stderr


def test_hardware_from_a_probe_file_fits_that_gpu():
    r = simulate_cli("--hardware-from", str(PROBE), "--policy-config", "qwen3-8b", "--drafter-config",
                     "qwen3-0.6b", "--step-table", "1:1:512,256:5:512,64:1:2048", "--json", "-")
    assert r.returncode == 0, r.stderr
    got = [x["seconds"] for x in json.loads(r.stdout)["steps"]]
    meas = {(c["batch"], c["width"], c["context"]): c["seconds"] for c in json.loads(PROBE.read_text())["cells"]}
    for s, key in zip(got, ((1, 1, 512), (256, 5, 512), (64, 1, 2048))):
        assert s == pytest.approx(meas[key], rel=0.15)
