"""The vLLM and SGLang HTTP dialects' bookkeeping on FakeEngine (no vLLM): translation, errors naming the
dialect's fields, the shared queue, weight loads through the commit, pause, auth. Real engines and the real
`openai` client: tests/integration/test_http_dialects.py."""
import asyncio
import functools
import json

import httpx
import pytest
import torch
from safetensors.torch import save_file

from rollout_service.engine.base import EngineState
from rollout_service.engine.types import SeqRequest, SeqResult, TokenDelta
from rollout_service.model_info import ModelInfo
from rollout_service.pool.pool import EnginePool
from rollout_service.server.auth import Credentials
from rollout_service.server.grpc_service import RolloutServicer
from rollout_service.server.http_app import build_http_app
from rollout_service.validation import Limits
from rollout_service.weights.service import WeightService
from rollout_service.weights.transfer import WeightTransfer
from tests.fake_engine import FakeEngine

ORIGINAL = {"a.weight": torch.zeros(4, 3)}
TOKEN, ADMIN = "client-token-0123456789", "admin-token-0123456789"


class Tokenizer:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [len(w) for w in text.split()]}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, tools=None,
                            continue_final_message=False, **kw):
        """[1] + each word's length + [2]; as text (tokenize=False, how the service renders chats): words that
        tokenize to that."""
        words = [w for m in messages for w in (m["content"] or "").split()]
        return [1] + [len(w) for w in words] + [2] if tokenize else " ".join(["x", *words, "yy"])

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{t}" for t in ids)

    def batch_decode(self, seqs):
        return [self.decode(s) for s in seqs]


