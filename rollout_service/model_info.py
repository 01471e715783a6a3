"""What the front end knows about the served model: its tokenizer, vocabulary and context length."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rollout_tasks.chat import chat_token_ids, user_turn


@dataclass
class ModelInfo:
    path: str
    vocab_size: int
    max_model_len: int
    tokenizer: object          # a transformers tokenizer

    @classmethod
    def load(cls, path: str, max_model_len: int) -> "ModelInfo":
        from transformers import AutoTokenizer

        config = json.loads((Path(path) / "config.json").read_text())
        ctx = min(max_model_len, int(config.get("max_position_embeddings", max_model_len)))
        return cls(path=path, vocab_size=int(config["vocab_size"]), max_model_len=ctx,
                   tokenizer=AutoTokenizer.from_pretrained(path))

    def decode(self, ids: list[int]) -> str:
        """A sample's text, as vLLM's detokenizer gives it (blocking: call in the tokenizer thread)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def encode(self, text: str, chat: bool) -> list[int]:
        if chat:
            return chat_token_ids(self.tokenizer, user_turn(text))
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
