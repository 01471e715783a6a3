import grpc
import pytest

from rollout_client import build_request
from rollout_service.errors import Name, ServiceError
from rollout_service.model_info import ModelInfo
from rollout_service.validation import Limits, check_generate, sample_seed


class WordTokenizer:
    """Splits on spaces; enough to test text prompts without a real tokenizer."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [len(w) for w in text.split()]}

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return [1] + self(messages[0]["content"])["input_ids"] + [2]


MODEL = ModelInfo(path="m", vocab_size=100, max_model_len=256, tokenizer=WordTokenizer())
LIMITS = Limits(max_prompts_per_request=4, max_samples_per_prompt=8)


def check(prompts, **kw):
    return check_generate(build_request(prompts, **kw), MODEL, LIMITS)


def test_groups_defaults_and_seeds():
    c = check([[1, 2], "a bb ccc"], n=3, seed=5, max_tokens=10, chat=True)
    assert len(c.groups) == 2 and all(len(g) == 3 for g in c.groups)
    assert c.prompt_token_ids[1] == [1, 1, 2, 3, 2] and c.text_prompts == {1}
    s = c.groups[0][0]
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens) == (1.0, 1.0, 0, 10)
    seeds = {q.seed for g in c.groups for q in g}
    assert len(seeds) == 6 and s.seed == sample_seed(5, 0, 0)
    assert len({q.seq_id for g in c.groups for q in g}) == 6
    assert check([[1]]).groups[0][0].seed is None


def test_fingerprint_identifies_content():
    a = check([[1, 2]], request_id="x", seed=1)
    assert a.fingerprint == check([[1, 2]], request_id="x", seed=1).fingerprint
    assert a.fingerprint != check([[1, 3]], request_id="x", seed=1).fingerprint


@pytest.mark.parametrize("prompts,kw,needle", [
    ([[1, 100]], {}, "outside the vocabulary [0, 100)"),
    ([[1] * 250], {"max_tokens": 10}, "context length 256"),
    ([[1]] * 5, {}, "max_prompts_per_request=4"),
    ([[1]], {"n": 9}, "max_samples_per_prompt=8"),
    ([[1]], {"temperature": float("nan")}, "sampling.temperature"),
    ([[1]], {"temperature": float("inf")}, "sampling.temperature: must be a finite value in [0, 2]"),
    ([[1]], {"temperature": 1e30}, "sampling.temperature: must be a finite value in [0, 2]"),
    ([[1]], {"temperature": 2.5}, "sampling.temperature"),
    ([[1]], {"temperature": -0.5}, "sampling.temperature"),
    ([[1]], {"temperature": 0.005}, "below vLLM's floor of 0.01"),
    ([[1]], {"temperature": 1e-6}, "below vLLM's floor of 0.01"),
    ([[1]], {"top_p": float("nan")}, "sampling.top_p"),
    ([[1]], {"top_p": 0.0}, "sampling.top_p"),
    ([[1]], {"top_k": -2}, "sampling.top_k"),
    ([[1]], {"max_tokens": 0}, "sampling.max_tokens"),
    ([[1]], {"stop": [""]}, "sampling.stop"),
    ([[1]], {"stop_token_ids": [100]}, "sampling.stop_token_ids"),
    ([""], {}, "prompts[0]: empty prompt"),
])
def test_rejections_name_the_field(prompts, kw, needle):
    with pytest.raises(ServiceError) as e:
        check(prompts, **kw)
    assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.message


def test_vllms_boundaries_pass():
    for t in (0.0, 0.01, 1.0, 2.0):                  # 0.01 arrives as float32 0.0099999998
        assert check([[1]], temperature=t).groups[0][0].temperature >= 0
    for top_k in (-1, 0, 1, 10**6):
        check([[1]], top_k=top_k)


@pytest.mark.parametrize("prompts,kw,field", [
    ([[1, 100]], {}, "prompts[0].token_ids"),
    ([[1], [1] * 250], {"max_tokens": 10}, "prompts[1]"),
    ([[1]] * 5, {}, "prompts"),
    ([[1]], {"n": 9}, "n"),
    ([[1]], {"temperature": 2.5}, "sampling.temperature"),
    ([[1]], {"max_tokens": 0}, "sampling.max_tokens"),
    ([[1]], {"request_id": "a b"}, "request_id"),
])
def test_rejections_carry_the_field_as_data(prompts, kw, field):
    """The field at fault is data (what the HTTP dialects spell their way), and gRPC's text reads
    "field: detail" as it always did."""
    with pytest.raises(ServiceError) as e:
        check(prompts, **kw)
    assert e.value.field == field and e.value.message.startswith(f"{field}: ")
    assert Name(field) in e.value.parts


def test_a_second_field_in_the_detail_is_a_name():
    limits = Limits(max_prompts_per_request=4, max_samples_per_prompt=8, max_new_tokens=50)
    with pytest.raises(ServiceError) as e:
        check_generate(build_request([[1] * 250], max_tokens=10), MODEL, limits)
    assert e.value.message == ("prompts[0]: 250 prompt tokens + sampling.max_tokens=10 exceed the context length 256; "
                               "shorten the prompt or lower max_tokens")
    assert [p.path for p in e.value.parts if isinstance(p, Name)] == ["prompts[0]", "sampling.max_tokens",
                                                                       "sampling.max_tokens"]
    with pytest.raises(ServiceError) as e:
        check_generate(build_request([[1]], max_tokens=60), MODEL, limits)
    assert e.value.message == "sampling.max_tokens: 60 exceeds the server's max_new_tokens=50; lower max_tokens"
    assert e.value.parts[-1] == Name("sampling.max_tokens", "max_tokens")


def test_routed_experts_are_asked_of_a_mixture_of_experts_only_and_a_partials_routes_are_checked():
    import dataclasses

    import numpy as np

    from rollout_client import RoutedExperts, Sample
    from rollout_service.model_info import MoeShape

    with pytest.raises(ServiceError) as e:                      # a dense policy
        check([[1, 2]], return_routed_experts=True)
    assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT and e.value.field == "return_routed_experts"
    moe = dataclasses.replace(MODEL, moe=MoeShape(num_experts=8, top_k=2, num_layers=3))
    with pytest.raises(ServiceError) as e:                      # an MoE served without capture
        check_generate(build_request([[1, 2]], return_routed_experts=True), moe, LIMITS)
    assert e.value.code is grpc.StatusCode.FAILED_PRECONDITION and "--routed-experts" in e.value.message
    limits = dataclasses.replace(LIMITS, routed_experts=True)
    assert check_generate(build_request([[1, 2]], return_routed_experts=True), moe, limits).groups[0][0] \
        .return_routed_experts

    def partial(rows: int, **kw):
        ids = np.zeros((rows, 3, 2), dtype=np.uint8)
        routes = RoutedExperts(**{"ids": ids, "first_row": 0, "version_spans": [(0, 0)], **kw})
        return Sample(0, 0, np.array([5, 6]), np.array([-1.0, -1.0]), "abort", "", 0, [(0, 0)], 0, 0, 0, "", 2,
                      routed_experts=routes)

    ok = check_generate(build_request([[1, 2]], return_routed_experts=True, partials=[partial(3)], max_tokens=8),
                        moe, limits)
    seq = ok.groups[0][0]
    assert seq.routes_from == 3 and seq.prompt_token_ids == [1, 2, 5, 6]    # rows of prompt + partial - 1 kept
    for bad, field in ((partial(4), "shape"), (partial(3, ids=np.full((3, 3, 2), 9, dtype=np.uint8)), "ids"),
                       (partial(3, version_spans=[(0, 1)]), "version_spans")):
        with pytest.raises(ServiceError) as e:
            check_generate(build_request([[1, 2]], return_routed_experts=True, partials=[bad], max_tokens=8), moe,
                           limits)
        assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.field == f"prompts[0].partial.routed_experts.{field}", e.value.field
