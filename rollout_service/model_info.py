"""What the front end knows about the served model: its tokenizer, vocabulary and context length."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rollout_tasks.chat import chat_token_ids, user_turn


@dataclass(frozen=True)
class MoeShape:
    """A mixture-of-experts policy's routing shape, as vLLM's routed-experts rows have it: [tokens, layers, top_k],
    every decoder layer counted (a layer without a router holds zeros)."""
    num_experts: int
    top_k: int
    num_layers: int

    @property
    def dtype(self) -> str:
        return "uint8" if self.num_experts <= 256 else "uint16"

    @classmethod
    def of(cls, config: dict) -> "MoeShape | None":
        """From a Hugging Face config.json (Qwen3-MoE, Mixtral, DeepSeek-V3 spellings); None for a dense model."""
        text = config.get("text_config") or config
        experts = next((int(text[k]) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                        if text.get(k)), 0)
        top_k = int(text.get("num_experts_per_tok") or 0)
        if experts <= 1 or top_k <= 0:
            return None
        return cls(experts, top_k, int(text["num_hidden_layers"]))


def head_size_of(config: dict) -> int | None:
    """A Hugging Face config's attention head size: head_dim, else hidden_size / num_attention_heads."""
    text = config.get("text_config") or config
    if text.get("head_dim"):
        return int(text["head_dim"])
    if text.get("hidden_size") and text.get("num_attention_heads"):
        return int(text["hidden_size"]) // int(text["num_attention_heads"])
    return None


@dataclass
class ModelInfo:
    path: str
    vocab_size: int
    max_model_len: int
    tokenizer: object          # a transformers tokenizer
    moe: MoeShape | None = None
    head_size: int | None = None     # attention head size (None: not stated by its config)

    @classmethod
    def load(cls, path: str, max_model_len: int) -> "ModelInfo":
        from transformers import AutoTokenizer

        config = json.loads((Path(path) / "config.json").read_text())
        ctx = min(max_model_len, int(config.get("max_position_embeddings", max_model_len)))
        return cls(path=path, vocab_size=int(config["vocab_size"]), max_model_len=ctx,
                   tokenizer=AutoTokenizer.from_pretrained(path), moe=MoeShape.of(config),
                   head_size=head_size_of(config))

    def decode(self, ids: list[int]) -> str:
        """A sample's text, as vLLM's detokenizer gives it (blocking: call in the tokenizer thread)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def encode(self, text: str, chat: bool) -> list[int]:
        if chat:
            return chat_token_ids(self.tokenizer, user_turn(text))
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
