"""Top-k log-probs and token streaming over gRPC on real vLLM engines (plain and speculative). Top-k log-probs are
checked against an independent float32 forward pass (the processed distribution: temperature, top-k, top-p) within
1e-3 nats."""
import time

import grpc
import numpy as np
import pytest
import torch
from rollout_client import RolloutClient, build_request
from rollout_client.launcher import ServiceProcess
from transformers import AutoModelForCausalLM

from rollout_service.drafting.reference import processed_logprob_rows
from tests.tiny_models import perturbed_copy

PROMPTS = [[1, 504, 3458, 314, 260], [1, 1046, 2683, 77]]
TOL = 1e-3          # nats; float32 on both sides
K = 20              # the default max_top_logprobs


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def assert_top_k(model, prompt, token_ids, logprobs, top_ids, top_lps, temperature, top_k=0, top_p=1.0):
    """The sampled tokens' log-probs and the top-k (ids and log-probs, most likely first) against the forward pass:
    each returned log-prob equals the reference at its id, and the returned values are the reference's k largest
    (ties may pick either id), -inf exactly where the reference rules a token out."""
    token_ids, top_ids = np.asarray(token_ids), np.asarray(top_ids)
    logprobs, top_lps = np.asarray(logprobs, dtype=np.float64), np.asarray(top_lps, dtype=np.float64)
    rows = processed_logprob_rows(model, prompt, token_ids.tolist(), temperature, top_k, top_p)   # [n, vocab]
    np.testing.assert_allclose(logprobs, rows.gather(-1, torch.tensor(token_ids)[:, None])[:, 0].numpy(),
                               atol=TOL, rtol=0)
    at = rows.gather(-1, torch.tensor(top_ids)).numpy()                                        # [n, k]
    finite = np.isfinite(top_lps)
    assert (np.isfinite(at) == finite).all(), "a top-k entry is -inf on one side only"
    np.testing.assert_allclose(top_lps[finite], at[finite], atol=TOL, rtol=0)
    best = torch.topk(rows, top_ids.shape[1], dim=-1).values.numpy()
    assert (np.isfinite(best) == finite).all()
    np.testing.assert_allclose(top_lps[finite], best[finite], atol=TOL, rtol=0)
    assert all(len(set(row)) == len(row) for row in top_ids.tolist()), "a top-k row repeats a token"


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 40, 1.0), (1.3, 0, 0.9), (0.8, 8, 1.0),
                                                     (0.0, 0, 1.0)])
