"""Routed experts (routing replay) as the HTTP dialects' own servers spell them.

vLLM's server (`--enable-return-routed-experts`): every choice's `routed_experts` is the rows as a base64 `.npy`
file (vllm.utils.serial_utils.numpy2base64: uint8 or uint16 [tokens - 1, layers, top_k]). SGLang
(`"return_routed_experts": true` in /generate): `meta_info.routed_experts` is the rows as base64 raw int32
[tokens - 1, layers, top_k], as slime's rollout reads them (np.frombuffer(b64decode(...), np.int32))."""
from __future__ import annotations

import base64
import io

import numpy as np

from rollout_service.engine.types import Routes


def routes_array(r: Routes) -> np.ndarray:
    """[rows, layers, top_k] in the dtype the engine captured."""
    return np.frombuffer(r.data, dtype="<u1" if r.dtype == "uint8" else "<u2").reshape(r.rows, r.layers, r.top_k)


def routes_npy_base64(r: Routes) -> str:
    """vLLM's spelling."""
    with io.BytesIO() as buf:
        np.save(buf, routes_array(r), allow_pickle=False)
        return base64.b64encode(buf.getvalue()).decode("ascii")


def routes_raw_base64(r: Routes, dtype: str = "<i4") -> str:
    """SGLang's spelling (raw values of `dtype`, int32 by default)."""
    return base64.b64encode(routes_array(r).astype(dtype).tobytes()).decode("ascii")
