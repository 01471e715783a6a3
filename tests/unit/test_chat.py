"""Chat for agents without an engine (rollout_service/chat/): the template, the checks and their field names, exact
rendering across turns, and vLLM's parsers reading tool calls and reasoning, whole and streamed. SmolLM2's real
tokenizer (from the packaged GGUF) with this service's template."""
import json

import pytest

from rollout_service.api import pb
from rollout_service.chat.parse import Parsing
from rollout_service.chat.render import render, turn_close
from rollout_service.chat.request import check_chat, from_proto
from rollout_service.chat.template import TEMPLATE
from rollout_service.errors import ServiceError

CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic",
                                         "parameters": {"type": "object",
                                                        "properties": {"expression": {"type": "string"}},
                                                        "required": ["expression"]}}}
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call><|im_end|>'


@pytest.fixture(scope="module")
def tok():
    from tests.tiny_models import _tokenizer

    t = _tokenizer(None)
    original = t.chat_template
    t.chat_template = TEMPLATE
    t.original_template = original
    return t


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_without_tools_the_template_is_smollm2s_own(tok):
    """The drafters and the trainer's prompts were made with SmolLM2's template: without tools nothing changes."""
    for msgs in ([{"role": "user", "content": "hi"}],
                 [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
                  {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]):
        for gen in (True, False):
            ours = tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
            theirs = tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False,
                                             chat_template=tok.original_template)
            assert ours == theirs


def test_tools_calls_results_and_reasoning_render(tok):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "2 + 3?"}]},
            {"role": "assistant", "content": None, "reasoning_content": "add",
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "calculator", "arguments": '{"expression": "2 + 3"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "5"}]
    text = tok.decode(render(tok, check_chat({"messages": msgs, "tools": [CALC]}))[0], skip_special_tokens=False)
    assert "\"name\": \"calculator\"" in text.split("<tools>\n")[1].split("\n</tools>")[0]     # its signature
    assert "What is\n2 + 3?" in text                                                   # text parts joined
    assert ('<|im_start|>assistant\n<think>\nadd\n</think>\n\n<tool_call>\n{"name": "calculator", "arguments": '
            '{"expression": "2 + 3"}}\n</tool_call><|im_end|>') in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("body, field, words", [
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "nope", "content": "5"}]},
     "messages[1].tool_call_id", "answers no tool call"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "5"}]},
     "messages[1].tool_call_id", "required"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [CALC],
      "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "does not match"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, "tool_choice", "`tools` must be set"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": []}, "tools", "must not be an empty array"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
     "messages[0].content[0].type", "text-only"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "must be one of"),
    ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, "continue_final_message",
     "assistant message"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"type": "function"}]}]},
     "messages[0].tool_calls[0]", "function"),
])
def test_a_bad_chat_is_refused_naming_the_field(body, field, words):
    with pytest.raises(ServiceError) as e:
        check_chat(body, "prompts[0].chat.")
    assert e.value.field == f"prompts[0].chat.{field}" and words in e.value.message, e.value.message