class TransferEngine(FakeEngine):
    """FakeEngine with a weight-transfer backend: joins instantly; "receives" every tensor as 2.0."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.init_infos: list[dict] = []
        self.update_infos: list[dict] = []

    async def init_transfer(self, init_info: dict) -> int:
        self.init_infos.append(init_info)
        self.events.append(("init_transfer",))
        return 1

    async def close_transfer(self) -> None:
        self.events.append(("close_transfer",))

    async def prepare_transfer(self, update_info, target, record_path, on_receiving) -> None:
        self.update_infos.append(update_info)
        on_receiving()
        await asyncio.sleep(0)
        tensors = {n: torch.full(s, 2.0) for n, s in zip(update_info["names"], update_info["shapes"])}
        if record_path:
            save_file(tensors, record_path)
        self.prepared = (target, tensors)


@pytest.fixture
def make(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file(ORIGINAL, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text("{}")
    save_file({"a.weight": torch.ones(4, 3)}, str(tmp_path / "new.safetensors"))
    save_file({"a.weight": torch.ones(3, 4)}, str(tmp_path / "bad.safetensors"))

    async def build(creds=None, max_queue=10, engines=1, transfer=False, kind=None):
        kind = kind or (TransferEngine if transfer else FakeEngine)
        pool = EnginePool([kind(f"e{i}", vocab_size=100) for i in range(engines)], max_queue=max_queue,
                          checkpoints={"policy": ckpt})
        await pool.start()
        weights = WeightService.create(pool, "float32", weights_roots=[str(tmp_path)])
        model = ModelInfo(path="tiny", vocab_size=100, max_model_len=256, tokenizer=Tokenizer())
        servicer = RolloutServicer(pool, model, Limits(4, 8), weights,
                                   transfer=WeightTransfer(weights, "gloo", 5.0, watch=False) if transfer else None)
        app = build_http_app(servicer, creds)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        return pool, weights, client
    return build


def test_completions_token_ids_n_logprobs(make):
    async def main():
        pool, _, c = await make()
        r = await c.post("/v1/completions", json={
            "model": "anything", "prompt": [[5, 6], [7]], "n": 3, "max_tokens": 4, "logprobs": 0,
            "return_token_ids": True, "return_tokens_as_token_ids": True, "seed": 1})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [ch["index"] for ch in body["choices"]] == list(range(6))
        ch = body["choices"][4]                          # prompt 1, sample 1
        assert ch["prompt_token_ids"] == [7] and len(ch["token_ids"]) == 4
        assert ch["logprobs"]["tokens"] == [f"token_id:{t}" for t in ch["token_ids"]]
        assert len(ch["logprobs"]["token_logprobs"]) == 4 and ch["finish_reason"] == "length"
        assert ch["text"] == " ".join(f"w{t}" for t in ch["token_ids"])
        assert ch["rollout"]["policy_version"] == 0 and ch["weight_versions"] == [{"version": "0", "start": 0,
                                                                                   "end": 4}]
        assert r.headers["x-rollout-policy-versions"] == "0"
        assert body["usage"]["completion_tokens"] == 24 and body["usage"]["prompt_tokens"] == 3   # once, as vLLM
        assert pool.depth == 0
        # the defaults of vLLM: max_tokens 16, no logprobs
        d = (await c.post("/v1/completions", json={"model": "m", "prompt": "a bb"})).json()["choices"][0]
        assert len(d["token_ids"] if "token_ids" in d else d["text"].split()) == 16 and d["logprobs"] is None
    asyncio.run(main())


def test_errors_name_the_dialects_fields_and_change_nothing(make):
    async def main():
        pool, _, c = await make()
        cases = [({"prompt": [1], "temperature": 5.0}, "temperature"),
                 ({"prompt": [1], "max_tokens": 0}, "max_tokens"),
                 ({"prompt": [1, 1000]}, "prompt[0].token_ids"),
                 ({"prompt": {"x": 1}}, "prompt"),
                 ({"prompt": [1], "logprobs": 25}, "logprobs"),
                 ({"prompt": [1], "n": "2"}, "n"),
                 ({"prompt": [1], "frequency_penalty": 0.5}, "frequency_penalty"),
                 ({"prompt": [1], "min_p": 0.1}, "min_p")]
        for body, field in cases:
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 400, (body, r.text)
            msg = r.json()["error"]["message"]
            assert msg.startswith(field) and "sampling." not in msg, msg
        r = await c.post("/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 0}})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("sampling_params.max_new_tokens")
        r = await c.post("/v1/completions", content=b"{not json")
        assert r.status_code == 400
        # the one admission queue: 2 prompts x 8 samples exceed max_queue 10 -> 429, as gRPC's RESOURCE_EXHAUSTED
        r = await c.post("/v1/completions", json={"prompt": [[1], [2]], "n": 8})
        assert r.status_code == 429 and "max_queue is 10" in r.json()["error"]["message"]
        r = await c.post("/v1/completions", json={"prompt": [1], "min_policy_version": 3})
        assert r.status_code == 409 and "min_policy_version=3" in r.json()["error"]["message"]
        assert pool.depth == 0 and not pool.live
        for e in pool.engines:                  # no engine ready -> 503, /health too
            e.state = EngineState.STARTING
        assert (await c.post("/v1/completions", json={"prompt": [1]})).status_code == 503
        assert (await c.get("/health")).status_code == 503
    asyncio.run(main())


def test_stream_sends_a_chunk_per_step_then_the_rest_usage_and_done(make):
    async def main():
        _, _, c = await make()
        r = await c.post("/v1/completions", json={"prompt": [3, 4], "n": 3, "max_tokens": 5, "stream": True,
                                                  "return_token_ids": True,
                                                  "stream_options": {"include_usage": True}})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-rollout-policy-version"] == "0"
        events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-2]]
        by_choice: dict[int, list[dict]] = {}
        for ch in chunks:
            by_choice.setdefault(ch["choices"][0]["index"], []).append(ch["choices"][0])
        assert sorted(by_choice) == [0, 1, 2]
        for parts in by_choice.values():
            assert len(parts) >= 2                                  # token by token, not one chunk at the end
            assert [p["finish_reason"] for p in parts] == [None] * (len(parts) - 1) + ["length"]
            assert len([t for p in parts for t in p["token_ids"]]) == 5
            assert "".join(p["text"] for p in parts).split() == [f"w{t}" for p in parts for t in p["token_ids"]]
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 15
    asyncio.run(main())



def test_stream_chunks_count_text_offset_on_and_send_prompt_ids_once_as_vllm(make):
    """vLLM 0.32's completion_stream_generator (entrypoints/openai/completion/serving.py): a choice's
    logprobs.text_offset counts on across its chunks (next_text_offsets), prompt_token_ids comes in its first chunk
    only (null after), and usage counts each prompt once, not once per sample."""
    async def main():
        # 50 ms a token: each token its own chunk even on a loaded machine (at 1 ms, a stalled writer sent a
        # choice's 5 tokens in one chunk, and the offsets across chunks went unchecked: the full suite, 2026-11-28)
        _, _, c = await make(kind=functools.partial(FakeEngine, step_s=0.05))
        prompts = [[3, 4], [5, 6, 7]]
        r = await c.post("/v1/completions", json={"prompt": prompts, "n": 2, "max_tokens": 5, "stream": True,
                                                  "logprobs": 0, "return_token_ids": True,
                                                  "stream_options": {"include_usage": True}})
        assert r.status_code == 200, r.text
        events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
        by_choice: dict[int, list[dict]] = {}
        for e in events[:-2]:
            ch = json.loads(e)["choices"][0]
            by_choice.setdefault(ch["index"], []).append(ch)
        assert sorted(by_choice) == [0, 1, 2, 3]
        for i, parts in by_choice.items():
            assert sum(bool(p["token_ids"]) for p in parts) >= 2            # several chunks carry tokens
            assert parts[0]["prompt_token_ids"] == prompts[i // 2]
            assert all("prompt_token_ids" in p and p["prompt_token_ids"] is None for p in parts[1:])
            tokens = [t for p in parts for t in p["logprobs"]["tokens"]]
            assert tokens == [f"w{t}" for p in parts for t in p["token_ids"]] and len(tokens) == 5
            offsets = [o for p in parts for o in p["logprobs"]["text_offset"]]
            assert offsets == [sum(map(len, tokens[:k])) for k in range(5)]     # as one unstreamed answer's
        usage = json.loads(events[-2])["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (5, 20, 25)
        # n samples of a prompt the (fake) prefix cache holds: the prompt's hit once, never more than its tokens
        await c.post("/v1/completions", json={"prompt": [8, 9, 10], "max_tokens": 1})
        body = (await c.post("/v1/completions", json={"prompt": [8, 9, 10], "n": 3, "max_tokens": 2})).json()
        assert body["usage"]["prompt_tokens"] == 3
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 2
    asyncio.run(main())

class HeldEngine(FakeEngine):
    """Streams each sample's first token, then holds every sample until `release` is set (the rest of its tokens
    and its end come after)."""

    release: asyncio.Event

    async def generate(self, req: SeqRequest, on_delta=None) -> SeqResult:
        tokens = list(range(10, 10 + req.max_tokens))
        self.active.add(req.seq_id)
        try:
            on_delta(TokenDelta(start=0, token_ids=tokens[:1], logprobs=[-1.0], version_spans=[(0, 0)]))
            await self.release.wait()
        finally:
            self.active.discard(req.seq_id)
        return SeqResult(token_ids=tokens, logprobs=[-1.0] * len(tokens), finish_reason="length", policy_version=0,
                         version_spans=[(0, 0)])


def test_stream_sends_each_samples_first_token_while_every_sample_runs(make):
    """Time to first token: a streamed request with n samples sends each sample's first token as it comes, before
    any sample finishes (never held back for the other samples, the whole request or a buffer). The engine holds
    every sample after its first token until the client has read all n of them: a dialect that waited would never
    send them (the wait below would time out)."""
    async def main():
        HeldEngine.release = asyncio.Event()
        pool, _, c = await make(kind=HeldEngine)
        engine = pool.engines[0]
        app = c._transport.app
        body = json.dumps({"prompt": [3, 4], "n": 4, "max_tokens": 5, "stream": True, "logprobs": 0,
                           "return_token_ids": True}).encode()
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
                 "root_path": "", "headers": [(b"host", b"t"), (b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 1), "server": ("t", 80)}
        requested, never = False, asyncio.Event()
        firsts: dict[int, dict] = {}
        running_at_firsts: list[int] = []
        sent: list[bytes] = []

        async def receive():
            nonlocal requested
            if not requested:
                requested = True
                return {"type": "http.request", "body": body, "more_body": False}
            await never.wait()                     # the client stays connected

        async def send(message):
            if message["type"] != "http.response.body":
                return
            sent.append(message.get("body", b""))
            for line in message.get("body", b"").decode().splitlines():
                if line.startswith("data: {"):
                    for ch in json.loads(line[6:])["choices"]:
                        if ch["token_ids"] and ch["index"] not in firsts:
                            firsts[ch["index"]] = ch
                            if len(firsts) == 4:
                                running_at_firsts.append(len(engine.active))
                                HeldEngine.release.set()

        await asyncio.wait_for(app(scope, receive, send), 10)
        assert running_at_firsts == [4]            # all four first tokens out while all four samples ran
        assert sorted(firsts) == [0, 1, 2, 3]
        assert all(ch["finish_reason"] is None and len(ch["token_ids"]) == 1 for ch in firsts.values())
        text = b"".join(sent).decode()
        assert text.endswith("data: [DONE]\n\n")
        ends = [json.loads(e[6:])["choices"][0] for e in text.split("\n\n") if e.startswith("data: {")]
        assert sorted(len(ch["token_ids"]) for ch in ends if ch["finish_reason"]) == [4] * 4   # the rest after
    asyncio.run(main())


def test_chat_and_tokens_endpoint(make):
    async def main():
        _, _, c = await make()
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi there"}],
                                                       "max_tokens": 3, "logprobs": True, "return_token_ids": True})
        body = r.json()
        assert r.status_code == 200 and body["prompt_token_ids"] == [1, 2, 5, 2]
        ch = body["choices"][0]
        assert len(ch["token_ids"]) == 3 and len(ch["logprobs"]["content"]) == 3
        assert ch["message"]["role"] == "assistant"
        r = await c.post("/inference/v1/generate", json={"token_ids": [4, 5], "sampling_params": {
            "max_tokens": 2, "n": 2, "logprobs": 0}})
        body = r.json()
        assert r.status_code == 200 and len(body["choices"]) == 2
        assert [x["token_id"] for x in body["choices"][1]["logprobs"]["content"]] == body["choices"][1]["token_ids"]
        r = await c.post("/inference/v1/generate", json={"token_ids": [4], "sampling_params": {"top_p": 0}})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("sampling_params.top_p")
    asyncio.run(main())


def test_sglang_generate_single_and_batch(make):
    async def main():
        _, _, c = await make()
        r = await c.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3},
                                            "return_logprob": True})
        one = r.json()
        assert r.status_code == 200 and len(one["output_ids"]) == 3
        assert [t for _, t, _ in one["meta_info"]["output_token_logprobs"]] == one["output_ids"]
        assert one["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
        assert one["meta_info"]["weight_version"] == "0" and one["meta_info"]["prompt_tokens"] == 2
        r = await c.post("/generate", json={"text": ["a b", "c"], "sampling_params": {"max_new_tokens": 2, "n": 2}})
        many = r.json()
        assert len(many) == 4 and many[2]["meta_info"]["prompt_tokens"] == 1
        assert "output_token_logprobs" not in many[0]["meta_info"]
        r = await c.post("/generate", json={"input_ids": [1], "text": "a"})
        assert r.status_code == 400
    asyncio.run(main())


def test_weight_updates_by_path_commit_or_change_nothing(make, tmp_path):
    async def main():
        pool, weights, c = await make()
        r = await c.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "bad.safetensors")})
        assert r.status_code == 400 and r.json()["success"] is False and "shape" in r.json()["message"]
        # outside the roots: PERMISSION_DENIED
        r = await c.post("/update_weights_from_disk", json={"model_path": "/etc"})
        assert r.status_code == 403 and "weights-root" in r.json()["message"]
        assert pool.policy_version == 0
        r = await c.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "new.safetensors")})
        assert r.status_code == 200 and r.json()["weight_version"] == "1", r.text
        assert pool.policy_version == 1 and pool.engines[0].weights["a.weight"].sum() == 12
        assert (await c.get("/get_weight_version")).json() == {"weight_version": "1"}
        # prime-rl's filesystem update: the next integer; an explicit older version is refused
        r = await c.post("/update_weights", json={"weight_dir": str(tmp_path / "new.safetensors")})
        assert r.status_code == 200 and r.json()["version"] == 2
        r = await c.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "new.safetensors"),
                                                            "weight_version": "2"})
        assert r.status_code == 409 and "not newer" in r.json()["message"]
        r = await c.post("/update_weights", json={"update_info": {}})       # vLLM's weight transfer: validated
        assert r.status_code == 400 and "update_info.names" in r.json()["error"]["message"]
        assert (await c.post("/update_weights_from_distributed", json={})).status_code == 501
        gen = (await c.post("/generate", json={"input_ids": [1]})).json()
        assert gen["meta_info"]["weight_version"] == "2"
    asyncio.run(main())


def test_pause_keep_then_update_then_resume(make, tmp_path):
    """prime-rl's sequence: /pause?mode=keep, /update_weights, /resume. The commit leaves engines paused."""
    async def main():
        pool, _, c = await make()
        e = pool.engines[0]
        assert (await c.post("/pause", params={"mode": "keep"})).status_code == 200
        assert (await c.get("/is_paused")).json() == {"is_paused": True}
        r = await c.post("/update_weights", json={"weight_dir": str(tmp_path / "new.safetensors")})
        assert r.status_code == 200
        assert e.state is EngineState.PAUSED and e.events[-1] != ("resume",)
        assert (await c.post("/resume")).status_code == 200
        assert e.state is EngineState.READY and (await c.get("/is_paused")).json() == {"is_paused": False}
        assert [ev for ev in e.events if ev[0] in ("pause", "resume")] == [("pause", "keep"), ("resume",)]
        assert (await c.post("/pause", params={"mode": "later"})).status_code == 400
        assert (await c.post("/pause_generation", json={"mode": "in_place"})).status_code == 200
        assert e.events[-1] == ("pause", "keep")
        await c.post("/continue_generation")
        assert e.state is EngineState.READY
    asyncio.run(main())


