"""Double-buffered weight reload inside a vLLM worker: build the new weights beside the served ones, then swap.

vLLM's layerwise reload (vllm/model_executor/model_loader/reload) turns checkpoint tensors into kernel format
layer by layer, in place: each layer is torn down to meta tensors, loaded, processed (on CPU every linear layer's
weight is re-packed into a new oneDNN handle, `layer.cpu_linear`) and put back. Generation must stop for all of
it: ~0.7 s for the 135M default model on 2 cores.

Here the same reload runs on a *shadow* of the model: new module objects with their own parameter and buffer
registries and their own copies of the kernel tensors (submodule state that loading never writes, such as the
KV cache, is shared). Serving continues while the shadow loads; it reads the served tensors only to copy them.
`swap` then moves what the reload produced into the served modules: the module attributes it replaced (the
packed GEMM handles) and the parameter and buffer values (copied into the served tensors' storage, so anything
sharing them, e.g. a drafter sharing the embedding, sees the new values as it does after an in-place reload).
Only the swap needs generation paused: a few tens of milliseconds.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from types import MethodType

import torch
from torch import nn

# nn.Module bookkeeping that make_shadow rebuilds itself; every other attribute the reload changes is swapped.
_MODULE_INTERNALS = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
                               "training"})


@dataclass
class Shadow:
    root: nn.Module | None                            # None once released
    pairs: list[tuple[nn.Module, nn.Module]]          # (served module, its shadow), in module order


def _own_tensor(t: torch.Tensor | None, memo: dict[int, torch.Tensor]) -> torch.Tensor | None:
    """A copy of `t` with the same class and attributes (weight loaders, shard dims); tied tensors stay tied."""
    if t is None:
        return None
    if id(t) in memo:
        return memo[id(t)]
    data = t.data.clone()
    out = nn.Parameter(data, requires_grad=False) if isinstance(t, nn.Parameter) else data
    out.__class__ = t.__class__
    out.__dict__.update(t.__dict__)
    memo[id(t)] = out
    return out


def _shadow_module(module: nn.Module, pairs: list, memo: dict) -> nn.Module:
    if id(module) in memo:                           # a module reachable twice stays one module
        return memo[id(module)]
    shadow = copy.copy(module)                       # new object, attributes shared shallowly
    memo[id(module)] = shadow
    if getattr(module, "scheme", None) is not None:
        shadow.scheme = _own_scheme(module.scheme)
    shadow._parameters = {n: _own_tensor(p, memo) for n, p in module._parameters.items()}
    shadow._buffers = {n: _own_tensor(b, memo) for n, b in module._buffers.items()}
    shadow._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    pairs.append((module, shadow))
    shadow._modules = {n: (None if m is None else _shadow_module(m, pairs, memo))
                       for n, m in module._modules.items()}
    return shadow


def _own_scheme(scheme):
    """A quantized layer's own copy of its compressed-tensors scheme (`layer.scheme`): the scheme's kernel keeps the
    packed weights (on CPU the int8 oneDNN handle, `kernel.dnnl_handler`), not the layer, so a shadow sharing it
    would re-pack the served layer's kernel while the served model generates. `swap` moves the shadow's scheme (with
    its packed kernel) into the served module."""
    scheme = copy.copy(scheme)
    if getattr(scheme, "kernel", None) is not None:
        scheme.kernel = copy.copy(scheme.kernel)
    return scheme


def _unwrap_loader(fn):
    """vLLM's layerwise reload leaves its `online_process_loader` wrappers on the recorded metadata."""
    while getattr(fn, "__name__", "") == "online_process_loader" and hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def _rebind(meta: torch.Tensor, served: nn.Module, shadow: nn.Module, sentinel) -> torch.Tensor:
    """A fresh copy of a recorded meta tensor whose weight loaders are bound to `shadow`."""
    out = torch.empty_strided(tuple(meta.size()), tuple(meta.stride()), dtype=meta.dtype, device="meta")
    out.__class__ = meta.__class__
    attrs = dict(meta.__dict__)
    for key, value in attrs.items():
        value = _unwrap_loader(value)
        if isinstance(value, MethodType) and value.__self__ in (served, sentinel):
            value = value.__func__.__get__(shadow)
        attrs[key] = value
    out.__dict__ = attrs
    return out


def make_shadow(model: nn.Module) -> Shadow:
    """The served model's shadow, registered for vLLM's layerwise reload like the served model is."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, get_layerwise_info
    from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

    pairs: list[tuple[nn.Module, nn.Module]] = []
    root = _shadow_module(model, pairs, {})
    for served, shadow in pairs:
        recorded = LAYERWISE_INFO.get(served)
        if recorded is None:
            continue
        params, buffers = recorded.restore_metadata
        info = get_layerwise_info(shadow)
        info.restore_metadata = ({n: _rebind(t, served, shadow, layer_ref_sentinel) for n, t in params.items()},
                                 {n: _rebind(t, served, shadow, layer_ref_sentinel) for n, t in buffers.items()})
        info.restore_device = recorded.restore_device
    return Shadow(root, pairs)


@torch.no_grad()
def swap(shadow: Shadow) -> None:
    """Make the served model compute what the loaded shadow computes. Runs with generation paused."""
    copied: set[int] = set()                         # tied tensors are copied once
    for served, sh in shadow.pairs:
        for registry in ("_parameters", "_buffers"):
            live, new = getattr(served, registry), getattr(sh, registry)
            for name, t in live.items():
                s = new.get(name)
                if t is None or s is None or s is t or id(t) in copied:
                    continue
                copied.add(id(t))
                if t.shape == s.shape and t.dtype == s.dtype:
                    t.data.copy_(s.data)
                else:                               # processing changed its form (e.g. a weight emptied)
                    t.data = s.data
        for key, value in sh.__dict__.items():
            if key not in _MODULE_INTERNALS and served.__dict__.get(key, _MISSING) is not value:
                served.__dict__[key] = value


_MISSING = object()


def release(shadow: Shadow) -> None:
    """Drop the shadow's modules from vLLM's reload registry, so the shadow and everything it loaded can be
    freed. LAYERWISE_INFO is a WeakKeyDictionary, but each entry's recorded weight loaders are bound to its
    module, the key itself, so the entry keeps its key alive: without this every commit leaked its shadow
    (~0.4 GB of worker memory per push of the default model). Regression tests: tests/unit/test_shadow_reload.py."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    for _, sh in shadow.pairs:
        LAYERWISE_INFO.pop(sh, None)
        # The shadow's own registries (make_shadow gave it new ones) hold tensors whose loaders are bound to
        # the shadow: reference cycles. Emptying them frees most of the shadow by refcount at once; the
        # worker's next preparation collects what vLLM's loaders still tie up (worker_ext).
        sh._parameters.clear()
        sh._buffers.clear()
        sh._modules.clear()
    shadow.pairs.clear()
    shadow.root = None
