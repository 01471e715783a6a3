"""vLLM's chat endpoints, for agents: what verifiers, ART, prime-rl and the `openai` package send with tools.

    POST /v1/chat/completions           messages (text parts, assistant tool_calls and reasoning, tool results), tools,
                                        tool_choice (none / auto / required / a named function), chat_template_kwargs,
                                        add_generation_prompt / continue_final_message; the answer's message carries
                                        tool_calls and reasoning read by vLLM's parsers, streamed as vLLM streams them.
                                        Extension: prefix_token_ids + num_prefix_messages continue an episode's exact
                                        tokens (ChatPrompt.prefix_token_ids); prompt_token_ids and each choice's
                                        token_ids come back in every answer
    POST /v1/chat/completions/tokens    prime-rl's token-in chat: the same request with `tokens`, the prompt's ids
    POST /v1/chat/completions/render    vLLM's render endpoint: the request -> its token ids and sampling parameters
    POST /v1/chat/completions/derender  vLLM's derender: generated token ids -> the chat completion's message

A chat request becomes a GenerateRequest with a chat prompt (Prompt.chat): rendered, checked and constrained where the
gRPC Generate does it (validation.py, chat/), and read back by the same parsers. A field vLLM serves and this service
does not is a 400 naming it, never dropped.
"""
from __future__ import annotations

import json
import time
import uuid

from fastapi import APIRouter, Request

from rollout_service.api import pb
from rollout_service.errors import ServiceError
from rollout_service.server.compat.gateway import DialectError, Fields, answers_errors, from_service_error, gateway, \
    json_body
from rollout_service.server.compat.vllm_api import Options, _answer, _common

router = APIRouter()
# the contract's names as the chat endpoint spells them (gateway.spell)
CHAT_SPELLING = {"sampling.max_tokens": "max_tokens", "sampling.": "", "prompts[0].chat.": "", "prompts[0]": "messages",
                 "top_logprobs": "top_logprobs"}

# vLLM's chat fields this service does not serve: fine at their default, a 400 naming them otherwise
UNSERVED = {
    "logit_bias": (None, "logit biases change the sampled distribution away from the policy's"),
    "response_format": (None, "response formats (constrained decoding) are not served; tool_choice \"required\" or "
                              "a named function constrain a tool call"),
    "structured_outputs": (None, "constrained decoding is not served, except for tool calls (tool_choice)"),
    "length_penalty": (1.0, "beam search is not served"),
    "include_stop_str_in_output": (False, "stop strings are left out of the text; the tokens are all returned"),
    "spaces_between_special_tokens": (True, "special tokens are decoded as the tokenizer joins them"),
    "truncate_prompt_tokens": (None, "prompts are never truncated; shorten the conversation"),
    "truncation_side": (None, "prompts are never truncated"),
    "logprob_token_ids": (None, "log-probs of chosen token ids are not served (top_logprobs are)"),
    "allowed_token_ids": (None, "restricting the vocabulary changes the sampled distribution"),
    "bad_words": ([], "banned words change the sampled distribution"),
    "add_special_tokens": (False, "the chat template's text is tokenized without added special tokens"),
    "documents": (None, "retrieval documents in the template are not served"),
    "chat_template": (None, "a per-request chat template is not served (the model's own renders every request)"),
    "media_io_kwargs": (None, "text-only models are served"),
    "mm_processor_kwargs": (None, "text-only models are served"),
    "watermarking": (None, "watermarking changes the sampled distribution"),
    "kv_transfer_params": (None, "disaggregated prefill is not served; continue an episode with prefix_token_ids"),
    "ec_transfer_params": (None, "disaggregated encoding is not served"),
    "vllm_xargs": (None, "vLLM's extra arguments are not served"),
    "repetition_detection": (None, "repetition detection changes where samples end"),
    "stream_interval": (None, "a stream sends a chunk per engine step"),
    "return_token_offsets": (False, "token offsets are not served"),
    "return_prompt_text": (None, "the prompt's ids come back in prompt_token_ids; decode them with /detokenize"),
    "return_mm_kwargs": (None, "text-only models are served"),
    "routed_experts_prompt_start": (0, "routes come back for the whole sample (routed_experts)"),
    "priority": (0, "request priorities are not served (tenants' fair shares are)"),
    "thinking_token_budget": (None, "a reasoning budget changes where samples end"),
    "reasoning_effort": (None, None),    # served: a chat-template argument, as vLLM passes it
}


def _unserved(body: dict) -> None:
    for key, (default, why) in UNSERVED.items():
        v = body.get(key)
        if why is not None and v is not None and v != default:
            raise DialectError(400, f"{key}: {why} (got {v!r:.80})", key)


def chat_prompt(body: dict, prefix: list | None = None, num_prefix: int | None = None) -> pb.ChatPrompt:
    """The chat fields of a request -> Prompt.chat (its JSON fields: checked and rendered by validation.py)."""
    f = Fields(body)
    choice = body.get("tool_choice")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise DialectError(400, "chat_template_kwargs: must be an object (the chat template's extra arguments)",
                           "chat_template_kwargs")
    if body.get("reasoning_effort") is not None:            # as vLLM: a template argument
        kwargs = {"reasoning_effort": body["reasoning_effort"]} | (kwargs or {})
    cont = f.bool("continue_final_message")
    gen = f.bool("add_generation_prompt", not cont)
    if cont and gen:
        raise DialectError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                           "add_generation_prompt")
    if prefix is None:
        prefix = f.int_list("prefix_token_ids")
        num_prefix = f.int("num_prefix_messages", 0)
    if "tools" in body and body["tools"] is None:
        body = {k: v for k, v in body.items() if k != "tools"}
    return pb.ChatPrompt(messages=json.dumps(body.get("messages")),
                         tools=json.dumps(body["tools"]) if "tools" in body else "",
                         tool_choice=choice if isinstance(choice, str) else json.dumps(choice) if choice else "",
                         chat_template_kwargs=json.dumps(kwargs) if kwargs else "",
                         continue_final_message=cont, no_generation_prompt=not gen,
                         prefix_token_ids=prefix, num_prefix_messages=num_prefix or 0,
                         exclude_reasoning=not f.bool("include_reasoning", True))


