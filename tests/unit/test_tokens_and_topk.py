"""Token streaming and top-k log-probs on FakeEngine (no vLLM): the record's deltas (a slow reader gets the steps
it missed in one delta), the contract's limits, the proto and client shapes. Real engines and the independent
forward pass: tests/integration/test_tokens_and_topk.py."""
import asyncio
import math

import grpc
import pytest

from rollout_client import build_request
from rollout_client.types import Sample
from rollout_service.engine.types import SeqRequest, SeqResult, TokenDelta
from rollout_service.errors import ServiceError
from rollout_service.model_info import ModelInfo
from rollout_service.pool.pool import EnginePool
from rollout_service.pool.requests import IndexedDelta, IndexedResult, Progress, RequestRecord
from rollout_service.server.convert import delta_to_proto, sample_to_proto
from rollout_service.validation import Limits, check_generate
from tests.fake_engine import FakeEngine

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
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
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