def test_abort_ends_samples_with_finish_reason_abort(make):
    async def main():
        pool, _, c = await make()
        pool.engines[0].step_s = 0.05
        task = asyncio.create_task(c.post("/v1/completions", json={"prompt": [1], "n": 2, "max_tokens": 100}))
        while not pool.live:
            await asyncio.sleep(0.01)
        assert (await c.post("/abort_requests", json={})).json()["aborted"] == 1
        body = (await task).json()
        assert [ch["finish_reason"] for ch in body["choices"]] == ["abort", "abort"]
        assert pool.depth == 0
    asyncio.run(main())


def test_a_pause_in_abort_mode_answers_the_tokens_each_sample_has(make):
    """As vLLM and SGLang do: an aborted sample comes back with its tokens and log-probs (finish_reason abort), so a
    client can continue it (AReaL's partial rollouts: tests/integration/test_areal_client.py)."""
    async def main():
        pool, _, c = await make()
        pool.engines[0].step_s = 0.01
        for path, body in (("/v1/completions", {"prompt": [1], "n": 2, "max_tokens": 200, "logprobs": 0,
                                                "return_token_ids": True}),
                           ("/generate", {"input_ids": [1], "return_logprob": True,
                                          "sampling_params": {"max_new_tokens": 200}})):
            task = asyncio.create_task(c.post(path, json=body))
            while not pool.live:
                assert not task.done(), task.result().text
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            assert (await c.post("/pause", params={"mode": "abort"})).status_code == 200
            out = (await task).json()
            await c.post("/resume")
            if path == "/generate":
                meta = out["meta_info"]
                assert meta["finish_reason"]["type"] == "abort" and 0 < len(out["output_ids"]) < 200
                assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
            else:
                for ch in out["choices"]:
                    assert ch["finish_reason"] == "abort" and 0 < len(ch["token_ids"]) < 200
                    assert len(ch["logprobs"]["token_logprobs"]) == len(ch["token_ids"])
    asyncio.run(main())


