"""Top-k log-probs, token streaming and multi-turn token exactness on real vLLM engines (plain and speculative),
through gRPC, the `openai` package and SGLang's /generate. Top-k log-probs are checked against an independent
float32 forward pass (the processed distribution: temperature, top-k, top-p) within 1e-3 nats."""
import asyncio
import json
import time

import grpc
import numpy as np
import openai
import pytest
import torch
from rollout_client import build_request
from transformers import AutoTokenizer

from rollout_service.drafting.reference import processed_logprob_rows
from rollout_tasks.chat import chat_token_ids

PROMPTS = [[1, 504, 3458, 314, 260], [1, 1046, 2683, 77]]
TOL = 1e-3          # nats; float32 on both sides
K = 20              # the default max_top_logprobs


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
def spec_client(spec_service, noisy_drafter):
    """The shared speculative service (conftest.py: k = 3 every step) with a noisy copy of the target drafting (pushed
    here unless it serves already), so steps accept and reject."""
    spec_service.serve(noisy_drafter)
    return spec_service.client


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


def sse(text: str) -> list[dict]:
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_openai_streams_token_by_token_with_top_k(service, hf_model):
    async def main():
        async with openai.AsyncOpenAI(base_url=service.http + "/v1", api_key="unused", max_retries=0) as oa:
            whole = await oa.completions.create(model="m", prompt=PROMPTS[0], n=2, max_tokens=24, seed=4, logprobs=5,
                                                extra_body={"ignore_eos": True, "return_token_ids": True})
            stream = await oa.completions.create(model="m", prompt=PROMPTS[0], n=2, max_tokens=24, seed=4, logprobs=5,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True, "return_token_ids": True})
            parts: dict[int, list] = {}
            usage = None
            async for chunk in stream:
                for c in chunk.choices:
                    parts.setdefault(c.index, []).append(c)
                usage = chunk.usage or usage
            assert usage.completion_tokens == 48
            for w in whole.choices:
                got = parts[w.index]
                assert len(got) >= 6, "one chunk per engine step, not one at the end"
                assert [c.finish_reason for c in got] == [None] * (len(got) - 1) + ["length"]
                assert "".join(c.text for c in got) == w.text
                assert [t for c in got for t in c.token_ids] == w.token_ids
                # as vLLM: text_offset counts on across a choice's chunks, prompt_token_ids only in its first
                assert [o for c in got for o in c.logprobs.text_offset] == w.logprobs.text_offset
                assert got[0].prompt_token_ids == w.prompt_token_ids and all(c.prompt_token_ids is None
                                                                             for c in got[1:])
                tops = [d for c in got for d in c.logprobs.top_logprobs]
                assert len(tops) == 24 and all(len(d) in (5, 6) for d in tops)     # the 5 best and the sampled one
                for a, b in zip(tops, w.logprobs.top_logprobs):
                    assert a.keys() == b.keys() and max(abs(a[k] - b[k]) for k in a) < 1e-4
            chat = await oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "2+2?"}],
                                                    max_tokens=12, seed=1, logprobs=True, top_logprobs=K,
                                                    stream=True)
            pieces = [c async for c in chat]
            assert pieces[0].choices[0].delta.role == "assistant"
            assert all(len(x.top_logprobs) == K for p in pieces for x in (p.choices[0].logprobs.content or []))
    asyncio.run(main())


def test_completions_top_k_with_token_ids_matches_the_forward_pass(service, hf_model):
    with openai.OpenAI(base_url=service.http + "/v1", api_key="unused", max_retries=0) as oa:
        out = oa.completions.create(model="m", prompt=PROMPTS[1], n=2, max_tokens=10, temperature=0.9, seed=2,
                                    logprobs=K, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                            "return_tokens_as_token_ids": True, "top_k": 30})
        for c in out.choices:
            rows = [sorted(((int(k.split(":")[1]), v) for k, v in d.items()), key=lambda kv: -kv[1])[:K]
                    for d in c.logprobs.top_logprobs]
            top_ids = [[t for t, _ in r] for r in rows]
            top_lps = [[v if v > -9999 else -np.inf for _, v in r] for r in rows]
            assert_top_k(hf_model, PROMPTS[1], c.token_ids, c.logprobs.token_logprobs, top_ids, top_lps, 0.9, 30)
        with pytest.raises(openai.BadRequestError) as e:
            oa.completions.create(model="m", prompt=PROMPTS[1], logprobs=K + 1)
        assert e.value.body["param"] == "logprobs" and "max_top_logprobs" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], logprobs=True,
                                       top_logprobs=K + 1)
        assert e.value.body["param"] == "top_logprobs"


