"""A mixture-of-experts policy without a hub: SmolLM2-135M-Instruct sparsely upcycled into a Mixtral.

Sparse upcycling (Komatsuzaki et al. 2022): every layer's dense MLP becomes `experts` copies of itself (the
experts of a Mixtral block), each with a little Gaussian noise so that the experts differ and routing matters,
behind a fresh router with small random weights that picks `top_k` of them per token. Attention, embeddings and
norms are SmolLM2's own. A token's MoE output is a convex mix of near-copies of the dense MLP, so the model
behaves like SmolLM2 (tests/unit/test_moe_model.py bounds the per-token log-prob gap), while the experts it routes
to change its log-probs measurably: what routing replay (issue 42) needs from a policy.

vLLM serves it as MixtralForCausalLM. transformers 5 holds each layer's experts as fused 3D tensors
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) but `save_pretrained` writes the
checkpoint format vLLM loads (`block_sparse_moe.experts.{e}.w1/w2/w3.weight`, `block_sparse_moe.gate.weight`).
"""
from __future__ import annotations

import logging
from pathlib import Path

from rollout_service.models import cache_dir, is_model_dir, prepare_default_model, save_atomically

log = logging.getLogger(__name__)

MOE_MODEL_NAME = "moe"             # the --model name of serve, demo and rollout-grpo
NOISE = 0.02                       # expert noise: this fraction of each dense MLP tensor's std
ROUTER_STD = 0.02                  # router weights ~ N(0, ROUTER_STD^2): logits of std ~0.5 on SmolLM2's states


def moe_model_dir(experts: int = 4, top_k: int = 2) -> Path:
    return cache_dir() / "models" / f"SmolLM2-135M-Instruct-upcycled-{experts}x-top{top_k}"


def upcycle(dense, *, experts: int = 4, top_k: int = 2, noise: float = NOISE, router_std: float = ROUTER_STD,
            seed: int = 0):
    """A MixtralForCausalLM (float32) from a dense Llama-architecture model: same attention, embeddings and norms,
    each layer's MLP copied into `experts` experts (+ noise x each tensor's std), a fresh N(0, router_std^2) router."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in 1..experts, got top_k={top_k}, experts={experts}")
    d = dense.config
    config = MixtralConfig(
        vocab_size=d.vocab_size, hidden_size=d.hidden_size, intermediate_size=d.intermediate_size,
        num_hidden_layers=d.num_hidden_layers, num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads, head_dim=d.head_dim, hidden_act=d.hidden_act,
        max_position_embeddings=d.max_position_embeddings, rms_norm_eps=d.rms_norm_eps,
        rope_parameters=dict(d.rope_parameters), tie_word_embeddings=d.tie_word_embeddings,
        bos_token_id=d.bos_token_id, eos_token_id=d.eos_token_id, pad_token_id=d.pad_token_id,
        num_local_experts=experts, num_experts_per_tok=top_k, sliding_window=None, router_jitter_noise=0.0,
        output_router_logits=False, attention_dropout=0.0)
    moe = MixtralForCausalLM(config).to(torch.float32)      # every tensor but the rotary buffers is overwritten
    src = {k: v.float() for k, v in dense.state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name in moe.state_dict():
        if ".mlp." not in name:
            state[name] = src[name]
            continue
        prefix = name.split(".mlp.")[0]
        gate, up, down = (src[f"{prefix}.mlp.{p}_proj.weight"] for p in ("gate", "up", "down"))
        if name.endswith("mlp.gate.weight"):
            state[name] = torch.randn((experts, d.hidden_size), generator=g) * router_std
        elif name.endswith("experts.gate_up_proj"):           # [E, 2I, H]: gate rows first, then up (chunk(2))
            w = torch.cat([gate, up])
            state[name] = w + torch.randn((experts, *w.shape), generator=g) * (noise * w.std())
        elif name.endswith("experts.down_proj"):              # [E, H, I]
            state[name] = down + torch.randn((experts, *down.shape), generator=g) * (noise * down.std())
        else:
            raise KeyError(f"unexpected MoE tensor {name}")
    missing, unexpected = moe.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]:
        raise RuntimeError(f"upcycling left tensors unset: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        moe.tie_weights()
    moe.generation_config = dense.generation_config
    return moe.eval()


def prepare_moe_model(force: bool = False, experts: int = 4, top_k: int = 2) -> Path:
    """The upcycled SmolLM2 (bfloat16 on disk, as the dense default; cached). 17 s on 2 cores once SmolLM2 is
    prepared; 4 experts x 30 layers: 362 M parameters (0.72 GB in bfloat16, 1.45 GB served in float32)."""
    out = moe_model_dir(experts, top_k)
    if is_model_dir(out) and not force:
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = prepare_default_model()
    log.info("upcycling %s into %d experts (top-%d) per layer: %s", base.name, experts, top_k, out)
    dense = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    moe = upcycle(dense, experts=experts, top_k=top_k).to(torch.bfloat16)
    moe.config.torch_dtype = torch.bfloat16
    save_atomically(moe, AutoTokenizer.from_pretrained(base), out)
    return out
