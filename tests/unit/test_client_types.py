import numpy as np

from rollout_client import Sample, build_request
from rollout_service.api import pb


def test_sample_from_proto_gives_arrays():
    m = pb.Sample(prompt_index=1, sample_index=2, token_ids=[5, 6], logprobs=[-0.5, -1.5],
                  finish_reason=pb.FINISH_REASON_LENGTH, policy_version=3,
                  version_spans=[pb.VersionSpan(policy_version=3, first_token=0)], prompt_token_ids=[1, 2])
    s = Sample.from_proto(m)
    assert s.token_ids.dtype == np.int64 and s.logprobs.dtype == np.float32
    assert s.finish_reason == "length" and s.version_spans == [(3, 0)]
    assert s.prompt_token_ids.tolist() == [1, 2]


def test_build_request_sets_only_given_optionals():
    r = build_request([[1, 2], "hello"], n=4, temperature=0.0, chat=True)
    assert r.sampling.HasField("temperature") and r.sampling.temperature == 0.0
    assert not r.sampling.HasField("top_p") and not r.sampling.HasField("seed")
    assert r.prompts[1].text == "hello" and r.prompts[1].apply_chat_template
