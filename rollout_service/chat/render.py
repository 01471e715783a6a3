"""Chat prompts -> token ids, exactly across the turns of an episode.

A fresh prompt is the whole conversation through the chat template (tools included), tokenized as vLLM tokenizes a
rendered chat (no special tokens added). A continued one (ChatPrompt.prefix_token_ids) is the episode's tokens so far,
verbatim (earlier prompts and the sampled tokens: nothing sampled is tokenized again), then only the messages after
the first num_prefix_messages, rendered: the template's text for them after the earlier ones, preceded by what closes
the assistant turn the prefix ends with where its sampled tokens did not (a turn cut by max_tokens gets its end-of-turn
marker; one that stopped at it gets only the newline after it). Those inserted tokens are the prompt's ids after the
prefix: a trainer masks them out of its loss."""
from __future__ import annotations

from rollout_service.chat.request import ChatPrompt
from rollout_service.errors import invalid_field

SENTINEL = "\x00rollout-sentinel\x00"


def template_text(tokenizer, messages: list[dict], prompt: ChatPrompt, generation: bool,
                  continue_final: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tools=prompt.tools, tokenize=False,
                                         add_generation_prompt=generation and not continue_final,
                                         continue_final_message=continue_final, **prompt.template_kwargs)


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def turn_close(tokenizer, prompt: ChatPrompt) -> str:
    """What the template writes after an assistant turn's text (ChatML: "<|im_end|>\\n")."""
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": SENTINEL}]
    text = template_text(tokenizer, msgs, prompt, generation=False)
    at = text.rfind(SENTINEL)
    return text[at + len(SENTINEL):] if at >= 0 else ""


def render(tokenizer, prompt: ChatPrompt, where: str = "") -> tuple[list[int], int]:
    """(the prompt's token ids, how many of them lead from the prefix: len(prefix_token_ids)). INVALID_ARGUMENT naming
    the field where the template cannot render the messages."""
    gen, cont = prompt.add_generation_prompt, prompt.continue_final_message
    k = prompt.num_prefix_messages
    if prompt.prefix_token_ids and k == 0:
        raise invalid_field(where + "num_prefix_messages", "must say how many of the messages prefix_token_ids holds "
                            "(at least 1) when prefix_token_ids is set")
    try:
        if not prompt.prefix_token_ids:
            return _encode(tokenizer, template_text(tokenizer, prompt.messages, prompt, gen, cont)), 0
        if k == len(prompt.messages) and not gen:
            return list(prompt.prefix_token_ids), len(prompt.prefix_token_ids)
        new = _after(tokenizer, prompt, k, gen, cont)
    except Exception as e:  # noqa: BLE001 - jinja's errors: a template that cannot render these messages
        raise invalid_field(where + "messages", f"the chat template cannot render them ({e})") from None
    glue = ""
    if prompt.messages[k - 1]["role"] == "assistant":
        close = turn_close(tokenizer, prompt)
        tail = tokenizer.decode(prompt.prefix_token_ids[-16:], skip_special_tokens=False)
        done = next((n for n in range(len(close), 0, -1) if tail.endswith(close[:n])), 0)
        glue = close[done:]
    prefix = list(prompt.prefix_token_ids)
    return prefix + _encode(tokenizer, glue + new), len(prefix)


def _after(tokenizer, prompt: ChatPrompt, k: int, gen: bool, cont: bool) -> str:
    """The template's text for messages[k:] after messages[:k]."""
    earlier = template_text(tokenizer, prompt.messages[:k], prompt, generation=False)
    whole = template_text(tokenizer, prompt.messages, prompt, gen, cont)
    if whole.startswith(earlier):
        return whole[len(earlier):]
    # a template that rewrites earlier turns once later ones come (Qwen3 drops old reasoning): the new messages
    # rendered after a stand-in for the turns the prefix holds
    last = prompt.messages[k - 1]
    stand_in = [{"role": "user", "content": "x"}, last] if last["role"] == "assistant" else [last]
    head = template_text(tokenizer, stand_in, prompt, generation=False)
    tail = template_text(tokenizer, stand_in + prompt.messages[k:], prompt, gen, cont)
    return tail[len(head):] if tail.startswith(head) else tail