def test_auth_same_tokens_admin_for_control(make, tmp_path):
    async def main():
        _, _, c = await make(creds=Credentials(TOKEN, ADMIN))
        user, admin = {"Authorization": f"Bearer {TOKEN}"}, {"Authorization": f"Bearer {ADMIN}"}
        assert (await c.get("/health")).status_code == 200                     # probes need no secret
        assert (await c.post("/v1/completions", json={"prompt": [1]})).status_code == 401
        assert (await c.post("/v1/completions", json={"prompt": [1], "max_tokens": 1}, headers=user)).status_code == 200
        body = {"model_path": str(tmp_path / "new.safetensors")}
        r = await c.post("/update_weights_from_disk", json=body, headers=user)
        assert r.status_code == 403 and "admin token" in r.json()["error"]["message"]
        assert (await c.post("/pause", headers=user)).status_code == 403
        assert (await c.post("/update_weights_from_disk", json=body, headers=admin)).status_code == 200
    asyncio.run(main())


def test_models_lists_the_served_model(make):
    async def main():
        _, _, c = await make()
        data = (await c.get("/v1/models")).json()["data"][0]
        assert data["id"] == "tiny" and data["max_model_len"] == 256
        assert (await c.get("/health")).status_code == 200
    asyncio.run(main())


