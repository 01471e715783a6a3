"""Agentic episodes through the service with exact tokens, on a tiny model trained to call a calculator tool (real
engine output, real tool calls read by vLLM's hermes parser): over gRPC (rollout_client.Episode) and the vLLM dialect
(the `openai` package, whole and streamed). Each check: the tool call is parsed and run, its result reaches the next
turn, every turn's prompt starts with the episode's tokens so far (nothing sampled is tokenized again), and every
sampled token's log-prob equals an independent transformers forward pass over the whole episode."""
import json

import grpc
import pytest

from rollout_client import Episode, RolloutClient, run_episodes
from rollout_client.api import pb
from rollout_tasks.calculator import calculator
from tests.tiny_models import TOOL_CALCULATOR, TOOL_PROBLEMS

@pytest.fixture(scope="module")
def tool_client(tool_service):
    with RolloutClient(tool_service.target) as c:
        yield c


@pytest.fixture(scope="module")
def tool_hf(tool_model):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tool_model, dtype=torch.float32).eval()


def forward_gap(model, token_ids: list[int], mask: list[int], logprobs: list[float]) -> float:
    """The largest |served - forward| log-prob over the sampled positions of one exact episode (temperature 1)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    gaps = [abs(lp[i - 1, token_ids[i]].item() - logprobs[i]) for i, m in enumerate(mask) if m and i > 0]
    assert gaps, "no sampled token"
    return max(gaps)


def test_grpc_episodes_call_the_tool_and_keep_exact_tokens(tool_client, tool_hf, tool_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tool_model)
    question, expression, answer = TOOL_PROBLEMS[0]
    episodes = Episode.group([{"role": "user", "content": question}], n=4, tools=[TOOL_CALCULATOR])
    run_episodes(tool_client, episodes, {"calculator": calculator}, max_turns=3, max_tokens=48, temperature=1.0)
    called = [e for e in episodes if e.turns[0].message.tool_calls]
    assert len(called) >= 3, [e.turns[0].message for e in episodes]
    for e in called:
        call = e.turns[0].message.tool_calls[0]
        assert call.name == "calculator" and json.loads(call.arguments)["expression"]
        assert e.messages[2] == {"role": "tool", "tool_call_id": call.id, "name": "calculator",
                                 "content": calculator(json.loads(call.arguments)["expression"])}
        assert len(e.turns) >= 2
        # the tool's result was inserted (mask 0) right after turn 1's sampled tokens, then turn 2 was sampled
        first_end = len(e.turns[0].prompt_token_ids) + len(e.turns[0].token_ids)
        inserted = e.token_ids[first_end:len(e.turns[1].prompt_token_ids)]
        assert set(e.mask[first_end:len(e.turns[1].prompt_token_ids)]) == {0}
        assert f"<tool_response>\n{e.messages[2]['content']}\n</tool_response>" in tok.decode(inserted)
        assert e.turns[1].num_cached_tokens > 0                 # one session: turn 2 found turn 1 in the cache
        assert forward_gap(tool_hf, e.token_ids, e.mask, e.logprobs) < 2e-3
        assert len(e.token_ids) == len(e.mask) == len(e.logprobs)
    finals = [e.messages[-1]["content"] or "" for e in called if len(e.turns) >= 2]
    assert sum(f"The answer is {answer}" in f for f in finals) >= len(finals) // 2, finals
    # Render gives the next prompt exactly; Parse reads a turn as the sample's message
    e = called[0]
    first_end = len(e.turns[0].prompt_token_ids) + len(e.turns[0].token_ids)
    nxt = tool_client.render(Episode(messages=e.messages[:3], tools=[TOOL_CALCULATOR],
                                     token_ids=e.token_ids[:first_end], num_rendered=2))
    assert list(nxt.token_ids) == e.turns[1].prompt_token_ids.tolist() and nxt.num_prefix_tokens == first_end
    parsed = tool_client.parse(e.turns[0].token_ids, e.prompt().chat)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [(c.name, c.arguments)
                                                                  for c in e.turns[0].message.tool_calls]


def test_grpc_refuses_a_bad_chat_naming_the_field(tool_client):
    bad = Episode(messages=[{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c9", "content": "5"}],
                  tools=[TOOL_CALCULATOR])
    with pytest.raises(grpc.RpcError) as e:
        list(tool_client.generate([bad.prompt()], max_tokens=4))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("prompts[0].chat.messages[1].tool_call_id: 'c9' answers no tool call")
    unknown = Episode(messages=[{"role": "user", "content": "x"}], tools=[TOOL_CALCULATOR],
                      tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(grpc.RpcError) as e:
        tool_client.render(unknown)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "chat.tool_choice" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        list(tool_client.generate([pb.Prompt(token_ids=[1], chat=unknown.prompt().chat)], max_tokens=4))
    assert "set exactly one of token_ids, text or chat" in e.value.details()


def test_dialect_episode_whole_and_streamed(tool_service, tool_hf):
    """The `openai` package as agent frameworks use it: tools, a parsed call, the tool message back, the answer; the
    second turn continues the first's exact tokens (prefix_token_ids); streamed calls equal the whole answer's."""
    import openai

    oa = openai.OpenAI(base_url=tool_service.http + "/v1", api_key="unused", max_retries=0)
    question, expression, answer = TOOL_PROBLEMS[1]
    first = [{"role": "user", "content": question}]
    r1 = oa.chat.completions.create(model="m", messages=first, tools=[TOOL_CALCULATOR], max_tokens=48,
                                    temperature=0, logprobs=True, extra_body={"return_token_ids": True})
    c1 = r1.choices[0]
    assert c1.finish_reason == "tool_calls" and c1.message.tool_calls, c1
    call = c1.message.tool_calls[0]
    assert call.function.name == "calculator"
    prompt1, ids1 = r1.prompt_token_ids, c1.token_ids
    history = first + [c1.message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id,
                        "content": calculator(json.loads(call.function.arguments)["expression"])}]
    r2 = oa.chat.completions.create(model="m", messages=history, tools=[TOOL_CALCULATOR], max_tokens=48,
                                    temperature=0, logprobs=True,
                                    extra_body={"prefix_token_ids": prompt1 + ids1, "num_prefix_messages": 2})
    c2 = r2.choices[0]
    assert r2.prompt_token_ids[:len(prompt1) + len(ids1)] == prompt1 + ids1
    assert f"The answer is {answer}" in (c2.message.content or ""), c2.message
    tokens = r2.prompt_token_ids + c2.token_ids
    mask = [0] * len(prompt1) + [1] * len(ids1) + [0] * (len(r2.prompt_token_ids) - len(prompt1) - len(ids1)) + \
        [1] * len(c2.token_ids)
    lps = [0.0] * len(prompt1) + [x.logprob for x in c1.logprobs.content] + \
        [0.0] * (len(r2.prompt_token_ids) - len(prompt1) - len(ids1)) + [x.logprob for x in c2.logprobs.content]
    assert forward_gap(tool_hf, tokens, mask, lps) < 2e-3          # temperature 0: the raw distribution's log-probs
    # streamed, as verifiers' agent loop reads it: the call's pieces add up to the whole answer's call
    stream = oa.chat.completions.create(model="m", messages=first, tools=[TOOL_CALCULATOR], max_tokens=48,
                                        temperature=0, stream=True, stream_options={"include_usage": True})
    name, args, finish, content = "", "", None, ""
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                name += tc.function.name or "" if tc.function else ""
                args += tc.function.arguments or "" if tc.function else ""
            finish = ch.finish_reason or finish
    assert (name, json.loads(args)) == ("calculator", json.loads(call.function.arguments))
    assert finish == "tool_calls" and "<tool_call>" not in content
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model="m", messages=history[:1] + history[2:], tools=[TOOL_CALCULATOR],
                                   max_tokens=4)
    assert e.value.body["param"] == "messages[1].tool_call_id"


def test_a_turn_continued_as_a_partial_sample_and_one_request_aborted_alone(tool_service, tool_client, tool_hf):
    """A chat turn cut short continues as a partial sample (Prompt.partial beside Prompt.chat): the continued sample
    starts with the partial's tokens and the rest is sampled after them, the forward pass's log-probs. An operator's
    abort of one request (/abort_requests naming its id) ends it alone; the episode beside it runs to its end."""
    import threading
    import types

    import httpx

    question = TOOL_PROBLEMS[2][0]
    e = Episode([{"role": "user", "content": question}], tools=[TOOL_CALCULATOR])
    whole = tool_client.generate_all([e.prompt()], max_tokens=48, temperature=1.0, seed=5)[0][0]
    cut = types.SimpleNamespace(token_ids=whole.token_ids[:4], logprobs=whole.logprobs[:4],
                                version_spans=whole.version_spans)
    again = tool_client.generate_all([e.prompt()], partials=[cut], max_tokens=48, temperature=1.0, seed=6)[0][0]
    assert again.token_ids[:4].tolist() == whole.token_ids[:4].tolist()
    prompt = again.prompt_token_ids.tolist()
    gap = forward_gap(tool_hf, prompt + again.token_ids.tolist(), [0] * (len(prompt) + 4) + [1] * (
        len(again.token_ids) - 4), [0.0] * len(prompt) + again.logprobs.tolist())
    assert gap < 2e-3 and again.message is not None

    errors, done = [], []

    def run(rid: str, max_tokens: int):
        try:
            ep = Episode([{"role": "user", "content": question}], tools=[TOOL_CALCULATOR])
            done.append((rid, tool_client.generate_all([ep.prompt()], request_id=rid, max_tokens=max_tokens,
                                                       ignore_eos=True, temperature=1.0)[0][0]))
        except Exception as err:  # noqa: BLE001 - the aborted one fails, as it should
            errors.append((rid, err))
    threads = [threading.Thread(target=run, args=("keep-me", 64)),
               threading.Thread(target=run, args=("cut-me", 250))]
    for t in threads:
        t.start()
    for _ in range(100):                                   # until both are admitted
        if httpx.post(tool_service.http + "/abort_requests", json={"request_ids": ["cut-me"]}).json()["aborted"]:
            break
        threading.Event().wait(0.05)
    for t in threads:
        t.join()
    assert [rid for rid, _ in done] == ["keep-me"] and len(done[0][1].token_ids) == 64
    assert [rid for rid, _ in errors] == ["cut-me"] and errors[0][1].code() == grpc.StatusCode.ABORTED


def test_reasoning_read_by_the_reasoning_parser_whole_and_streamed(tool_model, tmp_path):
    """`--reasoning-parser qwen3` (vLLM's) on this service's template: a turn that thinks before its call returns the
    reasoning apart from the content, whole (reasoning and reasoning_content) and streamed, and over gRPC
    (Sample.message.reasoning); include_reasoning false leaves it out."""
    import openai

    from tests.integration.services import running_service
    from tests.tiny_models import TOOL_REASONING, TOOL_THINK_SYSTEM

    question = TOOL_PROBLEMS[3][0]
    msgs = [{"role": "system", "content": TOOL_THINK_SYSTEM}, {"role": "user", "content": question}]
    with running_service(tool_model, tmp_path / "reasoning.log", "--reasoning-parser", "qwen3") as svc:
        oa = openai.OpenAI(base_url=svc.http + "/v1", api_key="unused", max_retries=0)
        r = oa.chat.completions.create(model="m", messages=msgs, tools=[TOOL_CALCULATOR], max_tokens=64,
                                       temperature=0)
        m = r.choices[0].message
        assert m.model_extra["reasoning_content"].strip() == TOOL_REASONING == m.model_extra["reasoning"].strip()
        assert m.tool_calls and m.tool_calls[0].function.name == "calculator" and "<think>" not in (m.content or "")
        reasoning = ""
        for chunk in oa.chat.completions.create(model="m", messages=msgs, tools=[TOOL_CALCULATOR], max_tokens=64,
                                                temperature=0, stream=True):
            for ch in chunk.choices:
                reasoning += (ch.delta.model_extra or {}).get("reasoning") or ""
        assert reasoning.strip() == TOOL_REASONING
        r = oa.chat.completions.create(model="m", messages=msgs, tools=[TOOL_CALCULATOR], max_tokens=64,
                                       temperature=0, extra_body={"include_reasoning": False})
        assert "reasoning" not in (r.choices[0].message.model_extra or {})
        with RolloutClient(svc.target) as c:
            e = Episode(msgs, tools=[TOOL_CALCULATOR])
            c.chat_step([e], max_tokens=64, temperature=0)
            assert e.turns[0].message.reasoning.strip() == TOOL_REASONING and e.turns[0].message.tool_calls
