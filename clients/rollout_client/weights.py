"""Turn a model or state dict into a PushWeights/UpdateDraft stream without copying the whole model.

One pass over the tensors: chunks of at most `chunk_bytes`, hashed as they go, then a trailer with the
sha256 (with checksum="header", a first pass hashes them for the header instead). Consecutive tensors of at most
`pack_bytes` go whole, several to a message (TensorBatch, up to `pack_bytes` of data): a LoRA adapter's ~400 small
tensors are then a few messages, not one each. Tensors that share storage (tied embeddings) are sent once, under
their first name.
"""
from __future__ import annotations

import hashlib
from typing import Iterator

from rollout_client.api import pb
from rollout_client.wire import DTYPE_NAMES, MODES

# Tensors of at most this many bytes are packed whole into TensorBatch messages of at most this much data. One gRPC
# message per tensor cost a rank-8 adapter's push (420 tensors, 9.8 MB) 0.09-0.25 s of receiving on the server.
PACK_BYTES = 1 << 20


def state_tensors(weights) -> list[tuple[str, object]]:
    """(name, detached tensor) pairs of a module or a name->tensor dict, shared storage (tied embeddings) once."""
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


def peft_adapter(model, adapter_name: str = "default") -> tuple[dict, str]:
    """(tensors, adapter_config.json text) of a PEFT model's LoRA adapter, as PEFT's save_pretrained writes them:
    only the adapter's tensors (base_model.model.<module>.lora_A.weight, ...), never the base weights."""
    import json

    from peft import get_peft_model_state_dict

    config = model.peft_config[adapter_name].to_dict()
    text = json.dumps({k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in config.items()},
                      default=str)
    return get_peft_model_state_dict(model, adapter_name=adapter_name), text


def _bytes_of(t, dtype):
    import torch

    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    t = t.to("cpu").contiguous()
    return t, memoryview(t.reshape(-1).view(torch.uint8).numpy())   # reshape first: 0-dim tensors too


def push_stream(weights, version: int, *, target: int, mode: str = "wait", partial: bool = False,
                dtype=None, chunk_bytes: int = 4 << 20, checksum: str = "trailer", adapter: str = "",
                adapter_config: str = "", pack_bytes: int = PACK_BYTES) -> Iterator[pb.PushRequest]:
    """checksum="trailer" (default) hashes the chunks as they are sent and ends the stream with a
    PushTrailer: the tensors are read once. "header" hashes everything first (a second pass over the
    tensors before the first byte goes out) and puts the sha256 in the header.
    pack_bytes: tensors of at most this many bytes (and at most chunk_bytes) go whole in TensorBatch messages of up
    to this much data; 0 sends one TensorChunk per message (servers older than TensorBatch need that)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    if checksum not in ("trailer", "header"):
        raise ValueError(f"checksum must be 'trailer' or 'header', got {checksum!r}")
    tensors = state_tensors(weights)
    h, total = hashlib.sha256(), 0
    for _, t in tensors:                       # sizes (and, for a header checksum, the hash) first
        if checksum == "header":
            _, mv = _bytes_of(t, dtype)
            for off in range(0, len(mv), chunk_bytes):
                h.update(mv[off:off + chunk_bytes])
        total += t.numel() * (dtype or t.dtype).itemsize
    yield pb.PushRequest(header=pb.PushHeader(version=version, target=target, total_bytes=total,
                                              sha256=h.hexdigest() if checksum == "header" else "",
                                              in_flight=MODES[mode], partial=partial, adapter=adapter,
                                              adapter_config=adapter_config))
    pack_bytes = min(pack_bytes, chunk_bytes)
    batch, batched = None, 0                   # the PushRequest whose TensorBatch is being filled, and its bytes

    def flush():
        nonlocal batch, batched
        out = batch
        batch, batched = None, 0
        if len(out.batch.chunks) == 1:         # one tensor: a plain chunk
            return pb.PushRequest(chunk=out.batch.chunks[0])
        return out

    for name, t in tensors:                    # the data, in stream order (batches too)
        t, mv = _bytes_of(t, dtype)
        dname, shape = DTYPE_NAMES[str(t.dtype)], list(t.shape)
        if pack_bytes and len(mv) <= pack_bytes:
            if batch is not None and batched + len(mv) > pack_bytes:
                yield flush()
            data = bytes(mv)
            if checksum == "trailer":
                h.update(data)
            if batch is None:
                batch = pb.PushRequest()
            batch.batch.chunks.add(name=name, dtype=dname, shape=shape, offset=0, data=data)
            batched += len(data)
            continue
        if batch is not None:
            yield flush()
        for off in range(0, max(len(mv), 1), chunk_bytes):
            data = bytes(mv[off:off + chunk_bytes])
            if checksum == "trailer":
                h.update(data)
            yield pb.PushRequest(chunk=pb.TensorChunk(name=name, dtype=dname, shape=shape, offset=off, data=data))
    if batch is not None:
        yield flush()
    if checksum == "trailer":
        yield pb.PushRequest(trailer=pb.PushTrailer(sha256=h.hexdigest()))
