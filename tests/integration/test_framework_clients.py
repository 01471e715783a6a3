"""Other RL frameworks' own client code, unchanged, against the shared real service (issue 44 item 1; docs/frameworks.md
says what each test runs and what it does not): SkyRL's RemoteInferenceClient, verifiers' train client (prime-rl's
renderer path) and prime-rl's inference pool with its weight update, OpenPipe ART's model and training tokenization,
verl's agent loop (through rollout_client.verl over gRPC), and slime's SGLang calls through SGLang's router.

Each framework is imported inside its test (they take seconds and bring their own logging); a test skips, naming
what is missing, where its framework is absent (scripts/install.sh installs the PyPI ones; prime-rl and slime are
not on PyPI: PRIME_RL_SRC / SLIME_SRC name a checkout's source folder). Log-probs are checked against an
independent float32 forward pass of the served weights (`policy` mirrors them; weight updates move it and
conftest's `policy` restores the service's weights at the end of the module).
"""
import asyncio
import contextlib
import importlib.util
import os
import sys
import types
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from rollout_service.drafting.reference import processed_logprobs
from tests.integration.services import wait_for
from tests.integration.test_weights import assert_serves, perturb

PROMPTS = [[1, 504, 3458, 314, 260], [1, 1046, 2683, 77]]


def gap(model, prompt, tokens, logprobs, temperature=1.0, top_k=0, top_p=1.0) -> float:
    """Largest |served log-prob - the forward pass's| over `tokens` sampled after `prompt`."""
    ref = processed_logprobs(model, list(prompt), list(tokens), temperature, top_k, top_p)
    assert torch.isfinite(ref).all(), "the service sampled a token the reference rules out"
    return float(np.max(np.abs(np.asarray(logprobs, dtype=np.float64) - ref.numpy())))


def installed(package: str, why: str):
    """Skip at collection (before the shared service starts) where `package` is absent; find_spec of a top-level
    name imports nothing."""
    return pytest.mark.skipif(importlib.util.find_spec(package) is None,
                              reason=f"{package} is not installed ({why}; scripts/install.sh installs it)")


def checkout(var: str, repo: str):
    return pytest.mark.skipif(not os.environ.get(var), reason=f"not on PyPI: set {var} to a checkout of {repo}")


def require(module: str, why: str):
    """The framework's module, or a skip naming the missing package."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        pytest.skip(f"{module} is not installed ({why}; scripts/install.sh installs it)")
    return importlib.import_module(module)


# ---- SkyRL -------------------------------------------------------------------------------------------------------
def skyrl_modules():
    """skyrl 0.3.0's remote inference client and broadcast weight sync, without the package inits that import its
    Tinker backend (skyrl/tinker/types.py: a pydantic TypedDict that needs Python 3.12) and its trainer config
    (skyrl_gym): the client modules themselves are SkyRL's, unchanged."""
    spec = importlib.util.find_spec("skyrl")
    if spec is None:
        pytest.skip("skyrl is not installed (pip install --no-deps skyrl==0.3.0; scripts/install.sh does)")
    root = Path(spec.origin).parent
    for pkg in ("skyrl.backends", "skyrl.backends.skyrl_train.weight_sync"):
        if pkg not in sys.modules:
            mod = types.ModuleType(pkg)
            mod.__path__ = [str(root.joinpath(*pkg.split(".")[1:]))]
            sys.modules[pkg] = mod
    from skyrl.backends.skyrl_train.inference_servers import remote_inference_client as ric
    from skyrl.backends.skyrl_train.weight_sync import base, broadcast_strategy
    return ric, base, broadcast_strategy


@contextlib.contextmanager
def trainer_rank0():
    """A one-rank default process group: the trainer SkyRL's sender runs in (torch.distributed.get_rank() == 0)."""
    from rollout_client.transfer import _free_port

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port('127.0.0.1')}",
                                         rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


