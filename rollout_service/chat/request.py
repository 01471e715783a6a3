"""A chat prompt for agents, checked: OpenAI's chat messages (text content, assistant tool calls and reasoning, tool
results), tools, tool_choice and the template's arguments, as vLLM's /v1/chat/completions takes them. Checked by vLLM's
own request model (its messages, tool and tool_choice rules and texts) and by the rules of an exact-token episode (a
tool message answers a call made earlier). Blocking (pydantic): run in the tokenizer thread.

Field names in errors are the request's own (messages[2].tool_call_id); `where` puts them under the caller's
(gRPC: prompts[0].chat.)."""
from __future__ import annotations

import json
from typing import Any

import msgspec

from rollout_service.errors import ServiceError, invalid_field

ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatPrompt(msgspec.Struct, kw_only=True):
    """A checked chat prompt. messages: as the chat template sees them (text content joined, tool-call arguments as
    objects, as vLLM hands them to a template). raw: the request's own messages, tools and tool_choice (vLLM's
    request model, which its parsers read)."""
    messages: list[dict]
    tools: list[dict] | None = None
    tool_choice: Any = None                  # "none" | "auto" | "required" | {"type": "function", "function": {...}}
    template_kwargs: dict = {}
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    include_reasoning: bool = True
    skip_special_tokens: bool = True
    prefix_token_ids: list[int] = []         # the episode's exact tokens so far (render.py)
    num_prefix_messages: int = 0             # how many of `messages` they hold
    raw: dict = {}

    @property
    def named_tool(self) -> str | None:
        tc = self.tool_choice
        return tc["function"]["name"] if isinstance(tc, dict) else None


def _bad(where: str, field: str, text: str) -> ServiceError:
    return invalid_field(where + field, text)


def _pydantic_error(e, where: str) -> ServiceError:
    """vLLM's request model refused it: its first error, at the path it names."""
    err = e.errors()[0]
    loc = err.get("loc") or ()
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in ("function-after", "function-before", "function-wrap") or "[" in str(part) or \
                str(part)[:1].isupper():
            continue                        # pydantic's union member names, not fields
        else:
            path += f".{part}" if path else str(part)
    msg = err.get("msg", str(e))
    ctx = (err.get("ctx") or {}).get("error")
    if ctx is not None:
        msg = str(ctx)
        param = getattr(ctx, "parameter", None)
        if param:
            path = param
    return _bad(where, path or "messages", msg)


def vllm_request(raw: dict, where: str = ""):
    """vLLM's ChatCompletionRequest of these fields (its own checks of messages, tools and tool_choice, and what its
    tool and reasoning parsers read). Raises INVALID_ARGUMENT naming the field."""
    from pydantic import ValidationError
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    try:
        return ChatCompletionRequest.model_validate(raw)
    except ValidationError as e:
        raise _pydantic_error(e, where) from None
    except Exception as e:  # noqa: BLE001 - vLLM's VLLMValidationError from its model validators (not wrapped)
        text = str(e).removesuffix(f" (parameter={getattr(e, 'parameter', None)})")
        raise _bad(where, getattr(e, "parameter", None) or "messages", text) from None