def parse_chat(body: dict, prefix: list | None = None, num_prefix: int | None = None
               ) -> tuple[pb.GenerateRequest, Options]:
    _unserved(body)
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise DialectError(400, "messages: must be a non-empty list of message objects", "messages")
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is not None:
        body["max_tokens"] = body["max_completion_tokens"]
    req, opts = _common(Fields(body), "chat")
    opts.fill_context = body.get("max_tokens") is None        # vLLM: up to the context length
    req.prompts.append(pb.Prompt(chat=chat_prompt(body, prefix, num_prefix)))
    return req, opts


async def _chat(request: Request, tokens_field: str | None = None):
    gw = gateway(request)
    body = json_body(await request.body())
    prefix = num_prefix = None
    if tokens_field is not None:                  # the prompt's ids as the client has them: taken verbatim
        ids = body.get(tokens_field)
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in ids):
            raise DialectError(400, f"{tokens_field}: required, the prompt's token ids", tokens_field)
        prefix, num_prefix = ids, len(body.get("messages") or [])
        body = body | {"add_generation_prompt": False, "continue_final_message": False}
    req, opts = parse_chat(body, prefix, num_prefix)
    req.policy = gw.policy_of(body.get("model"))
    req.session_id = gw.session_key(request, body)
    return await _answer(request, gw, req, opts, CHAT_SPELLING, body)


@router.post("/v1/chat/completions")
@answers_errors
async def chat_completions(request: Request):
    """OpenAI chat with tools: the model's chat template renders messages and tools (in the tokenizer thread);
    the samples' tool calls and reasoning are read by the server's parsers."""
    return await _chat(request)


@router.post("/v1/chat/completions/tokens")
@answers_errors
async def chat_completions_tokens(request: Request):
    """prime-rl's token-in chat (its PR 1422): a chat request whose prompt is `tokens`, the episode's ids as the
    client built them; tools and tool_choice still pick how the samples are read."""
    return await _chat(request, "tokens")


@router.post("/v1/chat/completions/render")
@answers_errors
async def chat_render(request: Request):
    """vLLM's render endpoint: a chat request -> what the engine would be given (its token ids, its sampling
    parameters); nothing is sampled."""
    gw = gateway(request)
    body = json_body(await request.body())
    req, opts = parse_chat(body)
    try:
        ids, num_prefix, _ = await gw.in_tokenizer_thread(gw.service.render, req.prompts[0].chat, False, "")
    except ServiceError as e:
        raise from_service_error(e, CHAT_SPELLING) from None
    sp = req.sampling
    params = {k: getattr(sp, k) for k in ("temperature", "top_p", "top_k", "max_tokens", "seed") if sp.HasField(k)}
    params |= {"n": opts.n, "stop": list(sp.stop), "stop_token_ids": list(sp.stop_token_ids),
               "logprobs": req.top_logprobs if opts.logprobs else None}
    if "max_tokens" not in params:
        params["max_tokens"] = gw.model.max_model_len - len(ids)
    return {"request_id": f"chatcmpl-{uuid.uuid4().hex}", "token_ids": ids, "num_prefix_tokens": num_prefix,
            "sampling_params": params, "model": body.get("model") or gw.model.path, "stream": opts.stream}


@router.post("/v1/chat/completions/derender")
@answers_errors
async def chat_derender(request: Request):
    """vLLM's derender endpoint: {generate_response: {choices: [{token_ids, finish_reason}]}, chat_request,
    prompt_token_ids?} -> the chat completion those tokens make (tool calls and reasoning read by the server's
    parsers)."""
    gw = gateway(request)
    body = json_body(await request.body())
    chat_request = body.get("chat_request")
    if not isinstance(chat_request, dict):
        raise DialectError(400, "chat_request: required, the chat request the tokens answer", "chat_request")
    gen = body.get("generate_response")
    choices = gen.get("choices") if isinstance(gen, dict) else None
    if not isinstance(choices, list) or not choices:
        raise DialectError(400, "generate_response.choices: required, a list of {token_ids}",
                           "generate_response.choices")
    chat = chat_prompt(chat_request)
    prompt_ids = body.get("prompt_token_ids") or (gen.get("prompt_token_ids") if isinstance(gen, dict) else None) or []
    out = []
    for i, c in enumerate(choices):
        ids = c.get("token_ids") if isinstance(c, dict) else None
        if not isinstance(ids, list):
            raise DialectError(400, f"generate_response.choices[{i}].token_ids: required, a list of token ids",
                               f"generate_response.choices[{i}].token_ids")
        try:
            message = await gw.in_tokenizer_thread(gw.service.parse, ids, chat, list(prompt_ids), "chat_request.")
        except ServiceError as e:
            raise from_service_error(e, {"chat_request.": "chat_request."}) from None
        finish = c.get("finish_reason") or "stop"
        if message.tool_calls and chat.tool_choice in ("", "auto", "required") and finish == "stop":
            finish = "tool_calls"
        out.append({"index": c.get("index", i), "message": message.openai(), "finish_reason": finish,
                    "token_ids": ids, "logprobs": None})
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": chat_request.get("model") or gw.model.path, "choices": out}
