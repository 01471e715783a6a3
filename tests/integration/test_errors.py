"""Bad input gets INVALID_ARGUMENT naming the field, and the service goes on serving."""
from collections import namedtuple

import grpc
import pytest

from rollout_client import build_request
from rollout_service.api import pb

GOOD = [[1, 2, 3]]
Part = namedtuple("Part", "token_ids logprobs version_spans")         # what a partial Sample carries
PART = Part(token_ids=[5, 6], logprobs=[-1.0, -2.0], version_spans=[(0, 0)])

BAD = [
    ("no prompts", dict(prompts=[]), "prompts"),
    ("empty prompt", dict(prompts=[[]]), "prompts[0]"),
    ("token id above vocab", dict(prompts=[[1, 49152]]), "prompts[0].token_ids"),
    ("negative token id", dict(prompts=[[1, -5]]), "prompts[0].token_ids"),
    ("prompt + max_tokens beyond context", dict(prompts=[[1] * 500], max_tokens=100), "context length"),
    ("negative temperature", dict(temperature=-0.5), "sampling.temperature"),
    ("infinite temperature", dict(temperature=float("inf")), "sampling.temperature"),
    ("huge temperature", dict(temperature=1e30), "sampling.temperature"),
    ("temperature above vLLM's 2", dict(temperature=2.5), "sampling.temperature"),
    ("temperature below vLLM's floor", dict(temperature=0.001), "sampling.temperature"),
    ("top_p zero", dict(top_p=0.0), "sampling.top_p"),
    ("top_p above one", dict(top_p=1.5), "sampling.top_p"),
    ("top_k below -1", dict(top_k=-3), "sampling.top_k"),
    ("max_tokens zero", dict(max_tokens=0), "sampling.max_tokens"),
    ("n negative", dict(n=-2), "n:"),
    ("n above limit", dict(n=1000), "max_samples_per_prompt"),
    ("oversize batch", dict(prompts=[[1, 2]] * 300), "max_prompts_per_request"),
    ("empty stop string", dict(stop=[""]), "sampling.stop"),
    ("bad request id", dict(request_id="has space"), "request_id"),
    ("negative min_policy_version", dict(min_policy_version=-1), "min_policy_version"),
    ("top_logprobs above max_top_logprobs", dict(top_logprobs=21), "top_logprobs: must be in [0, 20]"),
    ("negative top_logprobs", dict(top_logprobs=-1), "top_logprobs"),
    ("top_logprobs far above the limit while streaming tokens", dict(top_logprobs=2**31 - 1, stream_tokens=True),
     "top_logprobs"),
    ("partial token id above vocab", dict(partials=[PART._replace(token_ids=[5, 49152])], max_tokens=8),
     "prompts[0].partial.token_ids"),
    ("partial leaving no tokens to generate", dict(partials=[PART], max_tokens=2), "prompts[0].partial.token_ids"),
    ("partial log-probs not one per token", dict(partials=[PART._replace(logprobs=[-1.0])], max_tokens=8),
     "prompts[0].partial.logprobs"),
    ("partial positive log-prob", dict(partials=[PART._replace(logprobs=[-1.0, 3.0])], max_tokens=8),
     "prompts[0].partial.logprobs"),
    ("partial without version spans", dict(partials=[PART._replace(version_spans=[])], max_tokens=8),
     "prompts[0].partial.version_spans"),
    ("partial without the requested top-k rows", dict(partials=[PART], max_tokens=8, top_logprobs=2),
     "prompts[0].partial.top_token_ids"),
    ("session_id too long", dict(session_id="s" * 257), "session_id: at most 256 characters"),
    ("session_id not printable ASCII", dict(session_id="conv\u00e9"), "session_id: must be printable ASCII"),
]


@pytest.mark.parametrize("case,kwargs,field", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_invalid_argument_naming_the_field(client, case, kwargs, field):
    prompts = kwargs.pop("prompts", GOOD)
    with pytest.raises(grpc.RpcError) as e:
        list(client.stub.Generate(build_request(prompts, **kwargs)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert field in e.value.details()
    # and the service still serves
    assert len(list(client.generate(GOOD, n=1, max_tokens=2))) == 1


def test_prompt_with_both_text_and_tokens_is_rejected(client):
    req = pb.GenerateRequest(prompts=[pb.Prompt(token_ids=[1, 2], text="hi")])
    with pytest.raises(grpc.RpcError) as e:
        list(client.stub.Generate(req))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompts[0]" in e.value.details()


def test_min_policy_version_above_serving_is_failed_precondition(client):
    serving = client.status().policy_version
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate(GOOD, max_tokens=2, min_policy_version=serving + 5))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"min_policy_version={serving + 5}" in e.value.details()
    assert f"policy version {serving}" in e.value.details()
    assert len(list(client.generate(GOOD, max_tokens=2, min_policy_version=serving))) == 1


def test_what_validation_admits_vllm_accepts_unchanged():
    """Random sampling parameters: every set the service admits, vLLM's SamplingParams (the engine's own
    check) accepts without raising and without changing the temperature; so the engine never refuses an
    admitted request (which would have to answer with a status the client could mistake for "retry")."""
    import random

    from vllm.sampling_params import SamplingParams

    from rollout_service.errors import ServiceError
    from rollout_service.model_info import ModelInfo
    from rollout_service.validation import Limits, check_generate

    class Tok:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [1]}

    model = ModelInfo(path="m", vocab_size=100, max_model_len=256, tokenizer=Tok())
    rng = random.Random(0)
    floats = [0.0, 1e-30, 1e-6, 0.005, 0.01, 0.5, 1.0, 1.999, 2.0, 2.001, 1e30, float("inf"), float("-inf"),
              float("nan"), -1.0]
    admitted = 0
    for _ in range(3000):
        kw = {"temperature": rng.choice(floats), "top_p": rng.choice(floats),
              "top_k": rng.choice([-2, -1, 0, 1, 50, 10**6]), "max_tokens": rng.choice([-1, 0, 1, 8]),
              "stop": rng.choice([[], [""], ["x"], ["\0"]]), "seed": rng.choice([None, 0, 2**64 - 1])}
        try:
            s = check_generate(build_request([[1, 2]], **kw), model, Limits(4, 4)).groups[0][0]
        except ServiceError:
            s = None                                 # refused before admission: fine
        if s is None:
            continue
        admitted += 1
        sp = SamplingParams(n=1, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens,
                            stop=list(s.stop) or None, seed=s.seed, logprobs=0)
        assert abs(sp.temperature - s.temperature) < 1e-6, kw
    assert admitted > 100
