"""Models for tests and benchmarks, built in seconds without a hub: a tiny random Llama with SmolLM2's
tokenizer, and noisy copies of a model (drafters of known quality)."""
from __future__ import annotations

from pathlib import Path

from rollout_service.models import find_gguf, save_atomically


def _tokenizer(tokenizer_from: Path | None):
    """SmolLM2's tokenizer: from `tokenizer_from` (a model dir), else from the packaged GGUF."""
    from transformers import AutoTokenizer

    if tokenizer_from is not None:
        return AutoTokenizer.from_pretrained(tokenizer_from)
    gguf = find_gguf()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def build_tiny_model(out: Path, *, layers: int = 2, hidden: int = 128, seed: int = 0,
                     tokenizer_from: Path | None = None, tied: bool = False) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer (vocab 49152), float32, built in seconds.

    The tokenizer comes from `tokenizer_from` (a model dir) or from the packaged GGUF.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rollout_service.chat.template import TEMPLATE

    tok = _tokenizer(tokenizer_from)
    tok.chat_template = TEMPLATE            # the service's tool-aware ChatML (chat/template.py)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        # head_dim 64: vLLM's CPU attention needs >= 32
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=tied,
        torch_dtype="float32", rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # logits with std ~4: next-token entropy ~3.7 nats, top token ~0.37, like an LM
        model.model.embed_tokens.weight.normal_(0, 1.0)
        if not tied:
            model.lm_head.weight.normal_(0, 4.0 / hidden ** 0.5)
    save_atomically(model, tok, out)
    return out


def perturbed_copy(src: Path, out: Path, *, scale: float, seed: int = 0) -> Path:
    """A copy of the model at `src` with Gaussian noise (scale x each tensor's std) added: a drafter of
    known quality for tests (scale 0 gives an identical drafter)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if scale:
                p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    save_atomically(model, AutoTokenizer.from_pretrained(src), out)
    return out


def build_tiny_moe_model(out: Path, *, layers: int = 2, hidden: int = 128, experts: int = 8, top_k: int = 2,
                         seed: int = 0, tokenizer_from: Path | None = None) -> Path:
    """A tiny random Qwen3-MoE (mixture of experts: `experts` per layer, `top_k` routed per token) with SmolLM2's
    tokenizer, float32, built in seconds. Router weights are scaled up so that routing is decisive (top-k margins
    well above float noise: an independent forward pass routes every token the same way)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = _tokenizer(tokenizer_from)
    config = Qwen3MoeConfig(
        vocab_size=49152, hidden_size=hidden, intermediate_size=hidden * 2, moe_intermediate_size=hidden,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=2048, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, tie_word_embeddings=False, torch_dtype="float32", rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 1.0)
        model.lm_head.weight.normal_(0, 4.0 / hidden ** 0.5)
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 1.0 / hidden ** 0.5)
    save_atomically(model, tok, out)
    return out
