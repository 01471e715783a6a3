"""The bundled GRPO trainer, one sync and one async run end to end through a real speculative service on
the tiny model: weights pushed every step (sync over the weight-transfer group, async as PushWeights), versions
advance, no sample staler than --max-lag is used, the trainer's recomputed log-probs agree with the service's, the
drafter is adapted and its update accepted."""
import json
import math

import pytest

from rollout_client import RolloutClient
from tests.integration.services import running_service
from trainer_example.drafter import build_initial_drafter
from trainer_example.train import main as train_main


@pytest.fixture(scope="module")
def grpo_service(tiny_model, tmp_path_factory):
    drafter = build_initial_drafter(str(tiny_model), tmp_path_factory.mktemp("drafters") / "init", layers=1)
    with running_service(tiny_model, tmp_path_factory.mktemp("logs") / "grpo.log", "--speculation", "draft_model",
                         "--draft-model", str(drafter), "--num-speculative-tokens", "2") as svc, \
            RolloutClient(svc.target) as c:
        yield svc, c, drafter


def run_trainer(svc, drafter, out, *extra):
    args = ["--target", svc.target, "--model", str(svc.model), "--drafter", str(drafter), "--out", str(out),
            "--prompts", "3", "--group-size", "3", "--max-tokens", "24", "--eval-size", "4", "--eval-every", "100",
            "--micro-batch", "3", "--draft-every", "1", *extra]
    assert train_main(args) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def check_rows(rows, steps, start_version):
    assert [r["step"] for r in rows] == list(range(steps))
    assert [r["policy_version"] for r in rows] == list(range(start_version, start_version + steps))
    for r in rows:
        assert r["samples"] + r["dropped_stale"] == 9
        assert math.isfinite(r["loss"]) and math.isfinite(r["kl_to_start"]) and r["kl_to_start"] >= 0
        # The trainer's pi_old and the service's rollout log-probs describe the same distribution: the
        # importance weights sit at 1 (a misaligned batch or a stale push would put them far off).
        if r["max_lag_used"] == 0:
            assert abs(r["is_weight_mean"] - 1) < 0.02 and r["is_truncated_fraction"] == 0
        assert r["drafter_kl"] > 0
        assert r["k_mode"] == "auto", r     # the service chooses k per engine step (the default)
    # GetStatus reported the engine steps by k run while a step generated (async: generation may have finished
    # before the step began), and each new drafter version is measured by drafting, so samples carry acceptance
    assert any(sum(r["k_steps"]) > 0 and 0 <= r["k_mean"] <= 2 for r in rows), rows
    assert any(r["acceptance_rate"] is not None for r in rows)
    assert rows[-1]["eval_accuracy"] is not None


def test_sync_step_pushes_policy_and_drafter(grpo_service, tmp_path):
    svc, c, drafter = grpo_service
    before = c.status()
    # --weight-delta on (auto is off on this float32 service): the anchor over the group, then a delta stream
    rows = run_trainer(svc, drafter, tmp_path / "sync", "--mode", "sync", "--steps", "2", "--weight-delta", "on")
    check_rows(rows, 2, before.policy_version)
    assert all(r["max_lag_used"] == 0 and r["dropped_stale"] == 0 for r in rows)
    assert all(r["push_path"] == "transfer" for r in rows)          # the default: the weight-transfer group
    assert [r["push_kind"] for r in rows] == ["full", "delta"] and rows[1]["push_bytes"] < rows[0]["push_bytes"]
    assert c.status().policy_fingerprint                            # the served weights' fingerprint
    after = c.status()
    assert after.policy_version == before.policy_version + 2
    assert after.draft_version == before.draft_version + 2          # --draft-every 1
    assert rows[1]["draft_versions"] == [before.draft_version + 1]  # step 1's samples used the pushed drafter
    assert any(s.draft_version == after.draft_version for s in after.speculation)


def test_async_steps_never_use_samples_older_than_the_lag(grpo_service, tmp_path):
    svc, c, drafter = grpo_service
    before = c.status()
    rows = run_trainer(svc, drafter, tmp_path / "async", "--mode", "async", "--steps", "3", "--max-lag", "1",
                       "--weight-sync", "push")
    check_rows(rows, 3, before.policy_version)
    assert all(r["push_path"] == "push" for r in rows)
    assert all(r["max_lag_used"] <= 1 for r in rows)
    assert any(r["max_lag_used"] == 1 for r in rows[1:])     # generation really overlapped training
    assert c.status().policy_version == before.policy_version + 3


def test_drafter_weights_travel_over_the_transfer_group(grpo_service):
    """TransferWeights with the drafter as target: its own version, the policy's unchanged, and a drafter tensor of
    the wrong shape refused naming it."""
    import grpc
    import torch
    from rollout_client.transfer import WeightSync
    from safetensors.torch import load_file

    svc, c, drafter = grpo_service
    before = c.status()
    state = {k: v + 0.01 for k, v in load_file(str(next(drafter.glob("*.safetensors")))).items()}
    sync = WeightSync(c, timeout_s=30)
    sync.connect(timeout=120)
    try:
        name = next(iter(state))
        with pytest.raises(grpc.RpcError) as e:
            sync.push(dict(state) | {name: torch.zeros(2, 2)}, before.draft_version + 1, target="drafter")
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name in e.value.details()
        r = sync.push(state, before.draft_version + 1, target="drafter")
        assert r.target == "drafter" and r.version == before.draft_version + 1
        after = c.status()
        assert after.draft_version == before.draft_version + 1 and after.policy_version == before.policy_version
    finally:
        sync.close()
