"""What a transformer reads and computes per step, from its Hugging Face config.json.

Counted: the attention projections (q, k, v, o; DeepSeek's multi-head latent attention, MLA, by its low-rank
factors), the MLP (gate, up, down) or a mixture of experts (every expert's weights exist; a token uses
num_experts_per_tok of them, plus any shared experts; a router per MoE layer), the embedding and the LM head, and
attention over the KV cache. Norms, biases and rotary tables are left out (well under 1%).
MoE fields read: num_experts / num_local_experts / n_routed_experts, num_experts_per_tok, moe_intermediate_size,
shared experts (n_shared_experts x moe_intermediate_size, or shared_expert_intermediate_size), and which layers are
dense: first_k_dense_replace (DeepSeek), decoder_sparse_step and mlp_only_layers (Qwen-MoE). The MoE arithmetic of a
step (experts read, expert parallelism, all-to-all) is moe.py's.
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
    dense_layers: int = 0        # MoE models: layers whose MLP is dense (intermediate wide), not experts
    shared_intermediate: int = 0  # MoE layers: the always-active shared experts' total intermediate width
    # multi-head latent attention (DeepSeek-V2/V3; 0: ordinary attention): q through a rank-q_lora factor, K and V
    # from one cached latent of kv_lora + qk_rope values per token and layer (the absorbed form engines decode with)
    q_lora: int = 0
    kv_lora: int = 0
    qk_rope: int = 0
    qk_nope: int = 0
    v_head_dim: int = 0

    # ---- parameters -----------------------------------------------------------------------------------------
    def attn_params(self) -> int:
        if self.kv_lora:
            qk = self.qk_nope + self.qk_rope
            q = (self.hidden * self.q_lora + self.q_lora * self.heads * qk) if self.q_lora \
                else self.hidden * self.heads * qk
            kv = (self.hidden * (self.kv_lora + self.qk_rope)
                  + self.kv_lora * self.heads * (self.qk_nope + self.v_head_dim))
            return q + kv + self.heads * self.v_head_dim * self.hidden
        q_in = 2 * self.hidden if self.eagle3 else self.hidden       # EAGLE-3: [embedding, hidden] enter q/k/v
        return (q_in * (self.heads + 2 * self.kv_heads) * self.head_dim) + self.heads * self.head_dim * self.hidden

    def expert_params(self) -> int:
        return 3 * self.hidden * self.expert_intermediate

    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.experts else 0

    def moe_fixed_params(self) -> int:
        """Of one MoE layer, what every token uses: the router and the shared experts."""
        return self.hidden * self.experts + 3 * self.hidden * self.shared_intermediate

    def mlp_params(self) -> int:
        """All MLP weights of one layer (every expert of a MoE layer, and its router; of a dense layer its MLP)."""
        if self.experts:
            return self.experts * self.expert_params() + self.moe_fixed_params()
        return 3 * self.hidden * self.intermediate

    def active_mlp_params(self) -> int:
        if self.experts:
            return self.experts_per_tok * self.expert_params() + self.moe_fixed_params()
        return self.mlp_params()

    def head_params(self) -> int:
        """LM head (+ EAGLE-3's fc from three hidden states to one)."""
        fc = 3 * self.hidden * self.hidden if self.eagle3 else 0
        return (self.lm_vocab or self.vocab) * self.hidden + fc

    def dense_mlp_params(self) -> int:
        """The dense MLPs of an MoE model's dense layers, all layers together."""
        return self.dense_layers * 3 * self.hidden * self.intermediate if self.experts else 0

    def params(self) -> int:
        embed = 0 if self.eagle3 or self.tied else self.vocab * self.hidden   # EAGLE-3 shares the target's
        mlp = (self.moe_layers() * self.mlp_params() + self.dense_mlp_params()) if self.experts \
            else self.layers * self.mlp_params()
        return self.layers * self.attn_params() + mlp + self.head_params() + embed

    def always_read_params(self) -> int:
        """Weights a step reads whatever the routing: attention, dense MLPs, routers, shared experts, LM head."""
        mlp = (self.moe_layers() * self.moe_fixed_params() + self.dense_mlp_params()) if self.experts \
            else self.layers * self.mlp_params()
        return self.layers * self.attn_params() + mlp + self.head_params()

    def active_params(self) -> int:
        """Weights one token multiplies through (the embedding lookup is a gather, not a matmul)."""
        return self.always_read_params() + self.moe_layers() * self.experts_per_tok * self.expert_params()

    def card_active_params(self) -> int:
        """Active parameters as model cards count them (the embedding included): Qwen3-30B-A3B's "3.3B"."""
        return self.active_params() + (0 if self.eagle3 or self.tied else self.vocab * self.hidden)

    def total_expert_params(self) -> int:
        return self.moe_layers() * self.experts * self.expert_params()

    # ---- per step -------------------------------------------------------------------------------------------
    def weight_bytes_read(self, tokens: int, bytes_per_param: float) -> float:
        """Weights read by one forward over `tokens` tokens: all dense weights once; of a MoE layer, the
        experts some token routed to (expected count with uniform routing: E (1 - (1 - top_k / E)^tokens))."""
        from rollout_service.perfmodel.moe import distinct_experts

        touched = distinct_experts(self.experts, self.experts_per_tok, max(1, tokens)) if self.experts else 0.0
        return (self.always_read_params() + self.moe_layers() * touched * self.expert_params()) * bytes_per_param

    def kv_bytes_per_token(self, bytes_per_value: float = 2.0) -> float:
        if self.kv_lora:                       # MLA caches one latent (+ the rotary key) per token and layer
            return self.layers * (self.kv_lora + self.qk_rope) * bytes_per_value
        return 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_value

    def kv_shards(self, tp: int) -> int:
        """How many ways tensor parallelism splits the KV cache: by KV heads; MLA's latent is replicated."""
        return 1 if self.kv_lora else tp

    def attn_flops_per_key(self) -> float:
        """QK^T plus AV per query token, layer and cached key (2 FLOPs per multiply-add): MHA/GQA 4 x heads x
        head_dim; MLA in its absorbed form scores the latent and rotary key and sums over the latent."""
        if self.kv_lora:
            return 2 * self.heads * (self.kv_lora + self.qk_rope) + 2 * self.heads * self.kv_lora
        return 4 * self.heads * self.head_dim

    def flops(self, tokens: int, context: float) -> float:
        """Forward FLOPs for `tokens` query tokens attending to `context` keys each: 2 per weight per token,
        and QK^T plus AV (attn_flops_per_key per key) per layer."""
        attn = self.layers * self.attn_flops_per_key() * context
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


def _dense_layers(c: dict, layers: int, experts: int) -> int:
    """Layers with a dense MLP in an MoE model: DeepSeek's first_k_dense_replace (and moe_layer_freq), Qwen-MoE's
    mlp_only_layers and decoder_sparse_step (layer i is sparse where (i + 1) % step == 0)."""
    if not experts:
        return 0
    if c.get("first_k_dense_replace") is not None:
        k, freq = int(c["first_k_dense_replace"]), int(c.get("moe_layer_freq") or 1)
        return sum(1 for i in range(layers) if not (i >= k and i % freq == 0))
    only, step = set(c.get("mlp_only_layers") or []), int(c.get("decoder_sparse_step") or 1)
    return sum(1 for i in range(layers) if i in only or (i + 1) % step != 0)


def from_config(c: dict, name: str = "model") -> Transformer:
    c = {**c, **c.get("text_config", {})}
    heads = c["num_attention_heads"]
    eagle3 = "draft_vocab_size" in c or "Eagle3" in "".join(c.get("architectures", []))
    experts = c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts") or 0
    expert_inter = c.get("moe_intermediate_size") or c.get("intermediate_size", 0)
    shared = (c.get("n_shared_experts") or 0) * expert_inter or c.get("shared_expert_intermediate_size") or 0
    kv_lora = c.get("kv_lora_rank") or 0
    return Transformer(
        name=name, layers=c["num_hidden_layers"], hidden=c["hidden_size"], heads=heads,
        kv_heads=(heads if kv_lora else c.get("num_key_value_heads") or heads),
        head_dim=c.get("head_dim") or (c.get("v_head_dim") if kv_lora else None) or c["hidden_size"] // heads,
        intermediate=c.get("intermediate_size", 0), vocab=c["vocab_size"],
        experts=experts, experts_per_tok=c.get("num_experts_per_tok", 0) if experts else 0,
        expert_intermediate=expert_inter if experts else 0,
        lm_vocab=c.get("draft_vocab_size") or 0, eagle3=eagle3, tied=bool(c.get("tie_word_embeddings")),
        dense_layers=_dense_layers(c, c["num_hidden_layers"], experts), shared_intermediate=shared if experts else 0,
        q_lora=c.get("q_lora_rank") or 0, kv_lora=kv_lora, qk_rope=c.get("qk_rope_head_dim") or 0 if kv_lora else 0,
        qk_nope=c.get("qk_nope_head_dim") or 0 if kv_lora else 0, v_head_dim=c.get("v_head_dim") or 0 if kv_lora else 0)