def test_sglang_top_k_and_stream(http, hf_model):
    body = {"input_ids": PROMPTS[0], "return_logprob": True, "top_logprobs_num": 7,
            "sampling_params": {"max_new_tokens": 16, "temperature": 1.0, "n": 2, "sampling_seed": 6,
                                "ignore_eos": True}}
    whole = http.post("/generate", json=body).json()
    for out in whole:
        meta = out["meta_info"]
        top = meta["output_top_logprobs"]
        assert_top_k(hf_model, PROMPTS[0], out["output_ids"], [x[0] for x in meta["output_token_logprobs"]],
                     [[t for _, t, _ in pos] for pos in top], [[lp for lp, _, _ in pos] for pos in top], 1.0)
    r = http.post("/generate", json=body | {"stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = sse(r.text)
    assert r.headers["x-rollout-policy-version"] == whole[0]["meta_info"]["weight_version"]
    for i, out in enumerate(whole):
        mine = [c for c in chunks if c["index"] == i]
        assert len(mine) >= 4 and all(c["meta_info"]["finish_reason"] is None for c in mine[:-1])
        assert mine[-1]["output_ids"] == out["output_ids"] and mine[-1]["text"] == out["text"]
        assert mine[-1]["meta_info"]["output_top_logprobs"] == out["meta_info"]["output_top_logprobs"]
        assert all(out["output_ids"][:len(c["output_ids"])] == c["output_ids"] for c in mine)


def test_multi_turn_token_ids_need_no_retokenising(service, client, hf_model, tiny_model):
    """Turn 1 over the chat dialect returns the prompt's and the completion's token ids. Turn 2 sends exactly those
    ids back (plus the next user turn's) as a token prompt: the service conditions on exactly them (they come back
    unchanged, and the continuation's log-probs are the forward pass's on them), while decoding the history and
    tokenising it again would give other ids: a different context than the policy sampled in."""
    tok = AutoTokenizer.from_pretrained(tiny_model)
    with openai.OpenAI(base_url=service.http + "/v1", api_key="unused", max_retries=0) as oa:
        turn1 = oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "Count to five."}],
                                           n=8, max_tokens=24, temperature=1.0, seed=12)
        prompt1 = turn1.prompt_token_ids
        assert prompt1 == chat_token_ids(tok, [{"role": "user", "content": "Count to five."}])
        histories = [prompt1 + c.token_ids for c in turn1.choices]
        differs = [h for h in histories if tok(tok.decode(h), add_special_tokens=False)["input_ids"] != h]
        assert differs, "some sampled history must not survive decode + encode (else this proves nothing)"
        history = differs[0]
        user2 = tok("<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n",
                    add_special_tokens=False)["input_ids"]
        ids = history + user2
        out = oa.completions.create(model="m", prompt=ids, max_tokens=8, temperature=1.0, seed=1, logprobs=0,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
        c = out.choices[0]
        assert c.prompt_token_ids == ids
        ref = processed_logprob_rows(hf_model, ids, c.token_ids, 1.0, 0, 1.0)
        exact = ref.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0].numpy()
        np.testing.assert_allclose(c.logprobs.token_logprobs, exact, atol=TOL, rtol=0)
        retok = tok(tok.decode(history), add_special_tokens=False)["input_ids"] + user2
        other = processed_logprob_rows(hf_model, retok, c.token_ids, 1.0, 0, 1.0)
        moved = other.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0].numpy()
        # the served log-probs are not those of the re-tokenised context (a tiny random model barely depends on
        # its context: 0.009 nats here, still 9x the tolerance the exact ids meet)
        assert np.abs(np.asarray(c.logprobs.token_logprobs) - moved).max() > 3 * TOL
    # gRPC is token-in/token-out already: the same ids, the same continuation
    s = client.generate_all([ids], max_tokens=8, temperature=1.0, seed=1, ignore_eos=True)[0][0]
    np.testing.assert_allclose(s.logprobs, processed_logprob_rows(hf_model, ids, s.token_ids.tolist(), 1.0, 0, 1.0)
                               .gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0].numpy(), atol=TOL, rtol=0)