def test_grpc_top_k_matches_an_independent_forward_pass(client, hf_model, temperature, top_k, top_p):
    groups = client.generate_all(PROMPTS, n=2, max_tokens=12, ignore_eos=True, temperature=temperature, top_k=top_k,
                                 top_p=top_p, seed=5, top_logprobs=K)
    for p, group in enumerate(groups):
        for s in group:
            assert s.top_token_ids.shape == s.top_logprobs.shape == (12, K)
            assert_top_k(hf_model, PROMPTS[p], s.token_ids, s.logprobs, s.top_token_ids, s.top_logprobs,
                         temperature, top_k, top_p)
            if top_k == 8:          # fewer tokens than k survive top-k: the rest are -inf
                assert np.isinf(s.top_logprobs[:, 8:]).all() and np.isfinite(s.top_logprobs[:, :8]).all()
    with pytest.raises(grpc.RpcError) as e:
        list(client.stub.Generate(build_request([PROMPTS[0]], top_logprobs=K + 1)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(
        "top_logprobs: must be in [0, 20] (the server's max_top_logprobs), got 21")


@pytest.fixture(scope="module")
def spec_client(tiny_model, tmp_path_factory):
    """A speculative service: a noisy copy of the target drafts k = 3 every step, so steps accept and reject."""
    drafter = perturbed_copy(tiny_model, tmp_path_factory.mktemp("drafters") / "noisy-topk", scale=0.1, seed=1)
    svc = ServiceProcess(str(tiny_model), log_path=tmp_path_factory.mktemp("logs") / "spec-topk.log", extra_args=[
        "--max-model-len", "512", "--kv-cache-gb", "1", "--dtype", "float32", "--max-num-seqs", "32",
        "--speculation", "draft_model", "--draft-model", str(drafter), "--num-speculative-tokens", "3",
        "--k-control", "fixed"])
    svc.start()
    try:
        with RolloutClient(svc.target) as c:
            yield c
    finally:
        assert svc.stop() == 0


def test_top_k_and_token_streams_with_speculation(spec_client, hf_model):
    """Speculation stays lossless for the top-k: accepted, resampled and bonus tokens' top-k come from the same
    processed distribution (vLLM's rejection sampler gathers them from the target's logits). The token deltas
    (several tokens per verify step) add up to the sample."""
    finals, deltas = {}, {}
    for s in spec_client.generate(PROMPTS, n=3, max_tokens=24, ignore_eos=True, temperature=1.0, top_p=0.95,
                                  seed=3, top_logprobs=K, stream_tokens=True):
        key = (s.prompt_index, s.sample_index)
        if s.delta:
            deltas.setdefault(key, []).append(s)
        else:
            finals[key] = s
    assert len(finals) == 6
    drafted = sum(s.num_drafted for s in finals.values())
    accepted = sum(s.num_accepted for s in finals.values())
    assert drafted > 0 and 0 < accepted < drafted, "steps must both accept and reject drafts"
    for (p, _), s in finals.items():
        assert_top_k(hf_model, PROMPTS[p], s.token_ids, s.logprobs, s.top_token_ids, s.top_logprobs, 1.0, 0, 0.95)
    for key, ds in deltas.items():
        ids = np.concatenate([d.token_ids for d in ds])
        n = len(ids)
        assert ids.tolist() == finals[key].token_ids[:n].tolist()
        np.testing.assert_array_equal(np.concatenate([d.top_token_ids for d in ds]), finals[key].top_token_ids[:n])
    assert any(len(d.token_ids) > 1 for ds in deltas.values() for d in ds), "a verify step yields several tokens"


def test_grpc_token_stream_sends_tokens_as_produced_then_the_whole_sample(client):
    version = client.status().policy_version
    client.generate_all(PROMPTS, n=2, max_tokens=4)          # warm: the first request of a session waits longer
    started = time.monotonic()
    first_delta_s, messages = None, []
    for s in client.generate(PROMPTS, n=2, max_tokens=48, ignore_eos=True, temperature=1.0, seed=9,
                             stream_tokens=True, top_logprobs=3):
        if s.delta and first_delta_s is None:
            first_delta_s = time.monotonic() - started
        messages.append(s)
    whole_s = time.monotonic() - started
    finals = {(s.prompt_index, s.sample_index): s for s in messages if not s.delta}
    assert len(finals) == 4
    plain = client.generate_all(PROMPTS, n=2, max_tokens=48, ignore_eos=True, temperature=1.0, seed=9)
    for (p, i), final in finals.items():
        assert final.token_ids.tolist() == plain[p][i].token_ids.tolist()      # the same samples as without
        ds = [s for s in messages if s.delta and (s.prompt_index, s.sample_index) == (p, i)]
        assert len(ds) >= 8, f"{len(ds)} deltas for 48 tokens: not streamed per step"
        where = {id(m): i for i, m in enumerate(messages)}
        assert where[id(final)] > max(where[id(d)] for d in ds)                   # the whole sample comes last
        assert [d.delta_start for d in ds] == np.cumsum([0] + [len(d.token_ids) for d in ds[:-1]]).tolist()
        n = ds[-1].delta_start + len(ds[-1].token_ids)
        assert np.concatenate([d.token_ids for d in ds]).tolist() == final.token_ids[:n].tolist()
        np.testing.assert_array_equal(np.concatenate([d.logprobs for d in ds]), final.logprobs[:n])
        np.testing.assert_array_equal(np.concatenate([d.top_logprobs for d in ds]), final.top_logprobs[:n])
        assert all(d.policy_version == version and d.version_spans == [(version, d.delta_start)] for d in ds)
        assert all(d.finish_reason == "unspecified" and d.num_drafted == 0 for d in ds)
    assert first_delta_s < whole_s / 2, (first_delta_s, whole_s)


def test_a_slow_token_stream_reader_stalls_nothing(service, client):
    """A token stream that is not read: the engine goes on (its other streams finish meanwhile), the reader's
    record holds its samples' tokens only, and the steps it missed come as one delta per sample when it reads."""
    done_before = client.status().samples_total
    slow = client.generate(PROMPTS, n=4, max_tokens=160, ignore_eos=True, stream_tokens=True, request_id="slow-tok")
    first = next(slow)                                                      # then read nothing for a while
    t0 = time.monotonic()
    other = client.generate_all([PROMPTS[0]], n=2, max_tokens=16, ignore_eos=True, stream_tokens=True)
    assert len(other[0]) == 2 and time.monotonic() - t0 < 60
    deadline = time.monotonic() + 120
    while client.status().samples_total < done_before + 10:               # the 2 others and the 8 unread
        assert time.monotonic() < deadline, "the unread request never finished"
        time.sleep(0.25)
    assert client.status().queue_depth == 0                                # generated while unread
    rest = [first, *slow]
    finals = [s for s in rest if not s.delta]
    assert len(finals) == 8 and all(len(s.token_ids) == 160 for s in finals)
    deltas = [s for s in rest if s.delta]
    assert len(deltas) <= 8 * 160                          # never more than a message per token (gRPC's flow-control
    for f in finals:                                       # window holds many small ones before the reader stalls)
        mine = [d for d in deltas if (d.prompt_index, d.sample_index) == (f.prompt_index, f.sample_index)]
        ids = [t for d in mine for t in d.token_ids.tolist()]
        assert ids == f.token_ids[:len(ids)].tolist()
    print(f"slow reader: {len(deltas)} deltas for 8 x 160 tokens")
