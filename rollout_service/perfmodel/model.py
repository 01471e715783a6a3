"""What a transformer reads and computes per step, from its Hugging Face config.json.

Counted: the attention projections (q, k, v, o), the MLP (gate, up, down) or a mixture of experts (every
expert's weights exist; a token uses num_experts_per_tok of them), the embedding and the LM head, and
attention over the KV cache. Norms, biases and rotary tables are left out (well under 1%).
An EAGLE-3 head (one decoder layer fed [embedding, fc(3 hidden states)], an LM head over draft_vocab_size)
is recognised by `draft_vocab_size` / `target_hidden_size` in its config.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CONFIGS = Path(__file__).parent / "configs"


@dataclass(frozen=True)
class Transformer:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    experts: int = 0             # 0: dense MLP
    experts_per_tok: int = 0
    expert_intermediate: int = 0
    lm_vocab: int = 0            # the LM head's rows (an EAGLE-3 head's draft vocabulary); 0: vocab
    eagle3: bool = False
    tied: bool = False           # LM head and embedding are one matrix

    # ---- parameters -----------------------------------------------------------------------------------------
    def attn_params(self) -> int:
        q_in = 2 * self.hidden if self.eagle3 else self.hidden       # EAGLE-3: [embedding, hidden] enter q/k/v
        return (q_in * (self.heads + 2 * self.kv_heads) * self.head_dim) + self.heads * self.head_dim * self.hidden

    def expert_params(self) -> int:
        return 3 * self.hidden * self.expert_intermediate

    def mlp_params(self) -> int:
        """All MLP weights of one layer (every expert of a MoE layer, and its router)."""
        if self.experts:
            return self.experts * self.expert_params() + self.hidden * self.experts
        return 3 * self.hidden * self.intermediate

    def active_mlp_params(self) -> int:
        if self.experts:
            return self.experts_per_tok * self.expert_params() + self.hidden * self.experts
        return self.mlp_params()

    def head_params(self) -> int:
        """LM head (+ EAGLE-3's fc from three hidden states to one)."""
        fc = 3 * self.hidden * self.hidden if self.eagle3 else 0
        return (self.lm_vocab or self.vocab) * self.hidden + fc

    def params(self) -> int:
        embed = 0 if self.eagle3 or self.tied else self.vocab * self.hidden   # EAGLE-3 shares the target's
        return self.layers * (self.attn_params() + self.mlp_params()) + self.head_params() + embed

    def active_params(self) -> int:
        """Weights one token multiplies through (the embedding lookup is a gather, not a matmul)."""
        return self.layers * (self.attn_params() + self.active_mlp_params()) + self.head_params()

    # ---- per step -------------------------------------------------------------------------------------------
    def weight_bytes_read(self, tokens: int, bytes_per_param: float) -> float:
        """Weights read by one forward over `tokens` tokens: all dense weights once; of a MoE layer, the
        experts some token routed to (expected count with uniform routing: E (1 - (1 - top_k / E)^tokens))."""
        dense = self.layers * self.attn_params() + self.head_params()
        if self.experts:
            touched = self.experts * (1 - (1 - self.experts_per_tok / self.experts) ** max(1, tokens))
            mlp = self.layers * (touched * self.expert_params() + self.hidden * self.experts)
        else:
            mlp = self.layers * self.mlp_params()
        return (dense + mlp) * bytes_per_param

    def kv_bytes_per_token(self, bytes_per_value: float = 2.0) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_value

    def flops(self, tokens: int, context: float) -> float:
        """Forward FLOPs for `tokens` query tokens attending to `context` keys each: 2 per weight per token,
        and QK^T plus AV (2 x 2 x heads x head_dim per key) per layer."""
        attn = 4 * self.layers * self.heads * self.head_dim * context
        return tokens * (2 * self.active_params() + attn)


def load(path_or_name: str | Path) -> Transformer:
    """A config.json path, a directory holding one, or a shipped name (configs/<name>.json)."""
    p = Path(path_or_name)
    if not p.exists() and (CONFIGS / f"{path_or_name}.json").exists():
        p = CONFIGS / f"{path_or_name}.json"
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        shipped = ", ".join(sorted(x.stem for x in CONFIGS.glob("*.json")))
        raise SystemExit(f"{path_or_name}: no config.json there (shipped: {shipped})")
    return from_config(json.loads(p.read_text()), name=p.parent.name if p.name == "config.json" else p.stem)


def from_config(c: dict, name: str = "model") -> Transformer:
    c = {**c, **c.get("text_config", {})}
    heads = c["num_attention_heads"]
    eagle3 = "draft_vocab_size" in c or "Eagle3" in "".join(c.get("architectures", []))
    return Transformer(
        name=name, layers=c["num_hidden_layers"], hidden=c["hidden_size"], heads=heads,
        kv_heads=c.get("num_key_value_heads") or heads, head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        intermediate=c.get("intermediate_size", 0), vocab=c["vocab_size"],
        experts=c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts") or 0,
        experts_per_tok=c.get("num_experts_per_tok", 0),
        expert_intermediate=c.get("moe_intermediate_size") or c.get("intermediate_size", 0),
        lm_vocab=c.get("draft_vocab_size") or 0, eagle3=eagle3, tied=bool(c.get("tie_word_embeddings")))
