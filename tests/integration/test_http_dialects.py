"""The vLLM and SGLang HTTP dialects on the shared real service, driven by the `openai` package (sync and
async) and by the request shapes AReaL's SGLang backend and prime-rl's weight updates send; log-probs checked
against an independent forward pass of the float32 model."""
import asyncio
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import torch
from safetensors.torch import save_file

from rollout_service.drafting.reference import processed_logprobs

PROMPTS = [[1, 504, 3458, 314, 260], [1, 1046, 2683, 77]]


def assert_matches_forward_pass(hf_model, prompt, token_ids, logprobs, temperature, top_k=0, top_p=1.0):
    ref = processed_logprobs(hf_model, prompt, list(token_ids), temperature, top_k, top_p)
    assert torch.isfinite(ref).all(), "the service sampled a token the reference rules out"
    np.testing.assert_allclose(logprobs, ref.numpy(), atol=2e-3, rtol=0)


def test_sglang_update_from_disk_then_generate(http, hf_model, tmp_path):
    """AReaL's SGLang backend: /update_weights_from_disk {"model_path", "abort_all_requests"} then /generate
    with input_ids and return_logprob; reads meta_info.output_token_logprobs as (logprob, token id)."""
    weights = tmp_path / "step-1"
    weights.mkdir()
    save_file({k: v.contiguous() for k, v in hf_model.state_dict().items()}, str(weights / "model.safetensors"))
    before = int(http.get("/get_weight_version").json()["weight_version"])
    r = http.post("/update_weights_from_disk", json={"model_path": str(weights), "abort_all_requests": True})
    assert r.status_code == 200 and r.json()["success"], r.text
    version = before + 1
    assert r.json()["weight_version"] == str(version)

    bad = tmp_path / "bad.safetensors"
    save_file({"model.norm.weight": torch.ones(3)}, str(bad))
    r = http.post("/update_weights_from_disk", json={"model_path": str(bad)})
    assert r.status_code == 400 and not r.json()["success"] and "model.norm.weight" in r.json()["message"]
    assert http.get("/get_weight_version").json()["weight_version"] == str(version)

    payload = {"input_ids": PROMPTS[0], "return_logprob": True, "stream": False,
               "sampling_params": {"top_p": 1.0, "top_k": 50, "max_new_tokens": 10, "temperature": 0.8,
                                   "stop_token_ids": [], "ignore_eos": True, "skip_special_tokens": True,
                                   "frequency_penalty": 0.0, "n": 2}}
    r = http.post("/generate", json=payload)
    assert r.status_code == 200, r.text
    assert r.headers["x-rollout-policy-versions"] == str(version)
    for out in r.json():
        meta = out["meta_info"]
        assert meta["weight_version"] == str(version) and meta["finish_reason"]["type"] == "length"
        tokens = [x[1] for x in meta["output_token_logprobs"]]
        assert tokens == out["output_ids"] and len(tokens) == 10
        assert_matches_forward_pass(hf_model, PROMPTS[0], tokens, [x[0] for x in meta["output_token_logprobs"]],
                                    0.8, top_k=50)


def test_openai_completions_token_ids_n_logprobs(service, hf_model):
    """TRL AsyncGRPO's request (token-id prompt, return_token_ids, logprobs 0) through the openai package."""
    with openai.OpenAI(base_url=service.http + "/v1", api_key="unused", max_retries=0) as oa:
        model = oa.models.list().data[0].id
        out = oa.completions.create(model=model, prompt=PROMPTS, n=2, max_tokens=8, temperature=1.0, logprobs=0,
                                    seed=3, extra_body={"return_token_ids": True, "ignore_eos": True})
        assert len(out.choices) == 4 and [c.index for c in out.choices] == [0, 1, 2, 3]
        for c in out.choices:
            prompt = PROMPTS[c.index // 2]
            assert c.prompt_token_ids == prompt and len(c.token_ids) == 8 and c.finish_reason == "length"
            assert_matches_forward_pass(hf_model, prompt, c.token_ids, c.logprobs.token_logprobs, 1.0)
            assert c.rollout["policy_version"] >= 0 and c.weight_versions[0]["end"] == 8
        assert out.usage.completion_tokens == 32
        with pytest.raises(openai.BadRequestError) as e:
            oa.completions.create(model=model, prompt=PROMPTS[0], temperature=5.0)
        assert e.value.message.startswith("Error code: 400") and "temperature" in str(e.value)


def test_openai_async_stream_and_chat(service):
    async def main():
        async with openai.AsyncOpenAI(base_url=service.http + "/v1", api_key="unused", max_retries=0) as oa:
            stream = await oa.completions.create(model="m", prompt=PROMPTS[1], n=3, max_tokens=6, stream=True,
                                                 extra_body={"return_token_ids": True,
                                                             "return_tokens_as_token_ids": True},
                                                 logprobs=1, stream_options={"include_usage": True})
            parts, usage = {}, None                  # a chunk per engine step and choice
            async for chunk in stream:
                for c in chunk.choices:
                    parts.setdefault(c.index, []).append(c)
                usage = chunk.usage or usage
            assert sorted(parts) == [0, 1, 2] and usage.completion_tokens == sum(
                len(c.token_ids) for cs in parts.values() for c in cs)
            assert all(cs[-1].finish_reason is not None for cs in parts.values())
            assert all(t.startswith("token_id:") for cs in parts.values() for c in cs for t in c.logprobs.tokens)
            chat = await oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "2+2?"}],
                                                    max_tokens=5, logprobs=True)
            assert chat.choices[0].message.role == "assistant" and len(chat.choices[0].logprobs.content) >= 1
    asyncio.run(main())


def test_prime_rl_pause_keep_update_resume(service, http, hf_model, tmp_path):
    """prime-rl's in-flight update: /pause?mode=keep, /update_weights {"weight_dir"}, /resume. A request
    admitted before the pause finishes after it, its tokens split between the two versions."""
    save_file({k: v.contiguous() for k, v in hf_model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    before = int(http.get("/weight_info").json()["weight_version"])
    result = {}

    def generate():
        result["r"] = httpx.post(service.http + "/v1/completions", timeout=120, json={
            "model": "m", "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "return_token_ids": True})

    t = threading.Thread(target=generate)
    t.start()
    deadline = time.monotonic() + 30
    while http.get("/v1/status").json()["queue_depth"] == 0:
        assert time.monotonic() < deadline, "the request was never admitted"
    assert http.post("/pause", params={"mode": "keep", "clear_cache": "false"}).status_code == 200
    assert http.get("/is_paused").json() == {"is_paused": True}
    r = http.post("/update_weights", json={"weight_dir": str(tmp_path)})
    assert r.status_code == 200 and r.json()["version"] == before + 1, r.text
    assert http.get("/is_paused").json() == {"is_paused": True}          # the update did not resume it
    assert http.post("/resume").status_code == 200
    t.join(120)
    choice = result["r"].json()["choices"][0]
    assert len(choice["token_ids"]) == 400
    assert [s["version"] for s in choice["weight_versions"]][-1] == str(before + 1)
    assert http.get("/is_paused").json() == {"is_paused": False}