@installed("skyrl", "skyrl==0.3.0 --no-deps")
def test_skyrl_remote_inference_client(service, client, policy, tiny_model, monkeypatch):
    """SkyRL 0.3.0's RemoteInferenceClient (no local tokenizer, so its /detokenize and /tokenize calls run too):
    generate (token ids in, token ids and log-probs out, one request per prompt), the Tinker `sample` (n samples),
    completion and chat_completion, pause in keep mode with a generation in flight and resume, /get_world_size,
    reset_prefix_cache; then its broadcast weight sync (init_weight_update_communicator,
    BroadcastWeightTransferSender.send_chunks: /collective_rpc skyrl_start_weight_update, update_weights_nccl,
    skyrl_finish_weight_update), with only vLLM's two NCCL calls it makes on the trainer side (trainer_init,
    trainer_send_weights) swapped for gloo (the CPU engines' backend): the new weights then serve."""
    ric, base, bs = skyrl_modules()
    from transformers import AutoTokenizer
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    from rollout_client.trl_gloo import GlooEndpoint
    from rollout_client.transfer import send

    tok = AutoTokenizer.from_pretrained(tiny_model)
    sky = ric.RemoteInferenceClient(proxy_url=service.http, server_urls=[service.http], data_parallel_size=1,
                                    model_name=str(tiny_model))

    async def rollouts():
        out = await sky.generate({"prompt_token_ids": PROMPTS, "sampling_params": {
            "max_tokens": 8, "temperature": 1.0, "logprobs": 0, "ignore_eos": True}})
        for prompt, ids, lps, text, stop in zip(PROMPTS, out["response_ids"], out["response_logprobs"],
                                                 out["responses"], out["stop_reasons"]):
            assert len(ids) == 8 == len(lps) and stop == "length"
            assert gap(policy, prompt, ids, lps) < 2e-3
            assert text == tok.decode(ids)                               # its /detokenize call
        assert (await sky.tokenize(["hello world"])) == [tok("hello world")["input_ids"]]
        s = await sky.sample({"json": {"prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPTS[1]}]},
                                       "num_samples": 3, "sampling_params": {"max_tokens": 5, "temperature": 1.0,
                                                                             "seed": 7}}})
        assert len(s["sequences"]) == 3
        for seq in s["sequences"]:
            assert 1 <= len(seq["tokens"]) <= 5 and gap(policy, PROMPTS[1], seq["tokens"], seq["logprobs"]) < 2e-3
        c = await sky.completion({"json": {"prompt": PROMPTS[0], "max_tokens": 4, "logprobs": 0,
                                           "return_token_ids": True, "ignore_eos": True, "session_id": "s1"}})
        ch = c["choices"][0]
        assert gap(policy, PROMPTS[0], ch["token_ids"], ch["logprobs"]["token_logprobs"]) < 2e-3
        chat = await sky.chat_completion({"json": {"messages": [{"role": "user", "content": "2+2?"}],
                                                   "max_tokens": 4, "logprobs": True, "session_id": "s1"}})
        turn1 = chat["prompt_token_ids"] + chat["choices"][0]["token_ids"]
        assert gap(policy, chat["prompt_token_ids"], chat["choices"][0]["token_ids"],
                   [e["logprob"] for e in chat["choices"][0]["logprobs"]["content"]]) < 2e-3
        # multi-turn as SkyRL's generator does it: the exact ids so far + the next turn's, as a token prompt
        nxt = turn1 + tok.apply_chat_template([{"role": "user", "content": "and 3+3?"}], tokenize=True,
                                              add_generation_prompt=True)["input_ids"]
        out = await sky.generate({"prompt_token_ids": [nxt], "sampling_params": {"max_tokens": 4, "logprobs": 0}})
        assert gap(policy, nxt, out["response_ids"][0], out["response_logprobs"][0]) < 2e-3
        assert await sky.get_world_size() == (1, 1)
        assert list((await sky.reset_prefix_cache()).values())[0]["status"] == 200

        # keep-mode pause with a rollout in flight: it freezes, and finishes after resume with all its tokens
        long = asyncio.ensure_future(sky.generate({"prompt_token_ids": [PROMPTS[0]], "sampling_params": {
            "max_tokens": 400, "logprobs": 0, "ignore_eos": True}}))
        while (await asyncio.to_thread(lambda: httpx.get(service.http + "/v1/status").json()))["queue_depth"] == 0:
            await asyncio.sleep(0.05)
        await sky.pause(mode="keep")
        assert httpx.get(service.http + "/is_paused").json() == {"is_paused": True}
        await asyncio.sleep(0.5)
        assert not long.done()
        await sky.resume()
        out = await long
        assert len(out["response_ids"][0]) == 400 and out["stop_reasons"] == ["length"]
        assert gap(policy, PROMPTS[0], out["response_ids"][0], out["response_logprobs"][0]) < 2e-3
        await sky.teardown()                         # its aiohttp session belongs to this event loop
    asyncio.run(rollouts())

    # ---- weights: SkyRL's broadcast sender, vLLM's NCCL trainer calls swapped for gloo ----
    endpoints: list[GlooEndpoint] = []

    def trainer_init(init_info: dict):
        endpoints.append(GlooEndpoint(init_info))
        return endpoints[-1]

    def trainer_send_weights(iterator, trainer_args: dict):
        group = trainer_args["group"]
        assert trainer_args["packed"] is True
        group.sent.append(send(group.pg, [t for _, t in iterator], 0, group.buffer_bytes))
    # (vLLM 0.32's NCCLWeightTransferEngine has neither: SkyRL 0.3.0 was written against an earlier vLLM)
    monkeypatch.setattr(NCCLWeightTransferEngine, "trainer_init", staticmethod(trainer_init), raising=False)
    monkeypatch.setattr(NCCLWeightTransferEngine, "trainer_send_weights", staticmethod(trainer_send_weights),
                        raising=False)

    from rollout_client.transfer import _free_port
    init = bs.BroadcastInitInfo(master_addr="127.0.0.1", master_port=_free_port("127.0.0.1"), rank_offset=1,
                                world_size=2, override_existing_receiver=True)

    async def sync(sender):
        params = [(n, p.detach().clone()) for n, p in policy.named_parameters()]
        meta = {"names": [n for n, _ in params], "dtype_names": [str(p.dtype).split(".")[-1] for _, p in params],
                "shapes": [list(p.shape) for _, p in params]}
        chunks = [base.WeightChunk(names=[n], dtypes=[str(p.dtype)], shapes=[list(p.shape)], tensors=[p])
                  for n, p in params]
        await sender.send_chunks(chunks, weight_metadata=meta)

    async def weights():
        with trainer_rank0():
            setup = asyncio.ensure_future(sky.init_weight_update_communicator(init))
            sender = await asyncio.to_thread(bs.BroadcastTransferStrategy.create_sender, init, sky)
            await setup
            try:
                for seed in (31, 32):
                    perturb(policy, seed=seed)
                    v = client.status().policy_version + 1
                    await sync(sender)
                    assert client.status().policy_version == v
                    assert_serves(client, policy, v)
            finally:
                httpx.post(service.http + "/shutdown_weight_transfer_engine", timeout=30)
                endpoints[0].close()
        await sky.teardown()
    asyncio.run(weights())
    assert endpoints[0].sent[-1] == sum(p.numel() * p.element_size() for p in policy.parameters())


