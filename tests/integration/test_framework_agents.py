"""Other RL frameworks' agentic paths (tool calls over several turns), their own code unchanged, against a service on
a tiny model trained to call a calculator (issue 55 item 5; docs/frameworks.md, "Agentic paths"):

- verl 0.9.1's ToolAgentLoop with rollout_client.verl's ServerManager (gRPC Generate): verl renders the chat and
  parses the hermes tool call itself, the service only samples tokens;
- SkyRL 0.3.0's SkyRLGymGenerator.agent_loop with a skyrl_gym calculator environment, through its
  RemoteInferenceClient (/inference/v1/generate, /detokenize, /finish_session): token ids in and out;
- OpenPipe ART 0.5.18's tool-calling rollout (the openai package: tools, tool_choice auto or named, log-probs with
  token ids) kept in an art.Trajectory and tokenized for training by ART;
- verifiers 0.4.0: its harness chat program (the null/bash harness's agent loop, streamed chat completions with tools)
  and its EvalClient relay, the server rendering tools and parsing the calls;
- prime-rl (source, PRIME_RL_SRC): its inference pool's train client (verifiers' renderer client: the chat and tools
  rendered on the client, token ids over /inference/v1/generate), and the token-in chat of its earlier releases
  (/v1/chat/completions/tokens, prime-rl #1422).

The model (tests/tiny_models.build_tiny_tool_model) answers each of TOOL_PROBLEMS with a hermes call of TOOL_CALCULATOR
and, after the tool's result, "The answer is N.". Every test checks that the call was parsed and executed, that its
result reached the next turn, and that the token ids and log-probs the framework keeps for training are the ones the
engine sampled (log-probs against an independent float32 forward pass of the served weights). The service on the tool
model is conftest's `tool_service`, shared with test_agents.py.
"""
import asyncio
import importlib
import json
import os
import sys
import types
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.integration.test_framework_clients import checkout, gap, installed, prime_rl_client_module, require

tiny_models = importlib.import_module("tests.tiny_models")
if not hasattr(tiny_models, "build_tiny_tool_model"):
    pytest.skip("tests/tiny_models.py has no build_tiny_tool_model (the calculator model) yet", allow_module_level=True)
TOOL_CALCULATOR, TOOL_PROBLEMS = tiny_models.TOOL_CALCULATOR, tiny_models.TOOL_PROBLEMS

NAME = TOOL_CALCULATOR["function"]["name"]
ARG = next(iter(TOOL_CALCULATOR["function"]["parameters"]["properties"]))


def calculator(expression: str) -> str:
    """The tool: the answer of a known problem's expression (the model was trained on these results)."""
    for _, expr, answer in TOOL_PROBLEMS:
        if expr == expression:
            return str(answer)
    raise AssertionError(f"the model called the calculator with {expression!r}, not a problem's expression")


def final_text(answer) -> str:
    return f"The answer is {answer}."


