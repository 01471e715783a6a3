"""Partial samples on FakeEngine (no vLLM): an aborted sample returned as it stands (GenerateRequest.return_partial),
a partial sample continued (Prompt.partial) and joined to what the engine adds, the contract's limits on a partial,
and the client's shapes. Real engines, a weight push in abort mode and AReaL's client: tests/integration/
test_weights.py and test_areal_client.py."""
import asyncio

import grpc
import pytest

from rollout_client import build_request
from rollout_client.types import Sample
from rollout_service.engine.types import SeqResult, TokenDelta
from rollout_service.errors import ServiceError
from rollout_service.model_info import ModelInfo
from rollout_service.pool.partial import Partial
from rollout_service.pool.pool import EnginePool
from rollout_service.pool.requests import IndexedDelta, IndexedResult
from rollout_service.server.convert import sample_to_proto
from rollout_service.validation import Limits, check_generate
from tests.fake_engine import FakeEngine

MODEL = ModelInfo(path="m", vocab_size=100, max_model_len=256, tokenizer=None)


def check(prompts=([1, 2],), **kw):
    return check_generate(build_request(list(prompts), **kw), MODEL, Limits(4, 8, max_top_logprobs=20))


def partial_sample(tokens=(7, 8, 9), spans=((3, 0), (4, 2)), k=0, **over) -> Sample:
    """A client-side Sample as an aborted one comes back (the shape Prompt.partial takes)."""
    r = SeqResult(token_ids=list(tokens), logprobs=[-0.5] * len(tokens), finish_reason="abort",
                  version_spans=list(spans), policy_version=spans[0][0] if spans else 0,
                  top_token_ids=[[t] + [0] * (k - 1) for t in tokens] if k else [],
                  top_logprobs=[[-0.5] * k for _ in tokens] if k else [])
    s = Sample.from_proto(sample_to_proto(IndexedResult(0, 0, r), [1, 2], False, False))
    for name, value in over.items():
        object.__setattr__(s, name, value)
    return s


def test_joined_sample_keeps_the_partial_first_and_merges_the_version_spans():
    part = Partial(token_ids=[7, 8, 9], logprobs=[-1.0, -2.0, -3.0], version_spans=[(3, 0), (4, 2)])
    new = SeqResult(token_ids=[5, 6], logprobs=[-0.1, -0.2], finish_reason="length", version_spans=[(4, 0), (5, 1)],
                    policy_version=4, num_drafted=6, num_accepted=2)
    whole = part.joined(new)
    assert whole.token_ids == [7, 8, 9, 5, 6] and whole.logprobs == [-1.0, -2.0, -3.0, -0.1, -0.2]
    assert whole.version_spans == [(3, 0), (4, 2), (5, 4)] and whole.policy_version == 3
    assert (whole.finish_reason, whole.num_drafted, whole.num_accepted) == ("length", 6, 2)   # the new part's
    d = part.shifted(TokenDelta(start=1, token_ids=[6], logprobs=[-0.2], version_spans=[(5, 1)]))
    assert (d.start, d.version_spans) == (4, [(5, 4)])
    # an engine result with no tokens (aborted again before its first step) keeps the partial whole
    k = Partial(token_ids=[7], logprobs=[-1.0], version_spans=[(3, 0)], top_token_ids=[[7, 1]],
                top_logprobs=[[-1.0, -2.0]])
    empty = k.joined(SeqResult(token_ids=[], logprobs=[], finish_reason="abort", version_spans=[(4, 0)]))
    assert empty.token_ids == [7] and empty.top_token_ids == [[7, 1]] and empty.version_spans == [(3, 0), (4, 1)]


def test_a_partial_reaches_the_engine_as_prompt_plus_tokens_with_the_tokens_left():
    checked = check(partials=[partial_sample()], max_tokens=10, n=2)
    seqs = checked.groups[0]
    assert [s.prompt_token_ids for s in seqs] == [[1, 2, 7, 8, 9]] * 2 and {s.max_tokens for s in seqs} == {7}
    assert checked.prompt_token_ids == [[1, 2]]                         # the prompt the sample counts from
    assert checked.partials[0].version_spans == [(3, 0), (4, 2)]
    fresh = check(prompts=([1, 2], [3]), partials=[None, partial_sample(k=2)], max_tokens=10, top_logprobs=2)
    assert fresh.partials[0] is None and fresh.groups[0][0].prompt_token_ids == [1, 2]
    assert fresh.partials[1].top_token_ids == [[7, 0], [8, 0], [9, 0]]
    assert check(return_partial=True).return_partial and not check().return_partial