INIT = {"master_address": "127.0.0.1", "master_port": 29555, "rank_offset": 1, "world_size": 2, "packed": True}
INFO = {"names": ["a.weight"], "dtype_names": ["float32"], "shapes": [[4, 3]]}


def test_vllm_weight_transfer_init_checks_the_trainers_shape(make):
    """TRL's async GRPO set-up: /get_world_size, /server_info, then /init_weight_transfer_engine with the world
    size it derived; a payload that does not fit the group is a 400 naming the field and what it must be."""
    async def main():
        pool, _, c = await make(transfer=True)
        assert (await c.get("/get_world_size")).json() == {"world_size": 1}
        info = (await c.get("/server_info", params={"config_format": "json"})).json()
        assert info["vllm_config"]["model_config"]["dtype"] == "torch.float32"
        assert info["vllm_config"]["model_config"]["model"] == "tiny"
        assert info["vllm_config"]["model_config"]["logprobs_mode"] == "processed_logprobs"     # TRL's GRPO reads it

        async def init(**changes):
            return await c.post("/init_weight_transfer_engine", json={"init_info": INIT | changes})
        cases = [({"world_size": 3}, "init_info.world_size: must be 2"), ({"rank_offset": 0}, "init_info.rank_offset"),
                 ({"rank_offset": 2}, "init_info.world_size: must be 3"), ({"packed": False}, "init_info.packed"),
                 ({"master_port": "x"}, "init_info.master_port"), ({"master_port": 0}, "init_info.master_port"),
                 ({"bogus": 1}, "init_info.bogus"), ({"packed_buffer_size_bytes": 0}, "packed_buffer_size_bytes"),
                 ({"nccl_unique_id_b64": "AAAA"}, "nccl_unique_id_b64")]
        for change, field in cases:
            r = await init(**change)
            assert r.status_code == 400 and field in r.json()["error"]["message"], (change, r.text)
        r = await c.post("/init_weight_transfer_engine", json={"init_info": {"master_port": 1}})
        assert r.status_code == 400 and "init_info.master_address" in r.text
        assert (await c.post("/init_weight_transfer_engine", json={})).status_code == 400
        assert pool.engines[0].init_infos == []                     # nothing was set up by a refused payload
        r = await init()
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["message"] == "Weight transfer initialized" and body["world_size"] == 2
        assert body["engines"] == [{"engine": "e0", "rank_offset": 1, "ranks": 1}]
        sent = pool.engines[0].init_infos[-1]
        assert sent["rank_offset"] == 1 and sent["world_size"] == 2 and sent["packed_buffer_size_bytes"] == 1 << 30
        r = await init(packed_buffer_size_bytes=1 << 20)            # the trainer's chunk size reaches the engines
        assert r.status_code == 200 and pool.engines[0].init_infos[-1]["packed_buffer_size_bytes"] == 1 << 20
        r = await init(world_size=5)                                # refused: the group set up stays
        assert r.status_code == 400 and ("close_transfer",) != pool.engines[0].events[-1]
        r = await c.post("/shutdown_weight_transfer_engine")
        assert r.status_code == 200 and r.json() == {"message": "Weight transfer shut down"}
        assert pool.engines[0].events[-1] == ("close_transfer",)
    asyncio.run(main())


