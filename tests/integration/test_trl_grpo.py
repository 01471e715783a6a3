"""TRL's GRPO trainer (TRL 1.16: GRPOTrainer with use_vllm=True, vllm_mode="server") with the shared service as its
vLLM server, as bench/trl_grpo.py runs it (issue 44 item 3): TRL's own VLLMClient generates through the vLLM dialect
(/v1/completions with token ids and log-probs) and syncs the weights over vLLM's weight-transfer endpoints on gloo,
with only rollout_client.trl_gloo's CPU swaps (docs/frameworks.md). TRL comes with scripts/install.sh; the test
skips without it."""
import importlib.util

import httpx
import pytest
import torch

from tests.bench_modules import bench_module
from tests.integration.test_weights import assert_serves

pytestmark = pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                                reason="trl is not installed (scripts/install.sh installs trl==1.16.0)")


def test_a_trl_grpo_step_with_the_service_as_its_vllm_server(service, client, policy, monkeypatch, tmp_path):
    """One optimizer step: TRL pushes its weights first (the service then serves version v0 + 1), generates 2 x 2
    completions, scores them (rollout_tasks' brevity reward, which differs between completions, so the step has a
    gradient) and trains. TRL's own check of the served log-probs against its forward pass of the same weights
    (`sampling/sampling_logp_difference/max`) is within float32 noise; the trained weights, pushed by TRL's next
    sync, are what the service serves (against an independent forward pass)."""
    import trl.generation.vllm_client as vc

    from rollout_client.trl_gloo import allow_cpu_device, use_gloo

    grpo = bench_module("trl_grpo")
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")         # where TRL hosts the group (vLLM's get_ip)
    endpoints = use_gloo(vc, monkeypatch.setattr)
    allow_cpu_device(vc.VLLMClient, monkeypatch.setattr)
    v0 = client.status().policy_version
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    trainer = grpo.build_trainer(policy, service.http, steps=1, prompts=2, generations=2, max_completion=8,
                                 temperature=1.0, seed=0, output_dir=str(tmp_path), lr=1e-3, reward="brevity")
    try:
        trainer.train()
        logs = trainer.state.log_history[0]
        assert client.status().policy_version == v0 + 1                 # TRL's first sync, before generating
        assert logs["completions/mean_length"] > 0 and logs["reward_std"] > 0
        assert logs["sampling/sampling_logp_difference/max"] < 1e-3, logs
        assert any(not torch.equal(before[k], v) for k, v in policy.state_dict().items()), "the step trained nothing"
        trainer.vllm_generation.sync_weights()                          # TRL's sync of the trained weights
        policy.eval()
        assert_serves(client, policy, v0 + 2)
        assert endpoints[0].sent[-1] == sum(p.numel() * p.element_size() for p in policy.parameters())
    finally:
        trainer.vllm_generation.vllm_client.close_communicator()
        with httpx.Client(base_url=service.http, timeout=60) as http:
            assert http.post("/shutdown_weight_transfer_engine").status_code == 200
        for e in endpoints:
            e.close()
    assert not client.status().weight_transfer.joined