def _text(content, where: str) -> str | None:
    """A message's content as the template sees it: a string, or text parts joined by newlines (vLLM's "string"
    content format); None stays None (an assistant turn that only calls tools)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, "", "content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise _bad(where, f"[{j}].type", f"{kind!r}: this service serves text-only models; content parts must be "
                                             "{\"type\": \"text\", \"text\": ...}")
        texts.append(part["text"])
    return "\n".join(texts)


def _arguments(fn: dict) -> dict:
    """A tool call's arguments as an object, as vLLM gives them to a template (a JSON string parsed; malformed or not
    an object: {}, as vLLM coerces them so that a conversation with one bad call can go on)."""
    args = fn.get("arguments")
    if isinstance(args, dict):
        return args
    if isinstance(args, str) and args:
        try:
            parsed = json.loads(args)
        except ValueError:
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return {}


def conversation(messages: list, where: str = "", answered: bool = True) -> list[dict]:
    """The messages as a chat template reads them; INVALID_ARGUMENT naming the message at fault: an unknown role,
    non-text content, a tool call that is not a function, a tool message whose tool_call_id answers no earlier call
    (answered=False: any tool_call_id, for rendering pieces of a conversation: /tokenize)."""
    out: list[dict] = []
    calls: set[str] = set()
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, at, "must be an object with a role")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(where, f"{at}.role", f"{role!r}: must be one of {', '.join(ROLES)}")
        msg: dict = {"role": role, "content": _text(m.get("content"), f"{where}{at}.content")}
        if role != "assistant" and msg["content"] is None:
            raise _bad(where, f"{at}.content", f"a {role} message needs content")
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if role == "assistant":
            reasoning = m.get("reasoning_content") if m.get("reasoning_content") is not None else m.get("reasoning")
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise _bad(where, f"{at}.reasoning_content", "must be a string")
                msg["reasoning"] = msg["reasoning_content"] = reasoning
            tool_calls = []
            for j, tc in enumerate(m.get("tool_calls") or []):
                fn = tc.get("function") if isinstance(tc, dict) else None
                if not isinstance(fn, dict) or tc.get("type", "function") != "function" or \
                        not isinstance(fn.get("name"), str) or not fn["name"]:
                    raise _bad(where, f"{at}.tool_calls[{j}]", "must be {\"type\": \"function\", \"function\": "
                                                               "{\"name\": ..., \"arguments\": ...}}")
                call = {"type": "function", "function": {"name": fn["name"], "arguments": _arguments(fn)}}
                if isinstance(tc.get("id"), str):
                    call["id"] = tc["id"]
                    calls.add(tc["id"])
                tool_calls.append(call)
            if tool_calls:
                msg["tool_calls"] = tool_calls
        elif role == "tool":
            cid = m.get("tool_call_id")
            if not isinstance(cid, str) or not cid:
                raise _bad(where, f"{at}.tool_call_id", "required: the id of the assistant's tool call this message "
                                                        "answers")
            if answered and cid not in calls:
                raise _bad(where, f"{at}.tool_call_id", f"{cid!r} answers no tool call of an earlier assistant "
                                                        "message (each tool message follows the call it answers)")
            msg["tool_call_id"] = cid
        out.append(msg)
    return out


def check_chat(body: dict, where: str = "", prefix_token_ids: list[int] | None = None,
               num_prefix_messages: int = 0, answered: bool = True) -> ChatPrompt:
    """A chat prompt from OpenAI chat fields (messages, tools, tool_choice, parallel_tool_calls, chat_template_kwargs,
    reasoning_effort, add_generation_prompt, continue_final_message, include_reasoning, skip_special_tokens)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad(where, "messages", "must be a non-empty list of message objects")
    if body.get("continue_final_message") and "add_generation_prompt" not in body:
        body = body | {"add_generation_prompt": False}        # the template cannot do both (vLLM asks for it)
    raw = {k: body[k] for k in ("messages", "tools", "tool_choice", "parallel_tool_calls", "add_generation_prompt",
                                "continue_final_message", "include_reasoning", "skip_special_tokens")
           if body.get(k) is not None}
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise _bad(where, "chat_template_kwargs", "must be an object (the chat template's extra arguments)")
    effort = body.get("reasoning_effort")
    if effort is not None:                     # as vLLM: a template argument
        kwargs = {"reasoning_effort": effort} | kwargs
    conv = conversation(messages, where, answered)       # our rules first: a clear field name for the common mistakes
    req = vllm_request(raw, where)
    if req.continue_final_message and conv[-1]["role"] != "assistant":
        raise _bad(where, "continue_final_message", "the last message must be an assistant message to continue")
    if not 0 <= num_prefix_messages <= len(conv):
        raise _bad(where, "num_prefix_messages", f"must be in [0, {len(conv)}] (the messages sent), got "
                                                 f"{num_prefix_messages}")
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    tool_choice = req.tool_choice
    if hasattr(tool_choice, "model_dump"):
        tool_choice = tool_choice.model_dump(exclude_none=True)
    return ChatPrompt(messages=conv, tools=tools, tool_choice=tool_choice if tools else None,
                      template_kwargs=kwargs, add_generation_prompt=req.add_generation_prompt,
                      continue_final_message=req.continue_final_message, include_reasoning=req.include_reasoning,
                      skip_special_tokens=req.skip_special_tokens, prefix_token_ids=list(prefix_token_ids or []),
                      num_prefix_messages=num_prefix_messages, raw=raw)


def _json(text: str, field: str, where: str, default):
    if not text:
        return default
    try:
        return json.loads(text)
    except ValueError as e:
        raise _bad(where, field, f"not valid JSON ({e})") from None


def from_proto(chat, where: str = "", allow_empty: bool = False) -> ChatPrompt:
    """pb.ChatPrompt (its JSON fields) -> a checked ChatPrompt. allow_empty: messages may be [] (Parse)."""
    body: dict = {"messages": _json(chat.messages, "messages", where, None)}
    if allow_empty and body["messages"] in (None, []):
        body["messages"] = [{"role": "user", "content": ""}]
    tools = _json(chat.tools, "tools", where, None)
    if tools is not None:
        body["tools"] = tools
    choice = chat.tool_choice
    if choice:
        body["tool_choice"] = choice if choice in ("auto", "none", "required") else _json(choice, "tool_choice", where,
                                                                                          None)
    body["chat_template_kwargs"] = _json(chat.chat_template_kwargs, "chat_template_kwargs", where, None)
    if chat.continue_final_message:
        body["continue_final_message"] = True
    body["add_generation_prompt"] = not (chat.no_generation_prompt or chat.continue_final_message)
    body["include_reasoning"] = not chat.exclude_reasoning
    return check_chat(body, where, list(chat.prefix_token_ids), chat.num_prefix_messages)
