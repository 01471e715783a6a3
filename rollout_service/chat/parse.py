"""Samples -> assistant messages: content, reasoning and tool calls, read by vLLM's own tool and reasoning parsers
(vllm/tool_parsers, vllm/reasoning, composed by vllm.parser.ParserManager), configured as `vllm serve` configures them
(--tool-call-parser, --reasoning-parser), and applied to a chat sample as vLLM's chat serving applies them: whole
(vLLM's chat_completion_full_generator) or step by step (its stream generator). Blocking: the tokenizer thread."""
from __future__ import annotations

import json
import uuid

import msgspec

from rollout_service.chat.request import ChatPrompt, vllm_request
from rollout_service.errors import invalid_field


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    name: str
    arguments: str                   # JSON text, as OpenAI's function.arguments


class Message(msgspec.Struct, kw_only=True):
    """An assistant message read from a sample's tokens."""
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = []

    def openai(self) -> dict:
        msg: dict = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            msg["reasoning_content"] = msg["reasoning"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in self.tool_calls]
        return msg


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:16]}"


class Parsing:
    """The server's parsers: a tool-call parser (auto tool choice) and a reasoning parser, either may be absent.
    Construction checks that the tokenizer has what they need (vLLM's start-up check)."""

    def __init__(self, tokenizer, tool_parser: str = "", reasoning_parser: str = ""):
        self.tokenizer = tokenizer
        self.tool_parser, self.reasoning_parser = tool_parser, reasoning_parser
        self.auto_tool_choice = True
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos = {eos} if isinstance(eos, int) else set(eos or ())
        self.cls = None
        if tool_parser or reasoning_parser:
            from vllm.parser.parser_manager import ParserManager

            self.cls = ParserManager.get_parser(tool_parser_name=tool_parser or None,
                                                reasoning_parser_name=reasoning_parser or None,
                                                enable_auto_tools=bool(tool_parser), tokenizer=tokenizer)

    @classmethod
    def configured(cls, tool_call_parser: str, reasoning_parser: str, tokenizer, auto_tool_choice: bool = True
                   ) -> "Parsing":
        """From the server's config (ChatConfig): `auto` picks the parser of this service's template where the model
        renders chats with it; `none` is none. Unknown names, or a tokenizer that lacks what a parser needs: ValueError
        naming the flag (at start-up, as vllm serve fails)."""
        from rollout_service.chat import template

        tool = {"none": "", "auto": template.TOOL_PARSER if template.is_ours(tokenizer) else ""}.get(
            tool_call_parser, tool_call_parser)
        reasoning = "" if reasoning_parser in ("none", "") else reasoning_parser
        try:
            parsing = cls(tokenizer, tool, reasoning)
        except (TypeError, KeyError, ValueError) as e:
            raise ValueError(f"--tool-call-parser {tool_call_parser} / --reasoning-parser {reasoning_parser}: {e}") \
                from None
        parsing.auto_tool_choice = auto_tool_choice
        return parsing

    def check(self, prompt: ChatPrompt, where: str = "") -> None:
        """A request's tools against the server's parsers, as vLLM answers it (INVALID_ARGUMENT naming tool_choice)."""
        choice = prompt.tool_choice
        if prompt.tools is None or choice in (None, "none") or (self.tool_parser and (
                choice != "auto" or self.auto_tool_choice)):
            return
        if choice == "auto" and self.tool_parser:
            raise invalid_field(where + "tool_choice", "\"auto\" tool choice requires --enable-auto-tool-choice and "
                                "--tool-call-parser to be set (this server's config has "
                                "chat.enable_auto_tool_choice = false)")
        if choice == "auto":
            raise invalid_field(where + "tool_choice", "\"auto\" tool choice requires --enable-auto-tool-choice and "
                                "--tool-call-parser to be set (this server was started without a tool-call parser: "
                                "--tool-call-parser none); send tool_choice \"none\" or restart it with one")
        what = f'function "{prompt.named_tool}"' if prompt.named_tool else f'"{choice}"'
        raise invalid_field(where + "tool_choice", f"tool_choice={what} requires --tool-call-parser to be set")

    def constraint(self, prompt: ChatPrompt) -> str:
        """What vLLM constrains a chat's sampling with for its tools (its parsers' adjust_request: for tool_choice
        "required" or a named function, an xgrammar structural tag of the parser's call format, or the calls' JSON
        schema): vLLM's StructuredOutputsParams fields as JSON text; "" when there is none (tool_choice auto, none)."""
        if self.cls is None or prompt.tools is None or prompt.tool_choice == "none":
            return ""
        req = self.parser(prompt).adjust_request(vllm_request(prompt.raw))
        so = getattr(req, "structured_outputs", None)
        if so is None:
            return ""
        fields = {k: getattr(so, k) for k in ("json", "regex", "choice", "grammar", "json_object", "structural_tag",
                                              "disable_any_whitespace", "disable_additional_properties",
                                              "whitespace_pattern") if getattr(so, k, None) not in (None, False)}
        return json.dumps(fields) if fields else ""

    def parser(self, prompt: ChatPrompt):
        return self.cls(self.tokenizer, vllm_request(prompt.raw).tools,
                        chat_template_kwargs=prompt.template_kwargs)

    def text(self, prompt: ChatPrompt, token_ids: list[int]) -> str:
        """A sample's text as the parsers read it: special tokens kept where a tool parser asks (hermes does), the
        end-of-sequence token that ended it left out (vLLM's detokenizer never decodes it)."""
        keep = self.cls is not None and prompt.tools is not None and prompt.tool_choice != "none"
        if token_ids and token_ids[-1] in self.eos:
            token_ids = token_ids[:-1]
        return self.tokenizer.decode(token_ids, skip_special_tokens=prompt.skip_special_tokens and not keep)

    def parse(self, prompt: ChatPrompt, token_ids: list[int], prompt_ids: list[int]) -> Message:
        """A whole sample as vLLM's chat serving reads it (chat_completion_full_generator)."""
        text = self.text(prompt, token_ids)
        if self.cls is None:
            return Message(content=text)
        request = vllm_request(prompt.raw)
        parser = self.parser(prompt)
        request = parser.adjust_request(request)
        parser.set_prompt_token_ids(prompt_ids)
        reasoning, content, calls = parser.parse(text, request, enable_auto_tools=bool(self.tool_parser),
                                                 model_output_token_ids=token_ids)
        if not prompt.include_reasoning:
            reasoning = None
        tool_calls = [ToolCall(id=c.id or call_id(), name=c.name, arguments=c.arguments) for c in calls or []]
        if self.tool_parser and tool_calls and content is not None and not content.strip():
            content = None
        if prompt.tool_choice in ("required",) or prompt.named_tool:
            content = content or ""
        return Message(content=content, reasoning=reasoning, tool_calls=tool_calls)

    def stream(self, prompt: ChatPrompt, prompt_ids: list[int]) -> "Stream":
        return Stream(self, prompt, prompt_ids)


