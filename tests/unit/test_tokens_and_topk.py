"""Token streaming and top-k log-probs on FakeEngine (no vLLM): the record's deltas (a slow reader gets the steps
it missed in one delta), the contract's limits, the proto and client shapes, and the dialects' fields and errors.
Real engines, the independent forward pass and the `openai` package: tests/integration/test_tokens_and_topk.py."""
import asyncio
import json
import math

import grpc
import pytest

from rollout_client import build_request
from rollout_client.types import Sample
from rollout_service.engine.types import SeqRequest, SeqResult, TokenDelta
from rollout_service.errors import ServiceError
from rollout_service.model_info import ModelInfo
from rollout_service.pool.pool import EnginePool
from rollout_service.pool.requests import IndexedDelta, IndexedResult, Progress, RequestRecord, split
from rollout_service.server.convert import delta_to_proto, sample_to_proto
from rollout_service.validation import Limits, check_generate
from tests.fake_engine import FakeEngine
from tests.unit.test_http_dialects import make  # noqa: F401 - the HTTP app fixture

MODEL = ModelInfo(path="m", vocab_size=100, max_model_len=256, tokenizer=None)


def check(**kw):
    return check_generate(build_request([[1, 2]], **kw), MODEL, Limits(4, 8, max_top_logprobs=20))


def test_top_logprobs_and_stream_tokens_reach_the_sequences_and_the_limit_names_the_field():
    seq = check(top_logprobs=20, stream_tokens=True).groups[0][0]
    assert (seq.top_logprobs, seq.stream) == (20, True)
    assert (check().groups[0][0].top_logprobs, check().groups[0][0].stream) == (0, False)
    for bad in (21, -1, 2**31 - 1):
        with pytest.raises(ServiceError) as e:
            check(top_logprobs=bad)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.field == "top_logprobs"
        assert e.value.message == (f"top_logprobs: must be in [0, 20] (the server's max_top_logprobs), got {bad}")


def test_progress_sends_what_is_new_with_the_versions_that_made_it():
    p = Progress()
    p.extend(TokenDelta(start=0, token_ids=[5, 6], logprobs=[-1.0, -2.0], version_spans=[(3, 0)]))
    p.extend(TokenDelta(start=2, token_ids=[7], logprobs=[-3.0], version_spans=[(4, 2)]))
    d = p.since(1)
    assert (d.start, d.token_ids, d.logprobs, d.version_spans) == (1, [6, 7], [-2.0, -3.0], [(3, 1), (4, 2)])
    assert p.since(2).version_spans == [(4, 2)]
    with pytest.raises(ValueError):
        p.extend(TokenDelta(start=1, token_ids=[1], logprobs=[0.0], version_spans=[(4, 1)]))


def test_a_slow_reader_gets_the_missed_steps_in_one_delta_and_never_holds_up_the_engine():
    async def main():
        rec = RequestRecord(request_id="", fingerprint=b"", expected=1)
        fast = rec.read(deltas=True)
        for t in range(3):
            rec.add_delta(0, 0, TokenDelta(start=t, token_ids=[t], logprobs=[-1.0], version_spans=[(0, t)]))
        first = await fast.__anext__()                   # three steps happened before it looked: one delta
        assert isinstance(first, IndexedDelta) and first.delta.token_ids == [0, 1, 2]
        rec.add_delta(0, 0, TokenDelta(start=3, token_ids=[3], logprobs=[-1.0], version_spans=[(0, 3)]))
        second = await fast.__anext__()
        assert (second.delta.start, second.delta.token_ids) == (3, [3])
        slow = rec.read(deltas=True)                     # a second reader (a retry) starts from the beginning
        assert (await slow.__anext__()).delta.token_ids == [0, 1, 2, 3]
        result = SeqResult(token_ids=[0, 1, 2, 3, 4], logprobs=[-1.0] * 5, finish_reason="length")
        rec.add(IndexedResult(0, 0, result))
        rec.finish()
        assert not rec.progress                          # a finished sample's progress is dropped
        for reader in (fast, slow):
            rest = [x async for x in reader]
            assert len(rest) == 1 and isinstance(rest[0], IndexedResult) and rest[0].result.token_ids == [0, 1, 2, 3, 4]
    asyncio.run(main())