@pytest.fixture(scope="module")
def tool_policy(tool_model):
    """The served weights in transformers, float32: the independent forward pass."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tool_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(tool_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tool_model)


def tool_response(answer) -> str:
    """How the template renders a tool result (what the next turn's prompt must hold)."""
    return f"<tool_response>\n{answer}\n</tool_response>"


# ---- verl --------------------------------------------------------------------------------------------------------
@installed("verl", "verl==0.9.1 --no-deps, tensordict")
def test_verl_tool_agent_loop(tool_service, tool_policy, tok, tool_model):
    """verl 0.9.1's ToolAgentLoop, unchanged, with rollout_client.verl.ServerManager as its server_manager and a
    calculator tool (a verl BaseTool with TOOL_CALCULATOR's schema): verl renders the tools into the prompt (its
    Continuous Token builder), the service samples token ids, verl decodes and parses the hermes call (its own
    parser), runs the tool, appends the rendered result to the same token sequence and samples the answer. verl's
    output: response ids = turn 1's sampled ids + the inserted tool turn + turn 2's sampled ids, its mask 1 exactly
    on the sampled ones, log-probs the engine's there (and the forward pass's), 0 elsewhere."""
    require("verl.experimental.agent_loop.tool_agent_loop", "verl==0.9.1 with tensordict")
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
    from verl.tools.base_tool import BaseTool
    from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from rollout_client.verl import ServerManager

    class Calculator(BaseTool):
        calls: list = []

        async def execute(self, instance_id, parameters, **kwargs):
            self.calls.append(parameters)
            return ToolResponse(text=calculator(parameters[ARG])), 0.0, {}

    class Recorded(ServerManager):
        """The service's ServerManager, recording each generate call (what verl sent, what it got)."""
        calls: list = []

        async def generate(self, request_id, *, prompt_ids, sampling_params, **kw):
            out = await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kw)
            self.calls.append((request_id, list(prompt_ids), out))
            return out

    schema = OpenAIFunctionToolSchema.model_validate(TOOL_CALCULATOR)
    assert schema.model_dump(exclude_unset=True, exclude_none=True) == TOOL_CALCULATOR     # the tools the model knows
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {
        "prompt_length": 512, "response_length": 128, "max_model_len": 512, "full_determinism": False,
        "multi_turn": {"format": "hermes", "max_user_turns": 2, "max_assistant_turns": 3, "max_parallel_calls": 1,
                       "max_tool_response_length": 256, "tool_response_truncate_side": "right"}}}})
    question, expression, answer = TOOL_PROBLEMS[0]
    model_type = json.loads((Path(tool_model) / "config.json").read_text())["model_type"]   # as verl's worker reads it

    async def main():
        manager = Recorded(tool_service.target, config.actor_rollout_ref.rollout)
        loop = ToolAgentLoop(trainer_config=DictConfigWrap(config), server_manager=manager, tokenizer=tok,
                             processor=None, dataset_cls=RLHFDataset,
                             data_config=DictConfigWrap(OmegaConf.create({"apply_chat_template_kwargs": {}})),
                             tools=ToolListWrap([Calculator({}, schema)]), hf_model_type=model_type)
        out = await loop.run({"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True, "max_tokens": 64},
                             raw_prompt=[{"role": "user", "content": question}])
        await manager.close()
        return out, manager.calls
    out, calls = asyncio.run(main())

    assert Calculator.calls == [{ARG: expression}], "verl did not parse and run the model's call"
    assert len(calls) == 2 and calls[0][0] == calls[1][0]            # two turns, one sticky session
    (_, p1, o1), (_, p2, o2) = calls
    inserted = p2[len(p1) + len(o1.token_ids):]
    assert p2[:len(p1) + len(o1.token_ids)] == p1 + o1.token_ids     # turn 2 continues the exact tokens
    # the tool's result reached turn 2, rendered as the template renders it after the call, but for one token: verl's
    # default Continuous Token builder (the one for model types it has no builder of its own for: llama here) does
    # not insert the newline the template writes after <|im_end|> (its Qwen builder does)
    call = {"id": "c", "type": "function", "function": {"name": NAME, "arguments": json.dumps({ARG: expression})}}
    history = [{"role": "user", "content": question}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    before = tok.apply_chat_template(history, tools=[TOOL_CALCULATOR], tokenize=True, return_dict=False)
    after = tok.apply_chat_template(history + [{"role": "tool", "tool_call_id": "c", "content": str(answer)}],
                                    tools=[TOOL_CALCULATOR], tokenize=True, return_dict=False,
                                    add_generation_prompt=True)
    assert before[-2:] == [tok.eos_token_id, tok.encode("\n")[0]] and o1.token_ids[-1] == tok.eos_token_id
    assert inserted == after[len(before):] and tool_response(answer) in tok.decode(inserted)
    assert tok.decode(o2.token_ids, skip_special_tokens=True) == final_text(answer) and o2.stop_reason == "completed"
    assert out.num_turns == 4 and out.prompt_ids == p1
    assert out.response_ids == o1.token_ids + inserted + o2.token_ids
    assert out.response_mask == [1] * len(o1.token_ids) + [0] * len(inserted) + [1] * len(o2.token_ids)
    assert out.response_logprobs == o1.log_probs + [0.0] * len(inserted) + o2.log_probs
    for prompt, o in ((p1, o1), (p2, o2)):
        assert all(lp <= 0 for lp in o.log_probs)
        assert gap(tool_policy, prompt, o.token_ids, o.log_probs) < 2e-3


# ---- SkyRL -------------------------------------------------------------------------------------------------------
def skyrl_generator_modules():
    """SkyRL 0.3.0's generator and skyrl_gym (which the skyrl wheel ships beside it as skyrl-gym/), without the
    package inits that import its Tinker backend (Python 3.12): the modules themselves are SkyRL's, unchanged."""
    import importlib.util

    spec = importlib.util.find_spec("skyrl")
    if spec is None:
        pytest.skip("skyrl is not installed (pip install --no-deps skyrl==0.3.0; scripts/install.sh does)")
    root = Path(spec.origin).parent
    gym = root.parent / "skyrl-gym"
    if not (gym / "skyrl_gym").is_dir():
        pytest.skip(f"skyrl_gym is not beside skyrl ({gym})")
    if str(gym) not in sys.path:
        sys.path.insert(0, str(gym))
    for pkg in ("skyrl.backends", "skyrl.backends.skyrl_train.weight_sync", "skyrl.train.generators"):
        if pkg not in sys.modules:
            mod = types.ModuleType(pkg)
            mod.__path__ = [str(root.joinpath(*pkg.split(".")[1:]))]
            sys.modules[pkg] = mod
    import skyrl_gym
    from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient
    from skyrl.train.config import GeneratorConfig, SkyRLGymConfig
    from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator
    return skyrl_gym, RemoteInferenceClient, GeneratorConfig, SkyRLGymConfig, SkyRLGymGenerator


@installed("skyrl", "skyrl==0.3.0 --no-deps")
def test_skyrl_gym_generator_tool_episode(tool_service, tool_policy, tok, tool_model):
    """SkyRL 0.3.0's SkyRLGymGenerator.agent_loop, unchanged (token-in/token-out, use_conversation_multi_turn), with a
    skyrl_gym text environment holding a calculator ToolGroup: the generator renders the chat (the tools through its
    chat_template_kwargs), RemoteInferenceClient samples over /inference/v1/generate (session header, then
    /detokenize for the text the environment reads, /finish_session at the end); the environment parses the hermes
    call, runs the tool and answers with a tool message, which the generator renders onto the same token sequence.
    Its TrajectoryOutput: the sampled ids under loss mask 1 with their log-probs, the observation under 0, the reward
    the environment gave the final answer."""
    skyrl_gym, RemoteInferenceClient, GeneratorConfig, SkyRLGymConfig, SkyRLGymGenerator = skyrl_generator_modules()
    from skyrl_gym.envs.base_text_env import BaseTextEnv
    from skyrl_gym.tools.core import ToolGroup, tool

    question, expression, answer = TOOL_PROBLEMS[1 % len(TOOL_PROBLEMS)]
    executed = []

    class Calc(ToolGroup):
        def __init__(self):
            super().__init__(name="calc")

        @tool
        def calculator(self, expression: str) -> str:        # noqa: F811 - the tool's name is the model's
            executed.append(expression)
            return calculator(expression)

    class CalculatorEnv(BaseTextEnv):
        def __init__(self, env_config=None, extras=None):
            super().__init__()
            self.max_turns = (extras or {}).get("max_turns", 3)
            self.init_tool_groups([Calc()])

        def step(self, action: str):
            self.turns += 1
            start, end = action.find("<tool_call>"), action.find("</tool_call>")
            if start >= 0 and end > start and self.turns < self.max_turns:
                call = json.loads(action[start + len("<tool_call>"):end])
                out = self._execute_tool("calc", call["name"], [call["arguments"][ARG]])
                return {"observations": [{"role": "tool", "content": out}], "reward": 0.0, "done": False,
                        "metadata": {}}
            return {"observations": [], "reward": float(final_text(answer) in action), "done": True, "metadata": {}}

    env_id = "rollout_test_calculator"
    if env_id not in skyrl_gym.registry:
        skyrl_gym.register(id=env_id, entry_point=CalculatorEnv)

    sent = []

    async def main():
        client = RemoteInferenceClient(proxy_url=tool_service.http, server_urls=[tool_service.http],
                                       data_parallel_size=1, model_name=str(tool_model))
        generate = client.generate

        async def recorded(inp, *a, **kw):
            out = await generate(inp, *a, **kw)
            sent.append((list(inp["prompt_token_ids"][0]), out["response_ids"][0], out["response_logprobs"][0]))
            return out
        client.generate = recorded                         # only records: SkyRL's own generate runs
        cfg = GeneratorConfig(max_turns=3, use_conversation_multi_turn=True,
                              chat_template_kwargs={"tools": [TOOL_CALCULATOR]})
        gen = SkyRLGymGenerator(cfg, SkyRLGymConfig(max_env_workers=0), client, tok)
        out = await gen.agent_loop([{"role": "user", "content": question}], env_id, {}, max_tokens=64,
                                   max_input_length=480,
                                   sampling_params={"max_tokens": 64, "temperature": 1.0, "logprobs": 0})
        await client.teardown()
        return out
    out = asyncio.run(main())

    assert executed == [expression], "the environment did not get the model's call"
    assert len(sent) == 2
    (p1, r1, l1), (p2, r2, l2) = sent
    inserted = p2[len(p1) + len(r1):]
    assert p2[:len(p1) + len(r1)] == p1 + r1                           # turn 2 continues the exact tokens
    assert tool_response(answer) in tok.decode(inserted)
    assert out.prompt_ids == p1
    assert out.response_ids == r1 + inserted + r2
    assert out.loss_mask == [1] * len(r1) + [0] * len(inserted) + [1] * len(r2)
    assert out.rollout_logprobs == l1 + [0.0] * len(inserted) + l2
    assert out.stop_reason == "stop" and out.reward[-1] == 1.0 and sum(out.reward) == 1.0
    for prompt, ids, lps in ((p1, r1, l1), (p2, r2, l2)):
        assert all(lp <= 0 for lp in lps)
        assert gap(tool_policy, prompt, ids, lps) < 2e-3


# ---- OpenPipe ART ------------------------------------------------------------------------------------------------
@installed("art", "openpipe-art==0.5.18")
def test_art_tool_calling_trajectory(tool_service, tool_policy, tok, tool_model):
    """OpenPipe ART 0.5.18's tool-calling rollout as its examples write it: the openai client with tools and
    tool_choice (auto; and a named function, which the service enforces with vLLM's structural tag), log-probs with
    token ids (return_tokens_as_token_ids), message.tool_calls parsed by the server and run, the tool message with
    its tool_call_id, the final answer; the Choices kept in an art.Trajectory with its tools and tokenized for
    training by ART (tokenize_trajectory_groups): the tokens it trains on are exactly the sampled ones, with the served
    log-probs."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")        # no fetch of litellm's price list
    from transformers import masking_utils

    art = require("art", "openpipe-art==0.5.18")
    masking_utils._preprocess_mask_arguments = importlib.import_module(     # see test_framework_clients' ART test
        "art.transformers.patches")._preprocess_mask_arguments
    from art.preprocessing.tokenize import tokenize_trajectory_groups
    from openai import AsyncOpenAI

    model = str(tool_model)
    tools = [TOOL_CALCULATOR]
    named = {"type": "function", "function": {"name": NAME}}

    async def rollout(oa, problem, tool_choice) -> "art.Trajectory":
        question, expression, answer = problem
        traj = art.Trajectory(messages_and_choices=[{"role": "user", "content": question}], tools=tools, reward=0.0)
        calls = 0
        for turn in range(3):
            r = await oa.chat.completions.create(
                model=model, messages=traj.messages(), tools=tools, tool_choice=tool_choice if turn == 0 else "auto",
                max_completion_tokens=64, temperature=1.0, logprobs=True,
                extra_body={"return_tokens_as_token_ids": True})
            choice = r.choices[0]
            ids = [int(e.token.removeprefix("token_id:")) for e in choice.logprobs.content]
            lps = [e.logprob for e in choice.logprobs.content]
            assert ids == choice.token_ids and all(lp <= 0 for lp in lps)
            assert gap(tool_policy, r.prompt_token_ids, ids, lps) < 2e-3
            traj.messages_and_choices.append(choice)
            if not choice.message.tool_calls:
                assert choice.finish_reason == "stop"
                break
            # vLLM's (and OpenAI's) finish reason: "tool_calls" for auto and required calls, "stop" for a named one
            assert choice.finish_reason == ("stop" if turn == 0 and tool_choice == named else "tool_calls")
            for tc in choice.message.tool_calls:
                assert tc.function.name == NAME and json.loads(tc.function.arguments) == {ARG: expression}
                calls += 1
                traj.messages_and_choices.append({"role": "tool", "tool_call_id": tc.id,
                                                  "content": calculator(json.loads(tc.function.arguments)[ARG])})
        assert calls == 1
        assert choice.message.content == final_text(answer)
        traj.reward = 1.0
        return traj

    async def main():
        async with AsyncOpenAI(base_url=tool_service.http + "/v1", api_key="unused", max_retries=0) as oa:
            return await asyncio.gather(rollout(oa, TOOL_PROBLEMS[0], "auto"),
                                        rollout(oa, TOOL_PROBLEMS[2 % len(TOOL_PROBLEMS)], named))
    trajectories = asyncio.run(main())
    trajectories[1].reward = 0.0                                       # a nonzero advantage for both
    results = list(tokenize_trajectory_groups(tok, [art.TrajectoryGroup(trajectories)],
                                              allow_training_without_logprobs=False, scale_rewards=False,
                                              drop_zero_advantage_trajectories=False))
    assert len(results) == 2
    for res in results:
        choices = [m for m in res.trajectory.messages_and_choices if not isinstance(m, dict)]
        assert len(choices) == 2
        sampled = [int(e.token.removeprefix("token_id:")) for c in choices for e in c.logprobs.content]
        trained = [t for t, m in zip(res.token_ids, res.assistant_mask) if m]
        assert trained == sampled, "ART's training tokens are not the tokens the policy sampled"
        served = [e.logprob for c in choices for e in c.logprobs.content]
        np.testing.assert_allclose([lp for lp, m in zip(res.logprobs, res.assistant_mask) if m], served)
        assert tool_response(calculator(json.loads(
            choices[0].message.tool_calls[0].function.arguments)[ARG])) in res.chat
        # (ART's sequence holds a turn that called a tool twice: its sampled ids, which hold the call, in place of the
        # message's content, then the template's rendering of the message's tool_calls; docs/frameworks.md)


# ---- verifiers ---------------------------------------------------------------------------------------------------
def chat_program():
    """verifiers 0.4.0's bundled chat program (CHAT_PROGRAM_SOURCE: the null and bash harnesses' agent loop, which
    they launch as a uv script inside the task's runtime, pointed at verifiers' interception server), executed here
    in-process; its MCP hop (call_mcp) answers from the local calculator instead of an MCP server."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

    ns = {"__name__": "vf_chat_program"}
    exec(compile(CHAT_PROGRAM_SOURCE, "vf_chat_program", "exec"), ns)

    async def call_mcp(servers, dispatch, name, arguments):
        assert dispatch[name] == ("", name)
        return calculator(arguments[ARG])
    ns["call_mcp"] = call_mcp
    return ns


@installed("verifiers", "verifiers==0.4.0 --no-deps")
def test_verifiers_chat_program_and_eval_client_tool_episode(tool_service, tool_model):
    """verifiers 0.4.0's agentic paths where the server renders the tools and parses the calls: its harness chat
    program's run_chat_loop (streamed /v1/chat/completions with tools and stream_options.include_usage, read with the
    openai package's stream accumulator plus verifiers' own reasoning fields; assistant turns echoed with the streamed
    tool_calls' index; tool messages with tool_call_id and name), and its EvalClient (the relay its interception
    server sends a harness's requests through: X-Session-ID, ChatDialect's parse of the answer) driving the same
    episode. Both: one calculator call, its result, the final answer."""
    require("verifiers.v1.harnesses.utils.launch", "verifiers==0.4.0 with mcp and httpx2")
    from openai import AsyncOpenAI

    model = str(tool_model)
    question, expression, answer = TOOL_PROBLEMS[0]

    async def program_episode():
        ns = chat_program()
        client = AsyncOpenAI(base_url=tool_service.http + "/v1", api_key="unused", max_retries=0)
        args = types.SimpleNamespace(tool_interception_url="", api_key="unused", bash=False, edit=False,
                                     search=False)
        messages = [{"role": "user", "content": question}]
        compactor = ns["Compactor"](client, model, [TOOL_CALCULATOR], False, None)
        compactor.note_good(messages)
        await ns["run_chat_loop"](args, compactor, messages, {NAME: ("", NAME)}, {}, None)
        await client.close()
        return messages

    messages = asyncio.run(program_episode())
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"], messages
    call = messages[1]["tool_calls"][0]
    assert call["function"]["name"] == NAME and json.loads(call["function"]["arguments"]) == {ARG: expression}
    assert call["id"] and messages[2]["tool_call_id"] == call["id"] and messages[2]["content"] == str(answer)
    assert messages[3]["content"] == final_text(answer) and not messages[3].get("tool_calls")

    from verifiers.v1.clients.client import resolve_client
    from verifiers.v1.configs.client import EvalClientConfig
    from verifiers.v1.dialects import ChatDialect
    from verifiers.v1.dialects.chat import message_to_wire
    from verifiers.v1.types import SamplingConfig

    os.environ.setdefault("ROLLOUT_TEST_API_KEY", "unused")
    question, expression, answer = TOOL_PROBLEMS[1 % len(TOOL_PROBLEMS)]

    async def client_episode():
        client = resolve_client(EvalClientConfig(base_url=tool_service.http + "/v1",
                                                 api_key_var="ROLLOUT_TEST_API_KEY"))
        messages, finishes = [{"role": "user", "content": question}], []
        for _ in range(3):
            r = await client.get_response(ChatDialect(), {"model": model, "messages": messages,
                                                          "tools": [TOOL_CALCULATOR]},
                                          SamplingConfig(max_tokens=64, temperature=1.0), session_id="vf-episode")
            finishes.append(r.finish_reason)
            messages.append(message_to_wire(r.message))
            if not r.message.tool_calls:
                break
            for c in r.message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": c.id, "name": c.name,
                                 "content": calculator(json.loads(c.arguments)[ARG])})
        await client.close()
        return messages, finishes

    messages, finishes = asyncio.run(client_episode())
    assert finishes == ["tool_calls", "stop"]
    assert json.loads(messages[1]["tool_calls"][0]["function"]["arguments"]) == {ARG: expression}
    assert messages[2]["content"] == str(answer) and messages[3]["content"] == final_text(answer)