@pytest.mark.parametrize("over, field, words", [
    ({"token_ids": [7, 100, 9]}, "prompts[0].partial.token_ids", "100 is outside the vocabulary [0, 100)"),
    ({"logprobs": [-0.5]}, "prompts[0].partial.logprobs", "1 log-probs for 3 tokens"),
    ({"logprobs": [-0.5, 0.1, -0.5]}, "prompts[0].partial.logprobs", "must be <= 0"),
    ({"logprobs": [-0.5, float("nan"), -0.5]}, "prompts[0].partial.logprobs", "must be <= 0"),
    ({"version_spans": []}, "prompts[0].partial.version_spans", "are required"),
    ({"version_spans": [(3, 1)]}, "prompts[0].partial.version_spans", "must start at token 0"),
    ({"version_spans": [(3, 0), (4, 0)]}, "prompts[0].partial.version_spans", "strictly increasing"),
    ({"version_spans": [(3, 0), (4, 3)]}, "prompts[0].partial.version_spans", "below 3"),
    ({"version_spans": [(-1, 0)]}, "prompts[0].partial.version_spans", "versions >= 0"),
])
def test_a_bad_partial_is_refused_naming_its_field(over, field, words):
    with pytest.raises(ServiceError) as e:
        check(partials=[partial_sample(**over)], max_tokens=10)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.field == field and words in e.value.message


def test_a_partial_must_leave_tokens_to_generate_and_match_the_requested_top_k():
    with pytest.raises(ServiceError) as e:
        check(partials=[partial_sample()], max_tokens=3)
    assert e.value.field == "prompts[0].partial.token_ids"
    assert "3 tokens already generated leave none of sampling.max_tokens=3" in e.value.message
    with pytest.raises(ServiceError) as e:
        check(partials=[partial_sample()], max_tokens=10, top_logprobs=2)      # the partial has no top-k rows
    assert e.value.field == "prompts[0].partial.top_token_ids" and "needs 3 x 2 = 6" in e.value.message
    with pytest.raises(ServiceError) as e:
        check(partials=[partial_sample(k=2)], max_tokens=10)                   # rows, but no top-k asked for
    assert e.value.field == "prompts[0].partial.top_token_ids"
    with pytest.raises(ValueError, match="partials: one per prompt"):
        build_request([[1], [2]], partials=[None])


async def run_pool(engine: FakeEngine, request_kw: dict, abort_after: float | None = None):
    pool = EnginePool([engine], max_queue=100)
    await pool.start()
    checked = check_generate(build_request([[1, 2]], **request_kw), MODEL, Limits(4, 8))
    rec = pool.submit("", checked.fingerprint, checked.groups, partials=checked.partials,
                      return_partial=checked.return_partial)
    pool.attach(rec)
    if abort_after is not None:
        await asyncio.sleep(abort_after)
        await pool.hold("abort")
    try:
        return [x async for x in rec.read(deltas=request_kw.get("stream_tokens", False))]
    finally:
        pool.detach(rec)


def test_an_aborted_sample_comes_back_partial_only_when_asked():
    async def main():
        kw = {"max_tokens": 200, "n": 2, "seed": 1, "ignore_eos": True}
        items = await run_pool(FakeEngine("e0", step_s=0.002), kw | {"return_partial": True}, abort_after=0.1)
        assert len(items) == 2
        for it in items:
            r = it.result
            assert r.finish_reason == "abort" and 0 < len(r.token_ids) < 200 and len(r.logprobs) == len(r.token_ids)
        with pytest.raises(ServiceError) as e:                   # the default: the request fails, as before
            await run_pool(FakeEngine("e0", step_s=0.002), kw, abort_after=0.1)
        assert e.value.code == grpc.StatusCode.ABORTED and "retry the request" in e.value.message
    asyncio.run(main())


def test_a_continued_sample_is_one_sample_and_its_deltas_count_from_the_partial():
    async def main():
        eng = FakeEngine("e0")
        eng.policy_version = 5
        part = partial_sample()                      # 3 tokens, versions 3 then 4
        items = await run_pool(eng, {"max_tokens": 8, "partials": [part], "stream_tokens": True, "ignore_eos": True})
        final = [x for x in items if isinstance(x, IndexedResult)]
        deltas = [x.delta for x in items if isinstance(x, IndexedDelta)]
        r, = [x.result for x in final]
        assert len(r.token_ids) == 8 and r.token_ids[:3] == [7, 8, 9] and r.logprobs[:3] == [-0.5] * 3
        assert r.version_spans == [(3, 0), (4, 2), (5, 3)] and r.policy_version == 3
        assert eng.seen[0].prompt_token_ids == [1, 2, 7, 8, 9] and eng.seen[0].max_tokens == 5
        assert deltas and deltas[0].start == 3 and deltas[0].version_spans[0] == (5, 3)
        assert [t for d in deltas for t in d.token_ids] == r.token_ids[3:3 + sum(len(d.token_ids) for d in deltas)]
    asyncio.run(main())