def test_the_next_turn_is_the_exact_tokens_then_only_the_new_messages(tok):
    """Turn 2's prompt = turn 1's prompt + its sampled tokens verbatim + the tool result rendered; for a turn that
    stopped at <|im_end|> it equals rendering the whole conversation, for one cut by max_tokens the close is
    inserted; and a prefix the template would never produce (a made-up token) stays as it is."""
    first = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt, k = render(tok, check_chat({"messages": first, "tools": [CALC]}))
    assert k == 0
    sampled = ids(tok, CALL)
    call = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2 + 3"}'}}
    convo = first + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "c1", "content": "5"}]
    nxt, k = render(tok, check_chat({"messages": convo, "tools": [CALC]}, prefix_token_ids=prompt + sampled,
                                    num_prefix_messages=2))
    assert k == len(prompt) + len(sampled) and nxt[:k] == prompt + sampled
    assert nxt == render(tok, check_chat({"messages": convo, "tools": [CALC]}))[0]
    assert tok.decode(nxt[k:], skip_special_tokens=False) == ("\n<|im_start|>user\n<tool_response>\n5\n"
                                                              "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    cut = sampled[:-3]                                              # max_tokens ended it inside the call
    nxt, k = render(tok, check_chat({"messages": convo, "tools": [CALC]}, prefix_token_ids=prompt + cut,
                                    num_prefix_messages=2))
    assert nxt[:k] == prompt + cut
    assert tok.decode(nxt[k:], skip_special_tokens=False).startswith("<|im_end|>\n<|im_start|>user\n")
    assert turn_close(tok, check_chat({"messages": first})) == "<|im_end|>\n"
    odd = prompt + [7777] + sampled
    nxt, k = render(tok, check_chat({"messages": convo, "tools": [CALC]}, prefix_token_ids=odd,
                                    num_prefix_messages=2))
    assert nxt[:k] == odd
    with pytest.raises(ServiceError) as e:
        render(tok, check_chat({"messages": convo}, prefix_token_ids=prompt), "chat.")
    assert e.value.field == "chat.num_prefix_messages"


def test_the_proto_prompt_reads_as_the_dialect_body():
    chat = pb.ChatPrompt(messages=json.dumps([{"role": "user", "content": "x"}]), tools=json.dumps([CALC]),
                         tool_choice=json.dumps({"type": "function", "function": {"name": "calculator"}}),
                         chat_template_kwargs='{"enable_thinking": false}', exclude_reasoning=True)
    p = from_proto(chat, "prompts[0].chat.")
    assert p.named_tool == "calculator" and p.template_kwargs == {"enable_thinking": False}
    assert not p.include_reasoning and p.add_generation_prompt
    with pytest.raises(ServiceError) as e:
        from_proto(pb.ChatPrompt(messages="[{"), "prompts[0].chat.")
    assert e.value.field == "prompts[0].chat.messages" and "JSON" in e.value.message


def test_vllms_parsers_read_calls_and_reasoning_whole_and_streamed(tok):
    parsing = Parsing.configured("auto", "qwen3", tok)
    assert parsing.tool_parser == "hermes"            # auto: this service's template
    prompt = check_chat({"messages": [{"role": "user", "content": "x"}], "tools": [CALC]})
    out = ids(tok, "<think>\nadd them\n</think>\n\nSure. " + CALL)
    m = parsing.parse(prompt, out, [1])
    assert m.reasoning.strip() == "add them" and m.content.strip() == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in m.tool_calls] == [("calculator", {"expression": "2 + 3"})]
    stream = parsing.stream(prompt, [1])
    deltas = [stream.step(out[i:i + 2], finished=i + 2 >= len(out)) for i in range(0, len(out), 2)]
    deltas = [d for d in deltas if d]
    assert "".join(d.get("reasoning", "") for d in deltas).strip() == "add them"
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "calculator" and stream.called
    assert json.loads("".join(c["function"].get("arguments", "") for c in calls)) == {"expression": "2 + 3"}
    assert "<|im_end|>" not in "".join(d.get("content", "") for d in deltas)   # the eos that ended it: never text
    plain = Parsing.configured("none", "none", tok)
    assert plain.parse(prompt, out, [1]).tool_calls == []


def test_tool_choice_needs_a_parser_and_required_is_constrained(tok):
    none = Parsing.configured("none", "none", tok)
    for choice in ("auto", "required", {"type": "function", "function": {"name": "calculator"}}):
        with pytest.raises(ServiceError) as e:
            none.check(check_chat({"messages": [{"role": "user", "content": "x"}], "tools": [CALC],
                                   "tool_choice": choice}), "chat.")
        assert e.value.field == "chat.tool_choice" and "--tool-call-parser" in e.value.message
    none.check(check_chat({"messages": [{"role": "user", "content": "x"}], "tools": [CALC], "tool_choice": "none"}))
    hermes = Parsing.configured("hermes", "none", tok)
    auto = check_chat({"messages": [{"role": "user", "content": "x"}], "tools": [CALC]})
    assert hermes.constraint(auto) == ""                          # auto samples the policy unconstrained
    for choice in ("required", {"type": "function", "function": {"name": "calculator"}}):
        c = json.loads(hermes.constraint(check_chat({"messages": [{"role": "user", "content": "x"}], "tools": [CALC],
                                                     "tool_choice": choice})))
        assert "<tool_call>" in c["structural_tag"] and "calculator" in c["structural_tag"]
    with pytest.raises(ValueError, match="no-such-parser"):
        Parsing.configured("no-such-parser", "none", tok)