# ---- prime-rl ----------------------------------------------------------------------------------------------------
@checkout("PRIME_RL_SRC", "PrimeIntellect-ai/prime-rl")
@installed("verifiers", "prime-rl's client builds verifiers' client configs")
def test_prime_rl_token_in_tool_episode(tool_service, tool_policy, tok, tool_model):
    """prime-rl's agentic rollouts. (1) As its source runs them today: its InferencePool's train client (verifiers'
    renderer client, DefaultRenderer with renderers' hermes parser `qwen3`) renders the chat with the tools, samples
    token ids over /inference/v1/generate, and renders the next turn onto the exact ids of the last (prompt and
    completion) followed by the tool's result. (2) The token-in chat of its earlier releases (prime-rl #1422, sent by
    verifiers' OpenAIChatCompletionsTokenClient): turn 1 over /v1/chat/completions, the next prompt's ids from
    /tokenize of the messages and tools, turn 2 over /v1/chat/completions/tokens (the chat request plus those ids in
    `tokens`): the server samples from the ids as given and still parses the answer."""
    pr, shared = prime_rl_client_module()
    from renderers import DefaultRendererConfig
    from verifiers.v1.dialects import ChatDialect
    from verifiers.v1.dialects.chat import message_to_wire
    from verifiers.v1.types import SamplingConfig

    os.environ.setdefault("ROLLOUT_TEST_API_KEY", "unused")
    model = str(tool_model)
    question, expression, answer = TOOL_PROBLEMS[0]
    pool = pr.InferencePool(shared.ClientConfig(base_url=tool_service.http + "/v1",
                                                api_key_var="ROLLOUT_TEST_API_KEY"),
                            model, train_client_type="renderer",
                            renderer_config=DefaultRendererConfig(tool_parser="qwen3"))
    from verifiers.v1.clients.client import resolve_client

    async def episode():
        await pool.wait_for_ready(model, timeout=60)
        client = resolve_client(pool.train_client)
        messages = [{"role": "user", "content": question}]
        body = {"model": model, "messages": messages, "tools": [TOOL_CALCULATOR]}
        sampling = SamplingConfig(max_tokens=64, temperature=1.0)
        first = await client.get_response(ChatDialect(), body, sampling, session_id="pr-episode")
        messages.append(message_to_wire(first.message))
        messages.append({"role": "tool", "tool_call_id": "call-0", "name": NAME, "content": str(answer)})
        second = await client.get_response(ChatDialect(), body, sampling, session_id="pr-episode")
        await client.close()
        await pool.stop()
        for admin in pool.admin_clients:
            await admin.aclose()
        return first, second

    first, second = asyncio.run(episode())
    # renderers' hermes parser (`qwen3`) finds calls by the <tool_call> token id, which Qwen's tokenizers have and
    # SmolLM2's (this model's) has not: the call stays in the content, as the renderer returns it
    assert not first.message.tool_calls and first.finish_reason == "stop"
    text = first.message.content
    call = json.loads(text[text.index("<tool_call>") + len("<tool_call>"):text.index("</tool_call>")])
    assert call == {"name": NAME, "arguments": {ARG: expression}}
    assert second.message.content == final_text(answer)
    t1, t2 = first.tokens, second.tokens
    assert json.dumps(TOOL_CALCULATOR) in tok.decode(t1.prompt_ids)  # the renderer rendered the tools
    exact = t1.prompt_ids + t1.completion_ids
    assert t2.prompt_ids[:len(exact)] == exact                        # turn 2 continues the exact tokens
    assert tool_response(answer) in tok.decode(t2.prompt_ids[len(exact):])
    for t in (t1, t2):
        assert all(lp <= 0 for lp in t.completion_logprobs)
        assert gap(tool_policy, t.prompt_ids, t.completion_ids, t.completion_logprobs) < 2e-3

    # (2) prime-rl #1422's token-in chat: turn 1 over /v1/chat/completions (logprobs, return_token_ids), turn 2 over
    # /v1/chat/completions/tokens with the messages, the tools and the prompt's token ids in `tokens`
    question, expression, answer = TOOL_PROBLEMS[1 % len(TOOL_PROBLEMS)]
    with httpx.Client(base_url=tool_service.http, timeout=120) as http:
        msgs = [{"role": "user", "content": question}]
        first = http.post("/v1/chat/completions", json={
            "model": model, "messages": msgs, "tools": [TOOL_CALCULATOR], "max_completion_tokens": 64,
            "logprobs": True, "return_token_ids": True})
        assert first.status_code == 200, first.text
        b1 = first.json()
        c1 = b1["choices"][0]
        call = c1["message"]["tool_calls"][0]
        assert json.loads(call["function"]["arguments"]) == {ARG: expression}
        msgs += [c1["message"], {"role": "tool", "tool_call_id": call["id"], "content": calculator(expression)}]
        tokenized = http.post("/tokenize", json={"model": model, "messages": msgs, "tools": [TOOL_CALCULATOR],
                                                 "add_generation_prompt": True})
        assert tokenized.status_code == 200, tokenized.text
        ids = tokenized.json()["tokens"]
        assert ids[:len(b1["prompt_token_ids"])] == b1["prompt_token_ids"]
        assert tool_response(answer) in tok.decode(ids[len(b1["prompt_token_ids"]):])
        second = http.post("/v1/chat/completions/tokens", json={
            "model": model, "messages": msgs, "tools": [TOOL_CALCULATOR], "tokens": ids,
            "max_completion_tokens": 64, "logprobs": True, "return_token_ids": True})
        assert second.status_code == 200, second.text
        b2 = second.json()
        c2 = b2["choices"][0]
        assert b2["prompt_token_ids"] == ids and c2["message"]["content"] == final_text(answer)
        assert c2["finish_reason"] == "stop" and not c2["message"].get("tool_calls")
        assert gap(tool_policy, ids, c2["token_ids"], [e["logprob"] for e in c2["logprobs"]["content"]]) < 2e-3