# ---- verifiers (prime-rl's environments library) and prime-rl -----------------------------------------------------
def verifiers_train_client(service, tiny_model, config=None):
    """verifiers' train client (prime-rl's renderer path): renders the chat with the model's template, POSTs the
    token ids to /inference/v1/generate, reads token ids and log-probs back."""
    require("verifiers.v1.clients.train", "verifiers==0.4.0 with renderers==0.1.12")
    from verifiers.v1.clients.client import resolve_client
    from verifiers.v1.configs.client import TrainClientConfig

    os.environ.setdefault("ROLLOUT_TEST_API_KEY", "unused")
    config = config or TrainClientConfig(base_url=service.http + "/v1", api_key_var="ROLLOUT_TEST_API_KEY",
                                         renderer_model_name=str(tiny_model))
    return resolve_client(config)


async def vf_turn(client, model: str, messages: list[dict], max_tokens: int, session: str = "t1", **sampling):
    from verifiers.v1.dialects import ChatDialect
    from verifiers.v1.types import SamplingConfig

    body = {"model": model, "messages": messages}
    return await client.get_response(ChatDialect(), body, SamplingConfig(max_tokens=max_tokens, temperature=1.0,
                                                                         **sampling), session_id=session)


@installed("verifiers", "verifiers==0.4.0 --no-deps, renderers==0.1.12")
def test_verifiers_train_client_multi_turn(service, policy, tiny_model):
    """verifiers 0.4.0's TrainClient (renderers 0.1.12: /v1/models for the context length, then
    /inference/v1/generate with the renderer's stop ids, logprobs 1, cache_salt, the X-Session-ID header): two turns
    of one conversation, each turn's completion ids and log-probs checked against the forward pass of the exact
    prompt ids the renderer sent."""
    client = verifiers_train_client(service, tiny_model)
    model = str(tiny_model)

    async def main():
        messages = [{"role": "user", "content": "What is 2+2?"}]
        r1 = await vf_turn(client, model, messages, 8, cache_salt="v0")
        t1 = r1.tokens
        assert 1 <= len(t1.completion_ids) == r1.usage.completion_tokens <= 8
        assert r1.finish_reason in ("stop", "length")
        assert gap(policy, t1.prompt_ids, t1.completion_ids, t1.completion_logprobs) < 2e-3
        messages += [{"role": "assistant", "content": r1.message.content or ""},
                     {"role": "user", "content": "And 3+3?"}]
        r2 = await vf_turn(client, model, messages, 6)
        t2 = r2.tokens
        assert len(t2.prompt_ids) > len(t1.prompt_ids) and t2.prompt_ids[:len(t1.prompt_ids)] == t1.prompt_ids
        assert gap(policy, t2.prompt_ids, t2.completion_ids, t2.completion_logprobs) < 2e-3
        await client.close()
    asyncio.run(main())


