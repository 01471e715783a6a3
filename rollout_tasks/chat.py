"""Chat-templated token ids: the one place that applies a tokenizer's chat template for the service, the drafter
preparation and the bundled trainer (all three must encode a chat prompt identically)."""
from __future__ import annotations


def chat_token_ids(tokenizer, messages: list[dict], **template_kwargs) -> list[int]:
    """The ids of `messages` under the tokenizer's chat template, ready for the assistant's reply. Tokenizers return
    a list or a BatchEncoding (transformers 5): both give a plain list here."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **template_kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def user_turn(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]
