"""What RL frameworks' own clients need of the vLLM dialect beyond completions (compat/vllm_extras.py and the
additions to vllm_api.py / vllm_transfer.py), on FakeEngine (no vLLM): vLLM's /tokenize and /detokenize (SkyRL
without a local tokenizer), SkyRL's /collective_rpc weight-update methods, the `token` string renderers (verifiers'
train client) checks in /inference/v1/generate log-probs, and the packing fields OpenPipe ART sends in update_info.
The frameworks' real clients against real engines: tests/integration/test_framework_clients.py."""
import asyncio

import pytest

from rollout_service.server.auth import Credentials
from tests.unit.test_http_dialects import ADMIN, INFO, INIT, TOKEN, make  # noqa: F401 - the fixture `build` uses


@pytest.fixture
def build(make):  # noqa: F811 - test_http_dialects' fixture: a service on FakeEngines, its HTTP client
    return make


def test_tokenize_and_detokenize_answer_vllms_shapes(build):
    async def main():
        _, _, c = await build()
        r = await c.post("/tokenize", json={"model": "m", "prompt": "a bb ccc", "return_token_strs": False})
        assert r.status_code == 200, r.text
        assert r.json() == {"count": 3, "max_model_len": 256, "tokens": [1, 2, 3], "token_strs": None}
        r = await c.post("/tokenize", json={"messages": [{"role": "user", "content": "hi there"}]})
        assert r.status_code == 200 and r.json()["tokens"] == [1, 2, 5, 2]        # the chat template
        r = await c.post("/detokenize", json={"model": "m", "tokens": [4, 5]})
        assert r.status_code == 200 and r.json() == {"prompt": "w4 w5"}
        for path, body, field in [("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": 3}, "prompt"),
                                  ("/tokenize", {"messages": [{"role": "user"}]}, "messages[0].content"),
                                  ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, "add_special_tokens"),
                                  ("/detokenize", {"tokens": [1, 100]}, "tokens"),
                                  ("/detokenize", {"tokens": "1 2"}, "tokens"), ("/detokenize", {}, "tokens")]:
            r = await c.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (path, body, r.text)
            assert r.json()["error"]["message"].startswith(field)
    asyncio.run(main())


def test_generate_logprobs_carry_the_token_string_renderers_checks(build):
    async def main():
        _, _, c = await build()
        r = await c.post("/inference/v1/generate", json={"model": "m", "token_ids": [4, 5], "cache_salt": "v0",
                                                         "sampling_params": {"max_tokens": 3, "logprobs": 1,
                                                                             "skip_special_tokens": False}})
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        assert [e["token"] for e in ch["logprobs"]["content"]] == [f"token_id:{t}" for t in ch["token_ids"]]
        assert [e["token_id"] for e in ch["logprobs"]["content"]] == ch["token_ids"]       # vLLM 0.32's field too
    asyncio.run(main())


def test_collective_rpc_serves_skyrls_weight_update_methods(build):
    """SkyRL's broadcast sync: skyrl_start_weight_update, update_weights_nccl {update_info}, skyrl_finish_weight_update
    are vLLM's start / update / finish; any other method is a 501 naming the served ones; admin token required."""
    async def main():
        pool, _, c = await build(transfer=True)
        assert (await c.post("/init_weight_transfer_engine", json={"init_info": INIT})).status_code == 200

        async def rpc(method, **kwargs):
            return await c.post("/collective_rpc", json={"method": method, "kwargs": kwargs})
        r = await rpc("update_weights_ipc", update_info=INFO)
        assert r.status_code == 501 and r.json()["error"]["param"] == "method"
        assert "skyrl_start_weight_update" in r.json()["error"]["message"] and pool.policy_version == 0
        assert (await c.post("/collective_rpc", json={})).status_code == 400
        r = await rpc("update_weights_nccl", update_info=INFO)          # not started: vLLM's order, 409
        assert r.status_code == 409 and "/start_weight_update" in r.json()["error"]["message"]
        r = await rpc("skyrl_start_weight_update", is_checkpoint_format=True)
        assert r.status_code == 200 and r.json() == {"results": [{"message": "Weight update started"}]}
        r = await rpc("update_weights_nccl")
        assert r.status_code == 400 and r.json()["error"]["param"] == "kwargs.update_info"
        r = await rpc("update_weights_nccl", update_info=INFO | {"packed": True})
        assert r.status_code == 200 and r.json()["results"][0]["version"] == 1, r.text
        assert pool.policy_version == 1 and pool.engines[0].weights["a.weight"].sum() == 24
        r = await rpc("skyrl_finish_weight_update")
        assert r.status_code == 200 and r.json()["results"][0]["weight_version"] == "1"
        assert (await rpc("skyrl_finish_weight_update")).status_code == 409           # none open
    asyncio.run(main())