def prime_rl_client_module():
    """prime-rl's inference-pool client (src/prime_rl/utils/client.py), from a checkout named by PRIME_RL_SRC
    (prime-rl is not on PyPI): its source and its configs package on the path, nothing else of it imported."""
    root = os.environ.get("PRIME_RL_SRC")
    if not root:
        pytest.skip("prime-rl is not on PyPI: set PRIME_RL_SRC to a checkout of PrimeIntellect-ai/prime-rl")
    require("verifiers.v1", "prime-rl's client builds verifiers' client configs")
    for sub in ("src", "packages/prime-rl-configs/src"):
        if str(Path(root, sub)) not in sys.path:
            sys.path.insert(0, str(Path(root, sub)))
    return importlib.import_module("prime_rl.utils.client"), importlib.import_module("prime_rl.configs.shared")


@checkout("PRIME_RL_SRC", "PrimeIntellect-ai/prime-rl")
@installed("verifiers", "prime-rl's client builds verifiers' client configs")
def test_prime_rl_inference_pool_and_weight_update(service, client, policy, tiny_model, tmp_path):
    """prime-rl's own InferencePool (prime_rl.utils.client, unchanged): wait_for_ready (/health, the model in
    /v1/models), its train client (verifiers' renderer client) generating, and update_weights as its orchestrator
    calls it for the filesystem broadcast: /pause?mode=keep&clear_cache=false, /update_weights {"weight_dir"},
    /resume, with a rollout in flight (frozen by the pause, it finishes after the resume with all its tokens); the
    new weights serve after it."""
    pr, shared = prime_rl_client_module()
    model = str(tiny_model)
    pool = pr.InferencePool(shared.ClientConfig(base_url=service.http + "/v1", api_key_var="ROLLOUT_TEST_API_KEY"),
                            model, train_client_type="renderer")
    vf_client = verifiers_train_client(service, tiny_model, pool.train_client)
    from safetensors.torch import save_file

    async def main():
        await pool.wait_for_ready(model, timeout=60)
        before = client.status().policy_version
        long = asyncio.ensure_future(vf_turn(vf_client, model, [{"role": "user", "content": "Count to 99."}], 400,
                                             ignore_eos=True))
        while (await asyncio.to_thread(lambda: httpx.get(service.http + "/v1/status").json()))["queue_depth"] == 0:
            await asyncio.sleep(0.05)
        perturb(policy, seed=41)
        weight_dir = tmp_path / "step_1"
        weight_dir.mkdir()
        save_file({k: v.contiguous() for k, v in policy.state_dict().items()}, str(weight_dir / "model.safetensors"))
        assert not long.done()
        await pool.update_weights(weight_dir, step=1)
        r = await long
        assert len(r.tokens.completion_ids) == 400 and client.status().policy_version == before + 1
        after = await vf_turn(vf_client, model, [{"role": "user", "content": "Hi"}], 5)
        assert gap(policy, after.tokens.prompt_ids, after.tokens.completion_ids,
                   after.tokens.completion_logprobs) < 2e-3
        await pool.stop()
        await vf_client.close()
        for admin in pool.admin_clients:
            await admin.aclose()
    asyncio.run(main())
    assert_serves(client, policy, client.status().policy_version)


