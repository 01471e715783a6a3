"""An independent forward pass with transformers: the log-probs the service must reproduce (used by the
losslessness check and the tests)."""
from __future__ import annotations

import torch


def processed_logprob_rows(model, prompt: list[int], generated: list[int], temperature: float, top_k: int,
                           top_p: float) -> torch.Tensor:
    """log p(. | prompt, generated[:t]) over the whole vocabulary at every generated position, under the
    distribution after temperature, top-k, top-p (-inf where they rule a token out). Returns float64
    [len(generated), vocab]."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].double()          # [gen_len, vocab]
    if temperature > 0:
        logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum <= 1 - top_p
        drop_sorted[:, -1] = False                                           # keep at least one token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def processed_logprobs(model, prompt: list[int], generated: list[int], temperature: float, top_k: int,
                       top_p: float) -> torch.Tensor:
    """log p(generated[t] | prompt, generated[:t]) under the distribution after temperature, top-k, top-p.

    Returns float64 [len(generated)].
    """
    logp = processed_logprob_rows(model, prompt, generated, temperature, top_k, top_p)
    return logp.gather(-1, torch.tensor(generated).unsqueeze(-1)).squeeze(-1)


def routed_experts(model, token_ids: list[int]):
    """The experts a transformers mixture-of-experts model routes each token of `token_ids` to, at every decoder
    layer (zeros where a layer has no router), in one forward pass: the routes the service must return. Returns
    int64 numpy [len(token_ids), layers, top_k], each row's experts in the router's order (highest weight first)."""
    import numpy as np

    layers = model.model.layers
    found: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(layers):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None and hasattr(gate, "top_k"):
            hooks.append(gate.register_forward_hook(lambda _m, _in, out, i=i: found.__setitem__(i, out[2])))
    try:
        with torch.no_grad():
            model(torch.tensor([token_ids]))
    finally:
        for h in hooks:
            h.remove()
    if not found:
        raise ValueError("the model has no router (not a mixture of experts)")
    k = next(iter(found.values())).shape[-1]
    out = np.zeros((len(token_ids), len(layers), k), dtype=np.int64)
    for i, ids in found.items():
        out[:, i] = ids.reshape(len(token_ids), k).numpy()
    return out
