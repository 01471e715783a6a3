"""The GRPO trainer adapting an EAGLE-3 head online against a real speculative service on the tiny model: the head
(trained in seconds with prepare-drafter's code) learns from the trainer's own forward passes and is pushed with
UpdateDraft in the format the service loaded (its float tensors; d2t stays), and the service measures the new
drafter version's acceptance afresh (GetStatus: per-version speculation stats, the k controller's re-measurement)."""
import json
import time

import pytest

from rollout_client import RolloutClient
from tests.integration.services import running_service
from trainer_example.train import main as train_main

PROMPTS = [[1, 504, 3458, 314, 260], [1, 1046, 2683, 77, 8, 9]]


@pytest.fixture(scope="module")
def eagle3_service(tiny_model, eagle3_head, tmp_path_factory):
    with running_service(tiny_model, tmp_path_factory.mktemp("logs") / "grpo-eagle3.log", "--speculation", "eagle3",
                         "--draft-model", str(eagle3_head), "--num-speculative-tokens", "2") as svc, \
            RolloutClient(svc.target) as c:
        yield svc, c


def run_trainer(svc, head, out, *extra):
    args = ["--target", svc.target, "--model", str(svc.model), "--drafter", str(head), "--out", str(out),
            "--prompts", "3", "--group-size", "3", "--max-tokens", "24", "--eval-size", "4", "--eval-every", "100",
            "--micro-batch", "3", "--adapt-drafter", "--draft-every", "1", "--head-batch", "4", *extra]
    assert train_main(args) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def remeasured(c, version):
    """Generate with the drafter at `version` and return GetStatus once its acceptance is measured."""
    list(c.generate(PROMPTS, n=8, max_tokens=32, ignore_eos=True, temperature=1.0))
    deadline = time.monotonic() + 15
    while True:
        st = c.status()          # the supervisor copies the engines' controller state every second
        if st.k_control.draft_version == version and st.k_control.acceptance or time.monotonic() > deadline:
            return st
        time.sleep(0.5)


def test_sync_steps_adapt_the_head_and_the_service_measures_each_version(eagle3_service, eagle3_head, tmp_path):
    svc, c = eagle3_service
    before = c.status()
    assert before.speculation_method == "eagle3"
    rows = run_trainer(svc, eagle3_head, tmp_path / "sync", "--mode", "sync", "--steps", "2")
    assert [r["step"] for r in rows] == [0, 1]
    saved = tmp_path / "sync"                         # --save-final (the default): the policy and its head
    assert (saved / "policy" / "config.json").exists() and (saved / "eagle3-head" / "model.safetensors").exists()
    for r in rows:
        assert 0 < r["head_samples"] <= r["samples"] and r["head_train_s"] > 0 and r["head_collect_s"] > 0
        assert r["adapt_s"] >= r["head_train_s"] and r["draft_push_s"] > 0
        assert r["head_loss_first"] > 0 and len(r["head_expected_acceptance"]) == 2     # k = 2 draft steps
    assert [r["draft_pushed"] for r in rows] == [before.draft_version + 1, before.draft_version + 2]
    assert rows[1]["draft_versions"] == [before.draft_version + 1]    # step 1 generated with the adapted head
    after = c.status()
    assert after.draft_version == before.draft_version + 2 and after.policy_version == before.policy_version + 2
    st = remeasured(c, after.draft_version)
    assert st.k_control.mode == "auto" and st.k_control.draft_version == after.draft_version, st.k_control
    assert len(st.k_control.acceptance) == 2, st.k_control                # measured afresh for this version
    mine = [s for s in st.speculation if s.draft_version == after.draft_version]
    assert mine and sum(s.num_drafted for s in mine) > 0, st.speculation


def test_async_steps_push_the_head_trained_in_the_background(eagle3_service, eagle3_head, tmp_path):
    svc, c = eagle3_service
    before = c.status()
    rows = run_trainer(svc, eagle3_head, tmp_path / "async", "--mode", "async", "--steps", "3",
                       "--weight-sync", "push")
    # step 0 hands its samples to the thread (nothing to push yet); steps 1, 2 push the previous step's head
    assert "head_train_s" not in rows[0] and "draft_pushed" not in rows[0]
    assert [r["draft_pushed"] for r in rows[1:]] == [before.draft_version + 1, before.draft_version + 2]
    assert all(r["head_train_s"] > 0 and r["head_samples"] > 0 for r in rows[1:])
    assert c.status().draft_version == before.draft_version + 2
