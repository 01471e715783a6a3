"""Agentic episodes with exact tokens: a multi-turn chat with tools kept as ONE token sequence, the trainer's.

Each turn's prompt is the previous prompt, the sampled tokens verbatim, then only the new messages (tool results)
rendered by the server (ChatPrompt.prefix_token_ids): nothing sampled is ever tokenized again, so the sequence a
trainer computes its loss on is exactly the one the engine sampled from. `mask` marks the sampled tokens (1: loss
and log-probs) apart from the inserted ones (0: the first prompt, tool results, template glue).

    episodes = Episode.group([{"role": "user", "content": "What is 17 * 23?"}], tools=[CALCULATOR], n=4)
    run_episodes(client, episodes, {"calculator": calculator}, max_turns=4, max_tokens=128)
    for e in episodes:
        e.token_ids, e.mask, e.logprobs, e.messages
"""
from __future__ import annotations

import copy
import json
import uuid
from dataclasses import dataclass, field

from rollout_client.api import pb


@dataclass
class Episode:
    """One agent episode. messages: the conversation so far (OpenAI chat messages); token_ids / mask / logprobs: the
    exact token sequence (parallel lists) once the first turn ran; num_rendered: how many messages token_ids holds."""

    messages: list[dict]
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    chat_template_kwargs: dict | None = None
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    token_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)          # 1: sampled, 0: inserted
    logprobs: list[float] = field(default_factory=list)     # the sampled tokens' log-probs; 0.0 where inserted
    num_rendered: int = 0
    turns: list = field(default_factory=list)               # each turn's Sample
    done: bool = False

    @classmethod
    def group(cls, messages: list[dict], n: int, **kw) -> list["Episode"]:
        """n episodes from the same first messages (a GRPO group), in one session (they share the first prompt: its
        cache is computed once)."""
        kw.setdefault("session_id", uuid.uuid4().hex)
        return [cls(copy.deepcopy(messages), **copy.deepcopy(kw)) for _ in range(n)]

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens before the first sampled one (the first prompt)."""
        return self.mask.index(1) if 1 in self.mask else len(self.mask)

    @property
    def tool_calls(self) -> list:
        """The last turn's tool calls (rollout_client.ToolCall), the ones the next messages answer."""
        return list(self.turns[-1].message.tool_calls) if self.turns and self.turns[-1].message else []

    def prompt(self) -> pb.Prompt:
        """The next turn's prompt: the whole conversation, with the exact tokens so far as its prefix."""
        chat = pb.ChatPrompt(messages=json.dumps(self.messages),
                             tools=json.dumps(self.tools) if self.tools else "",
                             tool_choice=json.dumps(self.tool_choice) if isinstance(self.tool_choice, dict)
                             else self.tool_choice or "",
                             chat_template_kwargs=json.dumps(self.chat_template_kwargs or {}),
                             prefix_token_ids=self.token_ids,
                             num_prefix_messages=self.num_rendered if self.token_ids else 0)
        return pb.Prompt(chat=chat)

    def record(self, sample) -> None:
        """Take a turn's whole sample: the inserted prompt tokens, then the sampled ones, and its assistant message.
        The episode is done when the turn called no tool or did not stop by itself (max_tokens, an abort)."""
        if sample.prompt_token_ids is None:
            raise ValueError("the sample carries no prompt_token_ids (the first sample of a chat prompt does): one "
                             "prompt per episode, n=1")
        prompt = [int(t) for t in sample.prompt_token_ids]
        if prompt[:len(self.token_ids)] != self.token_ids:
            raise ValueError("the server's prompt does not start with the episode's tokens")
        inserted = prompt[len(self.token_ids):]
        sampled = [int(t) for t in sample.token_ids]
        self.token_ids += inserted + sampled
        self.mask += [0] * len(inserted) + [1] * len(sampled)
        self.logprobs += [0.0] * len(inserted) + [float(x) for x in sample.logprobs]
        self.turns.append(sample)
        self.messages.append(sample.message.openai() if sample.message else
                             {"role": "assistant", "content": sample.text})
        self.num_rendered = len(self.messages)
        self.done = not (sample.message and sample.message.tool_calls) or sample.finish_reason != "stop"

    def add_tool_result(self, call_id: str, content: str, name: str | None = None) -> None:
        msg = {"role": "tool", "tool_call_id": call_id, "content": content}
        if name:
            msg["name"] = name
        self.messages.append(msg)

    def add_message(self, message: dict) -> None:
        """Any other message for the next turn (a user's reply, an environment's observation)."""
        self.messages.append(message)

    def fork(self) -> "Episode":
        return copy.deepcopy(self)


def call_tools(episode: Episode, tools: dict) -> None:
    """Answer the last turn's tool calls with Python functions (name -> function of the call's JSON arguments,
    returning text); an unknown tool or bad arguments answer with the error's text, as agent harnesses do."""
    for call in episode.tool_calls:
        fn = tools.get(call.name)
        try:
            args = json.loads(call.arguments or "{}")
            result = str(fn(**args)) if fn else f"error: no tool named {call.name!r}"
        except Exception as e:  # noqa: BLE001 - the model's mistake is the tool's answer
            result = f"error: {type(e).__name__}: {e}"
        episode.add_tool_result(call.id, result, call.name)


def run_episodes(client, episodes: list[Episode], tools: dict, *, max_turns: int = 4, **sampling) -> list[Episode]:
    """Run episodes to their end or max_turns turns on a RolloutClient: each turn one Generate for every unfinished
    episode, then the tools. sampling: build_request's keywords (max_tokens, temperature, ...)."""
    for _ in range(max_turns):
        live = client.chat_step(episodes, **sampling)
        if not live:
            break
        for e in live:
            if not e.done:
                call_tools(e, tools)
    return episodes


async def run_episodes_async(client, episodes: list[Episode], tools: dict, *, max_turns: int = 4,
                             **sampling) -> list[Episode]:
    """run_episodes on an AsyncRolloutClient."""
    for _ in range(max_turns):
        live = await client.chat_step(episodes, **sampling)
        if not live:
            break
        for e in live:
            if not e.done:
                call_tools(e, tools)
    return episodes
