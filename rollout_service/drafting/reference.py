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
