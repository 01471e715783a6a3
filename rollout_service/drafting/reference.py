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


def int16_pair_saturation() -> bool:
    """Whether this CPU's oneDNN int8 GEMM sums pairs of products in saturating int16: x86 without VNNI or AMX, where
    the GEMM uses vpmaddubsw (u8 x s8 -> the sum of two adjacent products, saturated to int16; the s8 activations are
    shifted to u8 by +128 and the shift compensated after). Measured on this AVX2 CPU: vLLM's W8A8 layer outputs
    equal that arithmetic exactly, and differ from exact integer products by up to 15% in single outputs."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        flags = set(open("/proc/cpuinfo").read().split())
    except OSError:
        return False
    return not flags & {"avx512_vnni", "avx_vnni", "amx_int8"}


class _Int8Linear(torch.nn.Module):
    """An nn.Linear as compressed-tensors W8A8 int8 computes it, written out independently of vLLM's kernels: the
    weight quantized per output channel (engine/quantize.py's quantize_int8: the served scales), each input row
    quantized to int8 with its own scale (absmax / 127, rounded half to even), the integer products summed (exactly,
    or with `saturate` as a CPU without VNNI sums them: int16_pair_saturation), then both scales applied.

    `rounding`: a torch.Generator: each input element is first multiplied by 1 or by 1 - 2^-24 (float32; drawn from
    it), which moves it by at most one float32 ulp, a rounding any other implementation of the float ops around the
    layer (norms, rope, attention) may give as well. An activation that lies that close to an int8 rounding boundary
    rounds the other way, and the layer's output moves by a whole quantization step (int8_rounding_spread)."""

    def __init__(self, linear: torch.nn.Linear, saturate: bool, rounding: torch.Generator | None = None):
        from rollout_service.engine.quantize import INT8_MAX, quantize_int8

        super().__init__()
        q, scale = quantize_int8(linear.weight)
        self.w = q.to(torch.int64)                                   # [out, in]
        self.w_scale, self.max, self.saturate, self.rounding = scale.t().double(), INT8_MAX, saturate, rounding
        self.bias = None if linear.bias is None else linear.bias.detach().double()
        w = self.w if self.w.shape[1] % 2 == 0 else torch.nn.functional.pad(self.w, (0, 1))
        w0, w1 = w[:, 0::2], w[:, 1::2]                              # [out, in / 2] each
        self.pair_out, self.pair_j = torch.nonzero(w0.abs() + w1.abs() >= 129, as_tuple=True)   # pairs that can clip
        self.pair_w0, self.pair_w1 = w0[self.pair_out, self.pair_j], w1[self.pair_out, self.pair_j]

    def _int_product(self, xq: torch.Tensor) -> torch.Tensor:
        """xq: int64 [rows, in] -> int64 [rows, out]: sum over `in` of xq * w (with `saturate`: as vpmaddubsw sums).

        Saturating, the sum is the exact one plus, for each adjacent pair of products u * w (u = xq + 128 in
        [1, 255]) whose sum leaves int16, the amount the clip removes. |u0 w0 + u1 w1| <= 255 (|w0| + |w1|), so only
        weight pairs with |w0| + |w1| >= 129 can clip (few: one scale per row puts most weights far below 127):
        those are computed for every row; the rest is one exact matmul (float64: every partial sum below 2^53)."""
        exact = torch.round(xq.double() @ self.w.t().double()).to(torch.int64)
        if not self.saturate or self.pair_out.numel() == 0:
            return exact
        u = xq + 128                                                 # u8
        if u.shape[1] % 2:
            u = torch.nn.functional.pad(u, (0, 1))
        pairs = u[:, 2 * self.pair_j] * self.pair_w0 + u[:, 2 * self.pair_j + 1] * self.pair_w1   # [rows, pairs]
        return exact.index_add_(1, self.pair_out, pairs.clamp(-32768, 32767) - pairs)

    def _int_product_every_pair(self, xq: torch.Tensor) -> torch.Tensor:
        """_int_product written out pair by pair (slow: rows x out x in products), kept to test the fast one."""
        if not self.saturate:
            return xq @ self.w.t()
        w = self.w if self.w.shape[1] % 2 == 0 else torch.nn.functional.pad(self.w, (0, 1))
        u = xq + 128                                                 # u8
        if u.shape[1] % 2:
            u = torch.nn.functional.pad(u, (0, 1))
        out = []
        for rows in u.split(8):                                      # a few rows at a time (memory)
            prod = rows[:, None, :] * w[None]                        # [rows, out, in]
            pairs = (prod[..., 0::2] + prod[..., 1::2]).clamp(-32768, 32767)
            out.append(pairs.sum(-1) - 128 * self.w.sum(-1))
        return torch.cat(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1]).to(torch.float32)
        if self.rounding is not None:
            sign = torch.randint(0, 2, x.shape, generator=self.rounding).to(torch.float32) * 2 - 1
            x = x * (1 + sign * 2.0 ** -24)
        amax = x.abs().amax(dim=-1, keepdim=True)
        xq = torch.round(x * (self.max / amax.clamp_min(torch.finfo(torch.float32).tiny))).clamp(-self.max, self.max)
        y = self._int_product(xq.to(torch.int64)).double() * (amax / self.max).double() * self.w_scale
        if self.bias is not None:
            y = y + self.bias
        return y.to(torch.float32).reshape(*shape[:-1], -1)


