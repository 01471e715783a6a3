"""Routing replay (R3, arXiv 2510.11370): the trainer's forward pass sends every token to the experts the rollout
engine routed it to, so that a mixture-of-experts policy's log-probs in training are those of the function that
sampled. Without it, rounding differences between the engine and the trainer flip near-tied router decisions and
the trainer computes log-probs (and gradients) of another network than the one that generated the tokens.

The service returns, per sample, the experts of every token at every decoder layer (Sample.routed_experts: ids
[rows, layers, top_k], row t = the token at position t of prompt + generated tokens). Here each MoE layer's router
(transformers' MixtralTopKRouter / Qwen3MoeTopKRouter: forward(hidden [tokens, H]) -> (router_logits, router_scores,
router_indices)) is wrapped for one forward pass: on rows with a route it returns those experts, weighted by its own
logits at them (softmax over the experts, gathered, renormalised over the top-k where the router does), so the
router still learns through the weights; on other rows (padding, a sample's last token) it chooses as usual.

    with replay(model, routes, routed):      # routes int64 [B, L, layers, top_k], routed bool [B, L]
        logits = model(input_ids=..., attention_mask=...).logits
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch


def moe_routers(model) -> dict[int, torch.nn.Module]:
    """Decoder layer index -> its router, for the layers that have one (empty for a dense model)."""
    body = getattr(model, "model", model)
    out = {}
    for i, layer in enumerate(getattr(body, "layers", [])):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None and hasattr(gate, "top_k") and hasattr(gate, "num_experts") and hasattr(gate, "weight"):
            out[i] = gate
    return out


def is_moe(model) -> bool:
    return bool(moe_routers(model))


@dataclass
class RouteStats:
    """Router decisions of forwards run under `replay`, on rows that carry a route: how many (token, layer) pairs
    the trainer's own router would have sent to another set of experts than the engine did."""
    decisions: int = 0
    differing: int = 0

    @property
    def differing_fraction(self) -> float | None:
        return self.differing / self.decisions if self.decisions else None


def _weights(router, logits: torch.Tensor, idx: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The router's own weights for experts `idx` [T, k] from its logits [T, E], computed as it computes them for its
    top-k (softmax over all experts in float32, gathered, renormalised unless the router says not to)."""
    probs = torch.softmax(logits.float(), dim=-1)
    top = probs.gather(-1, idx)
    if getattr(router, "norm_topk_prob", True):            # Mixtral always renormalises; Qwen3-MoE by config
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(like.dtype)


@contextmanager
def replay(model, routes: torch.Tensor | None, routed: torch.Tensor | None, stats: RouteStats | None = None,
           force: bool = True):
    """Within the block, every MoE router of `model` follows `routes` on the rows where `routed` is True.

    routes: int64 [B, L, layers, top_k], layers = every decoder layer (a layer without a router is ignored);
    routed: bool [B, L], the rows that have a route. The model must be called on input of shape [B, L].
    force=False: the routers choose freely and only `stats` is kept (their decisions against the routes).
    routes None: nothing is changed."""
    routers = moe_routers(model)
    if routes is None or not routers:
        yield
        return
    b, length, layers, k = routes.shape
    if layers <= max(routers):
        raise ValueError(f"routes cover {layers} layers; the model routes at layer {max(routers)}")
    flat_mask = routed.reshape(b * length)                                    # [T]
    for i, router in routers.items():
        if router.top_k != k:
            raise ValueError(f"routes carry top-{k}; layer {i}'s router picks {router.top_k}")
        chosen = routes[:, :, i].reshape(b * length, k)
        if bool((chosen[flat_mask] >= router.num_experts).any()):
            raise ValueError(f"a route names expert >= {router.num_experts} at layer {i}")
        router.forward = _forced_forward(router, chosen, flat_mask, stats, force)
    try:
        yield
    finally:
        for router in routers.values():
            del router.forward                                                # back to the class's forward


def _forced_forward(router, chosen: torch.Tensor, mask: torch.Tensor, stats: RouteStats | None, force: bool):
    """router.forward for one pass: chosen int64 [T, k] experts, mask bool [T] rows that follow them."""
    original = type(router).forward

    def forward(hidden_states):
        logits, scores, idx = original(router, hidden_states)                # [T, E], [T, k], [T, k]
        if logits.shape[0] != mask.shape[0]:
            raise ValueError(f"routing replay: the router saw {logits.shape[0]} tokens, the routes cover "
                             f"{mask.shape[0]} (call the model on exactly the [B, L] the routes were packed for)")
        want = chosen.to(idx.device, idx.dtype)
        m = mask.to(idx.device)
        if stats is not None:
            with torch.no_grad():
                same = (idx.sort(-1).values == want.sort(-1).values).all(-1)
                stats.decisions += int(m.sum())
                stats.differing += int((~same & m).sum())
        if not force:
            return logits, scores, idx
        idx = torch.where(m[:, None], want, idx)
        scores = torch.where(m[:, None], _weights(router, logits, idx, scores), scores)
        return logits, scores, idx

    return forward


def pack_routes(route_ids: list[np.ndarray | None], first_rows: list[int], lengths: list[int], width: int,
                layers: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample routes (uint8/uint16 [rows, layers, top_k], starting at row first_rows[i]) into right-padded
    (routes int64 [B, width, layers, top_k], routed bool [B, width]); rows past a sample's length - 1 (its last token,
    never a forward input of a log-prob that matters, and padding) and samples without routes stay unrouted."""
    b = len(route_ids)
    routes = torch.zeros(b, width, layers, top_k, dtype=torch.long)
    routed = torch.zeros(b, width, dtype=torch.bool)
    for i, (ids, first, n) in enumerate(zip(route_ids, first_rows, lengths)):
        if ids is None or len(ids) == 0:
            continue
        if ids.shape[1:] != (layers, top_k):
            raise ValueError(f"sample {i}: routes of shape {list(ids.shape)}, expected [rows, {layers}, {top_k}]")
        end = min(first + len(ids), n - 1, width)
        if end <= first:
            continue
        routes[i, first:end] = torch.from_numpy(np.asarray(ids[:end - first], dtype=np.int64))
        routed[i, first:end] = True
    return routes, routed


def mismatch(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(mean |log p_trainer - log p_rollout|, KL(rollout || trainer) by the k3 estimator) over the masked tokens.
    k3 (Schulman 2020): with r = p_trainer / p_rollout on tokens sampled from the rollout policy, mean(r - 1 - log r),
    unbiased and never negative. Inputs [B, T]; mask bool [B, T]."""
    d = (trainer_logp.float() - rollout_logp.float())[mask]
    if d.numel() == 0:
        return float("nan"), float("nan")
    return float(d.abs().mean()), float((torch.expm1(d) - d).mean())