def test_vllm_weight_transfer_off_is_a_conflict(make):
    async def main():
        _, _, c = await make()                                      # engine.weight_transfer = none
        r = await c.post("/init_weight_transfer_engine", json={"init_info": INIT})
        assert r.status_code == 409 and "weight transfer is off" in r.json()["error"]["message"]
    asyncio.run(main())


def test_vllm_weight_update_start_update_finish(make):
    """start / update_weights / finish: each update_weights is the next committed version; the order enforced
    (409), the payload validated (400), weight_version checked against what was committed."""
    async def main():
        pool, _, c = await make(transfer=True)
        e = pool.engines[0]
        r = await c.post("/start_weight_update", json={"is_checkpoint_format": True})
        assert r.status_code == 409 and "/init_weight_transfer_engine" in r.json()["error"]["message"]
        assert (await c.post("/init_weight_transfer_engine", json={"init_info": INIT})).status_code == 200
        r = await c.post("/update_weights", json={"update_info": INFO})
        assert r.status_code == 409 and "/start_weight_update" in r.json()["error"]["message"]
        assert (await c.post("/finish_weight_update")).status_code == 409
        r = await c.post("/start_weight_update", json={"is_checkpoint_format": False})
        assert r.status_code == 400 and "is_checkpoint_format" in r.text
        r = await c.post("/start_weight_update", json={"is_checkpoint_format": True})
        assert r.status_code == 200 and r.json() == {"message": "Weight update started"}
        assert (await c.post("/start_weight_update")).status_code == 409            # one open at a time
        assert (await c.post("/start_draft_weight_update")).status_code == 409
        for bad, field in [(INFO | {"dtype_names": []}, "update_info.dtype_names"),
                           (INFO | {"shapes": [[4, "3"]]}, "update_info.shapes"),
                           (INFO | {"names": "a.weight"}, "update_info.names"),
                           (INFO | {"packed": False}, "update_info.packed"),
                           (INFO | {"extra": 1}, "update_info.extra"), ([1], "update_info")]:
            r = await c.post("/update_weights", json={"update_info": bad})
            assert r.status_code == 400 and field in r.json()["error"]["message"], (bad, r.text)
        r = await c.post("/update_weights", json={"update_info": INFO})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["message"] == "Weights updated" and out["version"] == 1 and not out["partial"]
        assert pool.policy_version == 1 and e.weights["a.weight"].sum() == 24
        assert e.update_infos[-1]["names"] == ["a.weight"] and e.update_infos[-1]["src_ranks"] == [0]
        r = await c.post("/finish_weight_update", json={"weight_version": "2"})
        assert r.status_code == 400 and "weight_version" in r.json()["error"]["message"]
        r = await c.post("/finish_weight_update", json={"weight_version": "1"})
        assert r.status_code == 200 and r.json()["weight_version"] == "1"
        assert (await c.post("/finish_weight_update")).status_code == 409
        # a label that is not an integer is accepted (vLLM's versions are strings)
        assert (await c.post("/start_weight_update")).status_code == 200
        assert (await c.post("/update_weights", json={"update_info": INFO})).json()["version"] == 2
        r = await c.post("/finish_weight_update", json={"weight_version": "step-7"})
        assert r.status_code == 200 and r.json()["weight_version"] == "2"
        # a push the model refuses (wrong shape): 400 naming it, nothing changed, and the group closed (the
        # trainer had started broadcasting with the request)
        assert (await c.post("/start_weight_update")).status_code == 200
        r = await c.post("/update_weights", json={"update_info": INFO | {"shapes": [[3, 4]]}})
        msg = r.json()["error"]["message"]
        assert r.status_code == 400 and "shape" in msg and "closed" in msg and "/init_weight_transfer_engine" in msg
        assert pool.policy_version == 2
        r = await c.post("/update_weights", json={"update_info": INFO})
        assert r.status_code == 409 and "/init_weight_transfer_engine" in r.json()["error"]["message"]
        assert (await c.post("/finish_weight_update")).status_code == 200
        assert (await c.post("/start_draft_weight_update")).status_code == 409      # no drafter (and no group)
    asyncio.run(main())