def test_collective_rpc_needs_the_admin_token(build):
    async def main():
        _, _, c = await build(creds=Credentials(TOKEN, ADMIN))
        r = await c.post("/collective_rpc", json={"method": "skyrl_finish_weight_update"},
                         headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 403
        r = await c.post("/tokenize", json={"prompt": "a"}, headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200
    asyncio.run(main())


def test_update_info_packing_fields_must_agree_with_the_group(build):
    """OpenPipe ART sends packed_buffer_size_bytes and packed_num_buffers inside update_info (vLLM's earlier
    shape): accepted when they match the group's chunk size, a 400 naming the field otherwise (nothing changed)."""
    async def main():
        pool, _, c = await build(transfer=True)
        init = INIT | {"packed_buffer_size_bytes": 1 << 20}
        assert (await c.post("/init_weight_transfer_engine", json={"init_info": init})).status_code == 200
        assert (await c.post("/start_weight_update", json={"is_checkpoint_format": True})).status_code == 200
        for bad, field in [({"packed_buffer_size_bytes": 1 << 30}, "update_info.packed_buffer_size_bytes"),
                           ({"packed_num_buffers": 0}, "update_info.packed_num_buffers")]:
            r = await c.post("/update_weights", json={"update_info": INFO | bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert pool.policy_version == 0
        r = await c.post("/update_weights", json={"update_info": INFO | {
            "packed": True, "packed_buffer_size_bytes": 1 << 20, "packed_num_buffers": 2}})
        assert r.status_code == 200 and r.json()["version"] == 1, r.text
    asyncio.run(main())


def test_return_tokens_as_token_ids_server_default(build):
    """serve --return-tokens-as-token-ids (vLLM's flag; OpenPipe ART's engines run with it): chat log-prob tokens
    read token_id:N unless the request says otherwise."""
    async def main():
        _, _, c = await build()
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True}
        r = (await c.post("/v1/chat/completions", json=body)).json()["choices"][0]
        assert [e["token"] for e in r["logprobs"]["content"]] == [f"w{t}" for t in r["token_ids"]]   # the default
        c._transport.app.state.gateway.tokens_as_ids = True
        r = (await c.post("/v1/chat/completions", json=body)).json()["choices"][0]
        assert [e["token"] for e in r["logprobs"]["content"]] == [f"token_id:{t}" for t in r["token_ids"]]
        r = (await c.post("/v1/chat/completions", json=body | {"return_tokens_as_token_ids": False})).json()
        assert r["choices"][0]["logprobs"]["content"][0]["token"].startswith("w")
        r = (await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "logprobs": 0})).json()
        assert r["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")
    asyncio.run(main())


def test_sglang_flush_cache_by_get_while_paused_and_model_info(build, monkeypatch):
    """slime's engine calls GET /flush_cache between /update_weights_from_disk and /continue_generation (paused), as
    SGLang serves it; sglang-router asks /model_info (SGLang's newer name of /get_model_info) first."""
    from tests.fake_engine import FakeEngine

    flushed = []

    async def reset(self):
        flushed.append(self.state.name)
        return True
    monkeypatch.setattr(FakeEngine, "reset_prefix_cache", reset)

    async def main():
        _, _, c = await build()
        assert (await c.post("/pause_generation", json={})).status_code == 200
        r = await c.get("/flush_cache")
        assert r.status_code == 200 and r.text == "Cache flushed." and flushed == ["PAUSED"]
        assert (await c.post("/continue_generation")).status_code == 200
        assert (await c.post("/flush_cache")).status_code == 200 and flushed == ["PAUSED", "READY"]
        assert (await c.get("/model_info")).json() == (await c.get("/get_model_info")).json()
    asyncio.run(main())


def test_verl_server_manager_reads_sampling_as_verls_vllm_server(monkeypatch):
    """rollout_client.verl.ServerManager (verl's server_manager on gRPC Generate): max_tokens as verl's vLLM server
    bounds it, logprobs a flag, top_k -1 for off, penalties and multimodal inputs refused naming the field, the
    policy versions in TokenOutput's extra fields. verl's TokenOutput is stood in for (importing verl takes seconds)."""
    import sys
    import types

    import numpy as np

    from rollout_client.types import Sample
    from rollout_client.verl import ServerManager

    replica = types.ModuleType("verl.workers.rollout.replica")
    replica.TokenOutput = lambda **kw: types.SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "verl.workers.rollout.replica", replica)
    sent = {}

    async def generate_all(prompts, **kw):
        sent.update(kw, prompts=prompts)
        return [[Sample(prompt_index=0, sample_index=0, token_ids=np.array([5, 6]), logprobs=np.array([-1.0, -2.0]),
                        finish_reason="abort", stop_string="", policy_version=4, version_spans=[(3, 0), (4, 1)],
                        draft_version=0, num_drafted=0, num_accepted=0, text="", num_prompt_tokens=2)]]

    async def main():
        manager = ServerManager("127.0.0.1:1", {"prompt_length": 10, "response_length": 6, "max_model_len": 20})
        assert manager.max_tokens({}, 8) == 6 and manager.max_tokens({}, 12) == 4        # the response budget
        assert manager.max_tokens({"max_tokens": 50}, 8) == 12                           # within the context
        assert manager.max_tokens({"max_new_tokens": 3}, 8) == 3
        with pytest.raises(ValueError, match="prompt_ids"):
            manager.max_tokens({}, 20)
        monkeypatch.setattr(manager.client, "generate_all", generate_all)
        out = await manager.generate("req-1", prompt_ids=[1, 2], sampling_params={
            "temperature": 0.7, "top_k": -1, "top_p": 0.9, "logprobs": True, "repetition_penalty": 1.0})
        assert out.token_ids == [5, 6] and out.log_probs == [-1.0, -2.0] and out.stop_reason == "aborted"
        assert out.extra_fields == {"global_steps": 4, "min_global_steps": 3, "max_global_steps": 4}
        assert sent["prompts"] == [[1, 2]] and sent["top_k"] == 0 and sent["max_tokens"] == 6
        assert sent["session_id"] == "req-1" and sent["temperature"] == 0.7 and sent["return_partial"]
        out = await manager.generate("r", prompt_ids=[1], sampling_params={"max_tokens": 2})
        assert out.log_probs is None and sent["max_tokens"] == 2
        with pytest.raises(ValueError, match="repetition_penalty"):
            await manager.generate("r", prompt_ids=[1], sampling_params={"repetition_penalty": 1.1})
        with pytest.raises(ValueError, match="image_data"):
            await manager.generate("r", prompt_ids=[1], sampling_params={}, image_data=["x"])
        await manager.close()
    asyncio.run(main())