def int8_w8a8(model, saturate: bool | None = None, rounding_seed: int | None = None):
    """The transformers `model` (float) as the int8 engine serves it: every linear layer but the LM head replaced by
    its W8A8 int8 computation (engine/quantize.py's choice of layers; `saturate`: None = as this CPU's oneDNN sums,
    int16_pair_saturation). `rounding_seed`: the int8 layers' inputs moved by up to one float32 ulp
    (_Int8Linear's `rounding`), an equally valid int8 forward pass. Modifies and returns `model`."""
    from rollout_service.engine.quantize import quantizes

    saturate = int16_pair_saturation() if saturate is None else saturate
    rounding = None if rounding_seed is None else torch.Generator().manual_seed(rounding_seed)
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, torch.nn.Linear) and quantizes(full + ".weight", 2):
                setattr(module, child_name, _Int8Linear(child, saturate, rounding))
    return model


def int8_rounding_spread(model, sequences, temperature: float, top_k: int, top_p: float,
                         seeds=(1, 2, 3)) -> torch.Tensor:
    """How precisely the int8 arithmetic alone fixes the log-probs of `sequences` ([(prompt, generated)]) under the
    float `model`: for each generated token, the largest |log p| difference between int8_w8a8's forward pass and the
    equally valid ones that differ from it only in float32 rounding (rounding_seed in `seeds`). Per-token int8
    activation scales make the int8 forward pass discontinuous: an activation an ulp from a rounding boundary rounds
    either way, the layer's output moves by a quantization step, and deeper layers amplify that (SmolLM2-135M, 30
    layers: a median 0.15, max 0.80 nats per token, bench/results/int8_reference_vs_served_smollm2_after.json).
    Float64 [tokens]."""
    import copy

    base = int8_w8a8(copy.deepcopy(model))
    ref = [processed_logprobs(base, p, g, temperature, top_k, top_p) for p, g in sequences]
    spread = [torch.zeros_like(r) for r in ref]
    for seed in seeds:
        other = int8_w8a8(copy.deepcopy(model), rounding_seed=seed)
        for i, (p, g) in enumerate(sequences):
            lp = processed_logprobs(other, p, g, temperature, top_k, top_p)
            d = torch.where(lp == ref[i], 0.0, (lp - ref[i]).abs().nan_to_num(nan=float("inf")))  # -inf, -inf: 0
            spread[i] = torch.maximum(spread[i], d)
    return torch.cat(spread) if spread else torch.zeros(0, dtype=torch.float64)
