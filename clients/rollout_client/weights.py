"""Turn a model or state dict into a PushWeights/UpdateDraft stream without copying the whole model.

Two passes over the tensors: the first hashes them (the header carries the sha256 and byte count),
the second yields chunks of at most `chunk_bytes`. Tensors that share storage (tied embeddings) are
sent once, under their first name.
"""
from __future__ import annotations

import hashlib
from typing import Iterator

from rollout_service.api import pb

DTYPE_NAMES = {"torch.bfloat16": "bfloat16", "torch.float16": "float16", "torch.float32": "float32"}
MODES = {"abort": pb.IN_FLIGHT_ABORT, "wait": pb.IN_FLIGHT_WAIT, "keep": pb.IN_FLIGHT_KEEP}


def _tensors(weights, dtype) -> list[tuple[str, object]]:
    """(name, detached CPU contiguous tensor) pairs, shared storage sent once."""
    state = weights.state_dict() if hasattr(weights, "state_dict") else dict(weights)
    seen, out = set(), []
    for name, t in state.items():
        t = t.detach()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)) if t.device.type == "cpu" else None
        if key is not None and key in seen:
            continue
        if key is not None:
            seen.add(key)
        out.append((name, t))
    return out


def _bytes_of(t, dtype):
    import torch

    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    t = t.to("cpu").contiguous()
    return t, memoryview(t.reshape(-1).view(torch.uint8).numpy())   # reshape first: 0-dim tensors too


def push_stream(weights, version: int, *, target: int, mode: str = "wait", partial: bool = False,
                dtype=None, chunk_bytes: int = 4 << 20) -> Iterator[pb.PushRequest]:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    tensors = _tensors(weights, dtype)
    h, total = hashlib.sha256(), 0
    for _, t in tensors:                       # pass 1: checksum and size
        _, mv = _bytes_of(t, dtype)
        for off in range(0, len(mv), chunk_bytes):
            h.update(mv[off:off + chunk_bytes])
        total += len(mv)
    yield pb.PushRequest(header=pb.PushHeader(version=version, target=target, total_bytes=total,
                                              sha256=h.hexdigest(), in_flight=MODES[mode], partial=partial))
    for name, t in tensors:                    # pass 2: the data
        t, mv = _bytes_of(t, dtype)
        dname, shape = DTYPE_NAMES[str(t.dtype)], list(t.shape)
        for off in range(0, max(len(mv), 1), chunk_bytes):
            yield pb.PushRequest(chunk=pb.TensorChunk(name=name, dtype=dname, shape=shape, offset=off,
                                                      data=bytes(mv[off:off + chunk_bytes])))