def test_a_step_reaches_a_reader_as_one_batch_with_the_finished_samples_first():
    async def main():
        rec = RequestRecord(request_id="", fingerprint=b"", expected=3)
        batches = rec.batches(deltas=True)
        for s in range(3):                               # one engine step: three samples' first tokens
            rec.add_delta(0, s, TokenDelta(start=0, token_ids=[s], logprobs=[-1.0], version_spans=[(0, 0)]))
        step1 = await batches.__anext__()
        assert [(type(x), x.sample_index) for x in step1] == [(IndexedDelta, 0), (IndexedDelta, 1), (IndexedDelta, 2)]
        for s in (0, 2):                                 # the next step: sample 1 finishes, 0 and 2 go on
            rec.add_delta(0, s, TokenDelta(start=1, token_ids=[9], logprobs=[-1.0], version_spans=[(0, 1)]))
        rec.add(IndexedResult(0, 1, SeqResult(token_ids=[1, 4], logprobs=[-1.0] * 2, finish_reason="stop")))
        step2 = await batches.__anext__()
        assert [(type(x), x.sample_index) for x in step2] == [(IndexedResult, 1), (IndexedDelta, 0), (IndexedDelta, 2)]
        assert [x.delta.token_ids for x in step2[1:]] == [[9], [9]]
        assert split(step2) == ([step2[0]], step2[1:])
        for s in (0, 2):
            rec.add(IndexedResult(0, s, SeqResult(token_ids=[s, 9], logprobs=[-1.0] * 2, finish_reason="stop")))
        rec.finish()
        assert [[x.sample_index for x in b] async for b in batches] == [[0, 2]]
    asyncio.run(main())


def test_pool_streams_deltas_then_whole_samples_and_plain_readers_get_samples_only():
    async def main():
        pool = EnginePool([FakeEngine("e0", vocab_size=50)], max_queue=100)
        await pool.start()
        groups = [[SeqRequest(seq_id=f"s-{s}", prompt_token_ids=[1], max_tokens=6, seed=s, stream=True,
                              top_logprobs=2) for s in range(2)]]
        rec = pool.submit("", b"x", groups)
        pool.attach(rec)
        items = [x async for x in rec.read(deltas=True)]
        pool.detach(rec)
        finals = [x for x in items if isinstance(x, IndexedResult)]
        assert len(finals) == 2
        for f in finals:
            deltas = [x.delta for x in items if isinstance(x, IndexedDelta) and x.sample_index == f.sample_index]
            streamed = [t for d in deltas for t in d.token_ids]      # a prefix: the whole sample supersedes the rest
            assert len(deltas) >= 2 and streamed == f.result.token_ids[:len(streamed)]
            assert [t for d in deltas for t in d.top_token_ids] == f.result.top_token_ids[:len(streamed)]
            assert [d.start for d in deltas] == [sum(len(x.token_ids) for x in deltas[:i]) for i in range(len(deltas))]
        assert all(isinstance(x, IndexedResult) for x in [y async for y in rec.read()])
    asyncio.run(main())


def test_proto_and_client_shapes():
    r = SeqResult(token_ids=[4, 5], logprobs=[-0.5, -0.25], finish_reason="stop", version_spans=[(2, 0)],
                  policy_version=2, top_token_ids=[[4, 9, 1], [5, 4, 3]],
                  top_logprobs=[[-0.5, -1.0, -math.inf], [-0.25, -2.0, -3.0]])
    m = sample_to_proto(IndexedResult(1, 0, r), [1, 2], False, False)
    assert list(m.top_token_ids) == [4, 9, 1, 5, 4, 3] and not m.delta
    s = Sample.from_proto(m)
    assert s.top_token_ids.shape == (2, 3) and s.top_token_ids[1].tolist() == [5, 4, 3]
    assert s.top_logprobs[0, 2] == -math.inf
    one = SeqResult(token_ids=[1], logprobs=[-1.0], finish_reason="length")
    plain = Sample.from_proto(sample_to_proto(IndexedResult(0, 0, one), [1], False, False))
    assert plain.top_token_ids is None and plain.top_logprobs is None
    d = delta_to_proto(IndexedDelta(0, 1, TokenDelta(start=7, token_ids=[3], logprobs=[-0.1], version_spans=[(5, 7)],
                                                     top_token_ids=[[3, 2]], top_logprobs=[[-0.1, -3.0]])), 4)
    ds = Sample.from_proto(d)
    assert ds.delta and ds.delta_start == 7 and ds.policy_version == 5 and ds.version_spans == [(5, 7)]
    assert ds.finish_reason == "unspecified" and ds.top_token_ids.tolist() == [[3, 2]]


