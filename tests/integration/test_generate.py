"""Generate through a real service: streaming, sampling parameters, log-probs, seeds, retries."""
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from rollout_service.drafting.reference import processed_logprobs

VOCAB = 49152
PROMPTS = [[1, 504, 3458, 314, 260], [1, 1046, 2683], [1, 28, 29, 30, 31, 32, 33]]


def test_streams_n_samples_per_prompt_with_max_tokens(client):
    version = client.status().policy_version      # the session's service may have taken pushes already
    samples = list(client.generate(PROMPTS, n=4, max_tokens=16, ignore_eos=True, temperature=1.0))
    assert sorted((s.prompt_index, s.sample_index) for s in samples) == [(p, i) for p in range(3) for i in range(4)]
    for s in samples:
        assert len(s.token_ids) == 16 and len(s.logprobs) == 16
        assert s.finish_reason == "length"
        assert ((0 <= s.token_ids) & (s.token_ids < VOCAB)).all()
        assert np.isfinite(s.logprobs).all() and (s.logprobs <= 0).all()
        assert s.policy_version == version and s.version_spans == [(version, 0)]
        assert s.num_prompt_tokens == len(PROMPTS[s.prompt_index])


def test_stop_string_and_stop_token(client):
    greedy = client.generate_all([PROMPTS[0]], max_tokens=24, temperature=0.0, ignore_eos=True,
                                 return_text=True)[0][0]
    assert greedy.finish_reason == "length"
    tok = AutoTokenizer.from_pretrained(client_model_path(client))
    stop = tok.decode(greedy.token_ids[6:8].tolist())
    assert stop.strip(), "the tiny model's greedy text should be non-empty"
    stopped = client.generate_all([PROMPTS[0]], max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop],
                                  return_text=True)[0][0]
    assert stopped.finish_reason == "stop" and stopped.stop_string == stop
    assert stop not in stopped.text and greedy.text.startswith(stopped.text)
    assert len(stopped.token_ids) <= 8

    stop_tok = int(greedy.token_ids[4])
    first = int(np.flatnonzero(greedy.token_ids == stop_tok)[0])
    by_token = client.generate_all([PROMPTS[0]], max_tokens=24, temperature=0.0, ignore_eos=True,
                                   stop_token_ids=[stop_tok])[0][0]
    assert by_token.finish_reason == "stop"
    assert by_token.token_ids.tolist() == greedy.token_ids[:first + 1].tolist()


def client_model_path(client) -> str:
    return client.status().model


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 40, 1.0), (1.3, 0, 0.9),
                                                     (0.8, 100, 0.95)])
def test_logprobs_match_an_independent_forward_pass(client, hf_model, temperature, top_k, top_p):
    """Tolerance: 2e-3 nats per token (float32 on both sides; different kernels and summation order)."""
    groups = client.generate_all(PROMPTS, n=2, max_tokens=12, ignore_eos=True, temperature=temperature,
                                 top_k=top_k, top_p=top_p, seed=11)
    for p, group in enumerate(groups):
        for s in group:
            ref = processed_logprobs(hf_model, PROMPTS[p], s.token_ids.tolist(), temperature, top_k, top_p)
            assert torch.isfinite(ref).all(), "the service sampled a token the reference rules out"
            np.testing.assert_allclose(s.logprobs, ref.numpy(), atol=2e-3, rtol=0)


def test_same_seed_same_samples_different_seed_different(client):
    def run(seed):
        g = client.generate_all(PROMPTS, n=3, max_tokens=20, ignore_eos=True, temperature=1.0, seed=seed)
        return [[s.token_ids.tolist() for s in group] for group in g]

    a, b, c = run(123), run(123), run(124)
    assert a == b
    assert a != c
    assert a[0][0] != a[0][1], "samples of one group must differ (distinct per-sample seeds)"


def test_text_prompt_with_chat_template_returns_prompt_tokens(client):
    tok = AutoTokenizer.from_pretrained(client_model_path(client))
    samples = list(client.generate(["What is 2 + 2?"], n=2, max_tokens=4, chat=True, ignore_eos=True))
    expected = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}],
                                       add_generation_prompt=True, tokenize=True)
    if hasattr(expected, "keys"):
        expected = expected["input_ids"]
    with_prompt = [s for s in samples if s.prompt_token_ids is not None]
    assert len(with_prompt) == 1 and with_prompt[0].prompt_token_ids.tolist() == list(expected)
    assert all(s.num_prompt_tokens == len(expected) for s in samples)


def test_seeded_long_prompt_batch(client):
    """More prompt tokens than one engine step holds, all seeded: on CPU this used to kill vLLM's engine
    (a seeded request with a split prefill; see engine/vllm_engine.py)."""
    prompts = [[1] + [(7 * i + j) % 40000 + 100 for j in range(249)] for i in range(12)]   # 6000 tokens
    groups = client.generate_all(prompts, n=2, max_tokens=4, ignore_eos=True, seed=3)
    assert all(len(s.token_ids) == 4 for g in groups for s in g)
    again = client.generate_all(prompts[:1], n=2, max_tokens=4, ignore_eos=True, seed=3)
    assert [s.token_ids.tolist() for s in again[0]] == [s.token_ids.tolist() for s in groups[0]]
    assert client.status().ready


def test_status_reports_every_vllm_patch(client, service):
    """engine/patches.py's report from a real worker: the CPU's fixes applied where the bug is present here, the
    k scheduler not needed without k_control auto, the worker forked from the engine core (its state inherited
    from there), the engine core forked from the front end's fork server (the front end's state, in the environment
    it passed), every patch named, and /metrics with the same states."""
    from rollout_service.engine.patches import PATCHES

    by = {p.name: p for p in client.status().patches}
    assert set(by) == {p.name for p in PATCHES}
    assert by["gloo_weight_transfer"].state == "applied"
    assert by["k0_fastpath"].state == "applied"                      # the V1 runner, the CPU's
    assert by["draft_handoff"].state == "applied", by["draft_handoff"]   # installed in the engine core
    assert by["cpu_rejection_expansion"].state in ("applied", "not needed")
    assert by["k_scheduler"].state == "not needed" and by["k_scheduler"].reason
    assert by["cpu_worker_fork"].state == "applied", by["cpu_worker_fork"]      # the worker forked from the core
    assert by["cpu_engine_forkserver"].state == "applied", by["cpu_engine_forkserver"]   # the core from a fork server
    status, body = service.http_get("/metrics")
    assert status == 200 and 'rollout_vllm_patch{name="k0_fastpath",state="applied"} 1.0' in body