def test_vllm_weight_update_while_paused_keep_commits_in_keep_mode(make):
    """TRL's sync: /pause?mode=keep, start, update_weights, finish, /resume: the commit leaves the engines
    paused (the operator's pause) and never drains or aborts the frozen requests."""
    async def main():
        pool, _, c = await make(transfer=True)
        e = pool.engines[0]
        assert (await c.post("/init_weight_transfer_engine", json={"init_info": INIT})).status_code == 200
        assert (await c.post("/pause", params={"mode": "keep"})).status_code == 200
        assert (await c.post("/start_weight_update", json={"is_checkpoint_format": True})).status_code == 200
        r = await c.post("/update_weights", json={"update_info": INFO})
        assert r.status_code == 200 and r.json()["version"] == 1
        assert (await c.post("/finish_weight_update")).status_code == 200
        assert e.state is EngineState.PAUSED
        assert all(ev[1] == "keep" for ev in e.events if ev[0] == "pause")
        assert (await c.post("/resume")).status_code == 200
        assert e.state is EngineState.READY and e.weights["a.weight"].sum() == 24
    asyncio.run(main())


async def _error(c, path: str, body: dict) -> tuple[int, str, str | None]:
    r = await c.post(path, json=body)
    err = r.json()["error"]
    return r.status_code, err["message"], err["param"]


def test_a_validation_error_reaches_each_dialect_spelled_its_way(make):
    """The same refusal (validation.py's, about one field of the contract) in each dialect: the field spelled
    as the dialect spells it, in the message and in OpenAI's error.param; the rest of gRPC's text unchanged."""
    async def main():
        _, _, c = await make()
        messages = [{"role": "user", "content": "hi"}]
        for path, body, field in [
                ("/v1/completions", {"prompt": [1], "max_tokens": 0}, "max_tokens"),
                ("/v1/chat/completions", {"messages": messages, "max_tokens": 0}, "max_tokens"),
                ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"max_tokens": 0}},
                 "sampling_params.max_tokens"),
                ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 0}},
                 "sampling_params.max_new_tokens")]:
            assert await _error(c, path, body) == (400, f"{field}: must be >= 1, got 0", field), path
        vocab = ": 1000 is outside the vocabulary [0, 100)"
        assert await _error(c, "/v1/completions", {"prompt": [[1], [1, 1000]]}) == (
            400, "prompt[1].token_ids" + vocab, "prompt[1].token_ids")
        assert await _error(c, "/generate", {"input_ids": [[1], [1, 1000]]}) == (
            400, "input_ids[1].token_ids" + vocab, "input_ids[1].token_ids")
        assert await _error(c, "/v1/completions", {"prompt": [1], "n": 9}) == (
            400, "n: 9 exceeds max_samples_per_prompt=8", "n")
        assert await _error(c, "/generate", {"input_ids": [1], "sampling_params": {"n": 9}}) == (
            400, "sampling_params.n: 9 exceeds max_samples_per_prompt=8", "sampling_params.n")
        assert await _error(c, "/v1/completions", {"prompt": [1], "top_p": 0}) == (
            400, "top_p: must be in (0, 1], got 0.0", "top_p")
        assert await _error(c, "/generate", {"input_ids": [1], "rid": "a b"}) == (
            400, "rid: at most 128 printable ASCII characters without spaces", "rid")
    asyncio.run(main())