def sse(text: str) -> list:
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_dialects_serve_top_k_in_their_own_shapes(make):  # noqa: F811
    async def main():
        _, _, c = await make()
        # FakeEngine's top-k: the sampled token, then the ids after it
        r = await c.post("/v1/completions", json={"prompt": [3], "max_tokens": 3, "logprobs": 4,
                                                  "return_token_ids": True, "return_tokens_as_token_ids": True})
        ch = r.json()["choices"][0]
        assert r.status_code == 200 and all(len(d) == 4 for d in ch["logprobs"]["top_logprobs"])
        assert list(ch["logprobs"]["top_logprobs"][0]) == [f"token_id:{(ch['token_ids'][0] + j) % 100}"
                                                            for j in range(4)]
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a b"}],
                                                       "max_tokens": 2, "logprobs": True, "top_logprobs": 5})
        ch = r.json()["choices"][0]
        assert r.status_code == 200 and [len(x["top_logprobs"]) for x in ch["logprobs"]["content"]] == [5, 5]
        r = await c.post("/inference/v1/generate", json={"token_ids": [4], "sampling_params": {"max_tokens": 2,
                                                                                               "logprobs": 3}})
        assert [len(x["top_logprobs"]) for x in r.json()["choices"][0]["logprobs"]["content"]] == [3, 3]
        r = await c.post("/generate", json={"input_ids": [1], "return_logprob": True, "top_logprobs_num": 3,
                                            "sampling_params": {"max_new_tokens": 2}})
        meta = r.json()["meta_info"]
        assert [[t for _, t, _ in pos] for pos in meta["output_top_logprobs"]] == [
            [(t + j) % 100 for j in range(3)] for t in r.json()["output_ids"]]
        assert "output_top_logprobs" not in (await c.post("/generate", json={
            "input_ids": [1], "return_logprob": True, "sampling_params": {"max_new_tokens": 2}})).json()["meta_info"]
    asyncio.run(main())


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": [1], "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": [1], "logprobs": -2}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"logprobs": 99}}, "sampling_params.logprobs"),
    ("/generate", {"input_ids": [1], "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
])
def test_top_k_above_the_limit_is_400_naming_the_dialects_field(make, path, body, param):  # noqa: F811
    async def main():
        _, _, c = await make()
        r = await c.post(path, json=body)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param, r.text
        assert err["message"].startswith(f"{param}: must be in [0, 20] (the server's max_top_logprobs)")
    asyncio.run(main())


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "top_logprobs"),
    ("/generate", {"input_ids": [1], "top_logprobs_num": 2}, "top_logprobs_num"),
])
def test_top_k_without_logprobs_is_400(make, path, body, param):  # noqa: F811
    async def main():
        _, _, c = await make()
        r = await c.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param
    asyncio.run(main())


def test_chat_stream_sends_the_role_once_and_token_ids_on_every_answer(make):  # noqa: F811
    async def main():
        _, _, c = await make()
        msgs = [{"role": "user", "content": "a bb"}]
        r = await c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "stream": True,
                                                       "logprobs": True, "top_logprobs": 2})
        chunks = [ch for ch in sse(r.text) if ch["choices"]]
        deltas = [ch["choices"][0]["delta"] for ch in chunks]
        assert len(chunks) >= 2 and deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:])
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert len([t for ch in chunks for t in ch["choices"][0]["token_ids"]]) == 4
        assert all(len(x["top_logprobs"]) == 2 for ch in chunks for x in ch["choices"][0]["logprobs"]["content"])
        assert all(ch["prompt_token_ids"] == [1, 1, 2, 2] for ch in chunks)
        body = (await c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})).json()
        assert body["prompt_token_ids"] == [1, 1, 2, 2] and len(body["choices"][0]["token_ids"]) == 2
    asyncio.run(main())


def test_sglang_stream_sends_the_sample_so_far_per_step(make):  # noqa: F811
    async def main():
        _, _, c = await make()
        r = await c.post("/generate", json={"input_ids": [[1], [2]], "stream": True, "return_logprob": True,
                                            "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = sse(r.text)
        for index in (0, 1):
            mine = [ch for ch in chunks if ch["index"] == index]
            assert len(mine) >= 2
            assert [len(ch["output_ids"]) for ch in mine] == sorted(len(ch["output_ids"]) for ch in mine)
            assert all(ch["meta_info"]["finish_reason"] is None for ch in mine[:-1])
            last = mine[-1]
            assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
            assert all(last["output_ids"][:len(ch["output_ids"])] == ch["output_ids"] for ch in mine)
            assert len(last["meta_info"]["output_token_logprobs"]) == 4
    asyncio.run(main())


def test_stream_text_sends_whole_characters_and_adds_up_to_the_text():
    from rollout_service.server.compat.gateway import StreamText

    pieces = [b"He", b"llo", b" w", b"\xc3", b"\xa9", b"rld", b" \xe2\x9c", b"\x93"]     # "é" and "✓" split

    def decode(ids):
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    st = StreamText(decode)
    sent = [st.step([i]) for i in range(len(pieces))]
    assert sent == ["He", "llo", " w", "", "é", "rld", "", " ✓"]
    assert "".join(sent) == st.sent == decode(range(len(pieces)))
    assert st.finish(decode(range(len(pieces)))) == ""