class Stream:
    """One streamed sample's parser (vLLM's parsers keep state per stream): each engine step's tokens -> the delta
    message vLLM streams for them (content, reasoning, tool-call pieces), or None while a tag is incomplete."""

    def __init__(self, parsing: Parsing, prompt: ChatPrompt, prompt_ids: list[int]):
        self.parsing, self.prompt, self.prompt_ids = parsing, prompt, prompt_ids
        self.ids: list[int] = []
        self.prefix = self.read = 0          # ids[prefix:read]: the last piece's tokens, decoded again as context
        self.parser = None
        self.called = False                  # a tool call was streamed: finish_reason "tool_calls"
        if parsing.cls is not None:
            self.request = vllm_request(prompt.raw)
            self.parser = parsing.parser(prompt)
            self.request = self.parser.adjust_request(self.request)
            self.parser.set_prompt_token_ids(prompt_ids)

    def step(self, new_ids: list[int], finished: bool) -> dict | None:
        """The OpenAI delta (without role) for `new_ids`; None for nothing to send yet. Decodes a few tokens per step
        (the last piece's tokens again as context, as vLLM's incremental detokenizer does); a character split over
        tokens waits for its next token."""
        self.ids += new_ids
        before = self.parsing.text(self.prompt, self.ids[self.prefix:self.read])
        now = self.parsing.text(self.prompt, self.ids[self.prefix:])
        if not finished and (len(now) <= len(before) or now.endswith("\ufffd") or not now.startswith(before)):
            return None
        piece = now[len(before):] if now.startswith(before) else ""
        new = self.ids[self.read:]
        self.prefix, self.read = self.read, len(self.ids)
        if self.parser is None:
            return {"content": piece} if piece else None
        delta = self.parser.parse_delta(piece, new, self.request, self.prompt_ids, finished=finished)
        if delta is None:
            return None
        out = delta.model_dump(exclude_none=True)
        if not self.prompt.include_reasoning:
            out.pop("reasoning", None)
            out.pop("reasoning_content", None)
        if "reasoning" in out:
            out.setdefault("reasoning_content", out["reasoning"])
        if out.get("tool_calls"):
            self.called = True
        return out or None