def test_a_second_field_in_the_text_is_spelled_the_dialects_way_too(make):
    """prompts[i]'s refusal mentions sampling.max_tokens: both names come in the dialect's spelling."""
    async def main():
        _, _, c = await make()
        tail = "=10 exceed the context length 256; shorten the prompt or lower "
        assert await _error(c, "/v1/completions", {"prompt": [[1], [1] * 250], "max_tokens": 10}) == (
            400, f"prompt[1]: 250 prompt tokens + max_tokens{tail}max_tokens", "prompt[1]")
        assert await _error(c, "/generate", {"input_ids": [[1], [1] * 250],
                                             "sampling_params": {"max_new_tokens": 10}}) == (
            400, f"input_ids[1]: 250 prompt tokens + sampling_params.max_new_tokens{tail}"
                 "sampling_params.max_new_tokens", "input_ids[1]")
        assert await _error(c, "/inference/v1/generate", {"token_ids": [1] * 250,
                                                          "sampling_params": {"max_tokens": 10}}) == (
            400, f"token_ids: 250 prompt tokens + sampling_params.max_tokens{tail}sampling_params.max_tokens",
            "token_ids")
    asyncio.run(main())


def test_errors_about_weights_spell_the_endpoints_fields(make, tmp_path):
    async def main():
        _, _, c = await make(transfer=True)
        assert await _error(c, "/update_weights", {"weight_dir": "relative/dir"}) == (
            400, "update_weights: weight_dir 'relative/dir' must be absolute (the server has its own working "
                 "directory)", "weight_dir")
        r = await c.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "nope")})
        assert r.status_code == 400
        nope = str(tmp_path / "nope")
        assert r.json()["message"] == f"update_weights_from_disk: model_path {nope!r} does not exist on the server"
        assert await _error(c, "/init_weight_transfer_engine", {"init_info": INIT | {"master_port": 0}}) == (
            400, "init_info.master_port must be in [1, 65535], got 0", "init_info.master_port")
    asyncio.run(main())


def test_from_service_error_spells_names_never_the_text():
    """Only the structured names are spelled: a field-less error passes through as gRPC gives it, even where
    its text happens to contain a field's path."""
    import grpc

    from rollout_service.errors import Name, ServiceError, invalid_field, refused_by_engine
    from rollout_service.server.compat import sglang_api, vllm_api, vllm_chat, vllm_transfer
    from rollout_service.server.compat.gateway import from_service_error, spell

    plain = ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full: prompts[0] of sampling.max_tokens; n: 3")
    for spelling in (vllm_api.SPELLING, sglang_api.SPELLING, vllm_transfer.SPELLING, None):
        err = from_service_error(plain, spelling)
        assert (err.status, err.message, err.param) == (429, plain.message, None)

    e = invalid_field("sampling.top_k", "must be -1 or 0 (disabled) or >= 1, got -2")
    assert e.message == "sampling.top_k: must be -1 or 0 (disabled) or >= 1, got -2"     # gRPC's text
    for spelling, name in [(vllm_api.SPELLING, "top_k"), (sglang_api.SPELLING, "sampling_params.top_k"),
                           (vllm_api.GENERATE_SPELLING, "sampling_params.top_k"), (None, "sampling.top_k")]:
        err = from_service_error(e, spelling)
        assert (err.message, err.param) == (f"{name}: must be -1 or 0 (disabled) or >= 1, got -2", name)

    # a name whose gRPC text is not its path ("lower max_tokens"): kept where the dialect has no spelling for it
    e = invalid_field("sampling.max_tokens", "lower ", Name("sampling.max_tokens", "max_tokens"))
    assert e.message == "sampling.max_tokens: lower max_tokens"
    assert from_service_error(e, sglang_api.SPELLING).message == \
        "sampling_params.max_new_tokens: lower sampling_params.max_new_tokens"
    assert from_service_error(e, {}).message == e.message

    class VLLMClientError(Exception):
        pass

    class VLLMValidationError(VLLMClientError):
        parameter = "max_tokens"
    err = from_service_error(refused_by_engine(VLLMValidationError("too many")), sglang_api.SPELLING)
    assert err.message.startswith("sampling_params.max_new_tokens: the engine refused it (too many)")
    assert err.param == "sampling_params.max_new_tokens"

    # spell: the longest key that is the name or a leading part of it ending at a "." or "["
    assert spell("prompts[3].token_ids", vllm_api.SPELLING) == "prompt[3].token_ids"
    assert spell("prompts", vllm_api.SPELLING) == "prompt"
    assert spell("prompts_x", vllm_api.SPELLING) is None
    assert spell("sampling.max_tokens", vllm_api.SPELLING) == "max_tokens"
    assert spell("sampling.stop", vllm_api.SPELLING) == "stop"
    assert spell("n", sglang_api.SPELLING) == "sampling_params.n"
    assert spell("nonce", sglang_api.SPELLING) is None
    assert spell("prompts[0].token_ids", vllm_chat.CHAT_SPELLING) == "messages.token_ids"
    assert spell("prompts[0].chat.messages[2].tool_call_id", vllm_chat.CHAT_SPELLING) == "messages[2].tool_call_id"