# ---- OpenPipe ART ------------------------------------------------------------------------------------------------
@installed("art", "openpipe-art==0.5.18")
def test_art_model_by_name_and_its_training_tokens(service, policy, tiny_model):
    """OpenPipe ART 0.5.18 (the last release for Python 3.11): an `art.Model` pointed at the service
    (inference_base_url), an OpenAI client on it addressed by the model's inference name and by a checkpoint's
    (`name@step`, as ART serves LoRA steps), a two-turn chat rollout with log-probs (token ids in the log-prob tokens:
    ART's engines run with --return-tokens-as-token-ids, here asked per request), the choices kept in an
    `art.Trajectory`, and ART's own tokenization of the trajectory group for training
    (art.preprocessing.tokenize.tokenize_trajectory_groups): its assistant tokens and log-probs are exactly the
    sampled ones, and match the forward pass."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")        # no fetch of litellm's price list
    from transformers import masking_utils

    art = require("art", "openpipe-art==0.5.18")
    # `import art` replaces transformers' _preprocess_mask_arguments with a wrapper written for transformers 5.2,
    # which breaks every later forward pass under 5.19 (a missing positional argument): put the original back
    masking_utils._preprocess_mask_arguments = importlib.import_module(
        "art.transformers.patches")._preprocess_mask_arguments
    from art.preprocessing.tokenize import tokenize_trajectory_groups
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = art.Model(name="tiny", project="rollout-service", inference_base_url=service.http + "/v1",
                      inference_api_key="unused", inference_model_name=str(tiny_model))
    assert model.get_inference_name(step=3) == f"{tiny_model}@3"
    # the client ART's examples build from the model (model.openai_client() hands openai 3.x's httpx2-based
    # DefaultAsyncHttpxClient an httpx.Timeout, which fails on the first request: ART 0.5.18 predates openai 3)
    from openai import AsyncOpenAI
    oa = AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key, max_retries=0)

    async def rollout(name: str) -> "art.Trajectory":
        messages = [{"role": "user", "content": "What is 2+2?"}]
        first = await oa.chat.completions.create(model=name, messages=messages, max_tokens=6, logprobs=True,
                                                 temperature=1.0, extra_body={"return_tokens_as_token_ids": True})
        choice1 = first.choices[0]
        messages2 = messages + [{"role": "assistant", "content": choice1.message.content},
                                {"role": "user", "content": "And 3+3?"}]
        second = await oa.chat.completions.create(model=name, messages=messages2, max_tokens=6, logprobs=True,
                                                  temperature=1.0, extra_body={"return_tokens_as_token_ids": True})
        for r in (first, second):                   # each turn: the policy's log-probs of its own tokens
            ch = r.choices[0]
            ids = [int(e.token.removeprefix("token_id:")) for e in ch.logprobs.content]
            assert ids == ch.token_ids
            assert gap(policy, r.prompt_token_ids, ids, [e.logprob for e in ch.logprobs.content]) < 2e-3
        return art.Trajectory(messages_and_choices=[*messages, choice1, messages2[-1], second.choices[0]],
                              reward=float(len(choice1.token_ids)),
                              initial_policy_version=choice1.rollout["policy_version"])

    async def main():
        async with oa:
            return await asyncio.gather(rollout(model.get_inference_name()),
                                        rollout(model.get_inference_name(step=3)))
    trajectories = asyncio.run(main())
    group = art.TrajectoryGroup(trajectories)
    results = list(tokenize_trajectory_groups(tok, [group], allow_training_without_logprobs=False,
                                              scale_rewards=False, drop_zero_advantage_trajectories=False))
    assert len(results) == 2
    for res in results:
        choices = [m for m in res.trajectory.messages_and_choices if not isinstance(m, dict)]
        sampled = [int(e.token.removeprefix("token_id:")) for c in choices for e in c.logprobs.content]
        trained = [t for t, m in zip(res.token_ids, res.assistant_mask) if m]
        assert trained == sampled, "ART's training tokens are not the tokens the policy sampled"
        served = [e.logprob for c in choices for e in c.logprobs.content]
        np.testing.assert_allclose([lp for lp, m in zip(res.logprobs, res.assistant_mask) if m], served)


# ---- verl --------------------------------------------------------------------------------------------------------
@installed("verl", "verl==0.9.1 --no-deps, tensordict")
def test_verl_agent_loop(service, policy, tiny_model):
    """verl 0.9.1's SingleTurnAgentLoop, unchanged, with rollout_client.verl.ServerManager as its server_manager
    (verl's own LLMServerClient drives vLLM engines verl starts itself through Ray): verl's Continuous Token builder
    renders the chat, the service samples it, and verl's AgentLoopOutput carries the response ids and the policy's
    log-probs (checked against the forward pass), with the policy version in its extra fields."""
    require("verl.experimental.agent_loop.single_turn_agent_loop", "verl==0.9.1 with tensordict")
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from rollout_client.verl import ServerManager

    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {
        "prompt_length": 64, "response_length": 8, "max_model_len": 512, "full_determinism": False}}})
    data = OmegaConf.create({"apply_chat_template_kwargs": {}})
    tok = AutoTokenizer.from_pretrained(tiny_model)

    async def main():
        manager = ServerManager(service.target, config.actor_rollout_ref.rollout)
        loop = SingleTurnAgentLoop(trainer_config=DictConfigWrap(config), server_manager=manager, tokenizer=tok,
                                   processor=None, dataset_cls=RLHFDataset, data_config=DictConfigWrap(data))
        outs = await asyncio.gather(*(loop.run({"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True},
                                               raw_prompt=[{"role": "user", "content": q}])
                                      for q in ("What is 2+2?", "Name a colour.")))
        await manager.close()
        return outs
    for out in asyncio.run(main()):
        assert 1 <= len(out.response_ids) <= 8 and out.response_mask == [1] * len(out.response_ids)
        assert gap(policy, out.prompt_ids, out.response_ids, out.response_logprobs) < 2e-3
        assert out.extra_fields["global_steps"] == out.extra_fields["max_global_steps"] >= 0


# ---- slime -------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def sglang_router(worker_url: str):
    """SGLang's router (the PyPI sglang-router, which slime launches in front of its engines) with the service as
    its one worker; yields the router's address once it routes."""
    import subprocess

    from rollout_client.transfer import _free_port

    require("sglang_router", "sglang-router==0.3.2")
    port, metrics_port = _free_port("127.0.0.1"), _free_port("127.0.0.1")
    proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                             str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
                             "--worker-urls", worker_url, "--policy", "round_robin", "--log-level", "warn"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def routes():
            assert proc.poll() is None, f"sglang-router exited with code {proc.returncode}"
            with contextlib.suppress(httpx.HTTPError):
                workers = httpx.get(f"http://127.0.0.1:{port}/workers", timeout=5).json()["workers"]
                return any(w["is_healthy"] for w in workers)
        wait_for(routes, 60, "sglang-router to register the service as a healthy worker")
        yield "127.0.0.1", port
    finally:
        proc.terminate()
        proc.wait(30)


def slime_modules():
    """slime's rollout (slime.rollout.sglang_rollout) and its engine's HTTP calls (SGLangEngine), from a checkout
    named by SLIME_SRC (slime is not on PyPI). SGLangEngine's module imports SGLang's server_args and utils to launch
    an SGLang server, which it does not do for calls to a running one: they are stubbed here (SGLang does not install
    on this CPU); the methods called are slime's, unchanged."""
    root = os.environ.get("SLIME_SRC")
    if not root:
        pytest.skip("slime is not on PyPI: set SLIME_SRC to a checkout of THUDM/slime")
    require("pylatexenc", "slime's reward hub imports it")
    if root not in sys.path:
        sys.path.insert(0, root)
    for name in ("sglang", "sglang.srt", "sglang.srt.server_args", "sglang.srt.utils"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["sglang.srt.server_args"].ServerArgs = getattr(sys.modules["sglang.srt.server_args"], "ServerArgs",
                                                               object)
    sys.modules["sglang.srt.utils"].kill_process_tree = getattr(sys.modules["sglang.srt.utils"], "kill_process_tree",
                                                                lambda *a, **k: None)
    rollout = importlib.import_module("slime.rollout.sglang_rollout")
    engine = importlib.import_module("slime.backends.sglang_utils.sglang_engine")
    return rollout, engine, importlib.import_module("slime.utils.types"), importlib.import_module(
        "slime.utils.http_utils")


@checkout("SLIME_SRC", "THUDM/slime")
@installed("sglang_router", "sglang-router==0.3.2")
def test_slime_generate_through_sglang_router_and_disk_update(service, client, policy, tiny_model, tmp_path):
    """slime's rollout generate (slime.rollout.sglang_rollout.generate: /generate with input_ids, return_logprob and
    slime's sampling params) through SGLang's own router in front of the service, its Sample filled with the
    response tokens, log-probs (checked against the forward pass) and the weight version; then slime's engine-side
    disk update as SGLangEngine calls it (pause_generation, update_weights_from_disk with weight_version,
    flush_cache (a GET), continue_generation, get_weight_version) and a generation under the new weights."""
    rollout, engine, slime_types, http_utils = slime_modules()
    from argparse import Namespace

    from safetensors.torch import save_file

    with sglang_router(service.http) as (router_ip, router_port):
        args = Namespace(hf_checkpoint=str(tiny_model), sglang_router_ip=router_ip, sglang_router_port=router_port,
                         sglang_server_concurrency=4, rollout_num_engines=1, rollout_temperature=1.0,
                         rollout_top_p=1.0, rollout_top_k=-1, rollout_max_response_len=8, rollout_stop=None,
                         rollout_stop_token_ids=None, rollout_skip_special_tokens=False, sglang_dp_size=None,
                         n_samples_per_prompt=2, ci_test=False, use_rollout_routing_replay=False,
                         use_distributed_post=False, partial_rollout=False, rollout_seed=1)
        http_utils.init_http_client(args)
        state = rollout.GenerateState(args)

        def generate(prompt):
            sample = slime_types.Sample(prompt="", tokens=list(prompt))

            async def run():
                return await rollout.generate(args, sample, dict(state.sampling_params, ignore_eos=True))
            return asyncio.run(run())

        for prompt in PROMPTS:
            s = generate(prompt)
            response = s.tokens[len(prompt):]
            assert len(response) == 8 == s.response_length and s.status == slime_types.Sample.Status.TRUNCATED
            assert gap(policy, prompt, response, s.rollout_log_probs) < 2e-3
        before = client.status().policy_version
        assert s.weight_versions == [str(before)]

        eng = engine.SGLangEngine.__new__(engine.SGLangEngine)     # the running server's handle: no launch
        eng.node_rank, eng.server_host, eng.server_port = 0, "127.0.0.1", int(service.http.rsplit(":", 1)[1])
        perturb(policy, seed=51)
        save_file({k: v.contiguous() for k, v in policy.state_dict().items()}, str(tmp_path / "model.safetensors"))
        eng.pause_generation()
        out = eng.update_weights_from_disk(str(tmp_path), weight_version=str(before + 1))
        assert out["success"] and eng.get_weight_version() == str(before + 1)
        eng.flush_cache()
        eng.continue_generation()
        s = generate(PROMPTS[0])
        assert s.weight_versions == [str(before + 1)]
        assert gap(policy, PROMPTS[0], s.tokens[len(PROMPTS[0]):], s.rollout_log_probs) < 2e-3
