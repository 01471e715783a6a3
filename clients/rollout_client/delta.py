"""Delta weight pushes: send only the elements whose value changed since the last push.

Between two RL steps most of a bf16 policy keeps its value (the optimizer's update falls below a bf16 step for about
99% of elements), so `WeightDeltas` keeps what it last pushed (one copy of the weights in the push dtype) and sends
the rest as a delta against the version that push made (PushHeader.base_version): each changed tensor sparse (uint32
flat indices and the new values there: 6 bytes per changed bf16 element) or dense where that is smaller. A full push
(an anchor) goes first, every `anchor_every` pushes, and whenever the server refuses a delta because it serves
another version (a missed push, a restarted server without a state_dir): no human needed. The server makes each delta
whole against its base and commits it like any push (all engines or none), so after any number of deltas it serves
exactly what a full push of the same state would; `fingerprint` computes the server's content fingerprint
(PushResult.fingerprint, Status.policy_fingerprint) from a trainer's tensors, to check that.

In float32 nearly every element changes each step (an update is far above a float32 step): deltas are then dense,
as large as a full push; push bf16 to a bf16 server to gain.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from rollout_client.api import pb
from rollout_client.types import PushResult
from rollout_client.weights import PACK_BYTES, _bytes_of, state_tensors
from rollout_client.wire import DTYPE_NAMES, MODES, TARGETS

log = logging.getLogger(__name__)
INDEX_DTYPE = np.dtype("<u4")               # TensorChunk.indices
SCAN = 1 << 22                              # elements compared at a time (bounded temporaries)
_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _bits(t) -> np.ndarray:
    """A tensor's elements as unsigned integers of its width (bit patterns compare exactly: -0.0, NaN)."""
    import torch

    flat = t.reshape(-1)
    return flat.view(torch.uint8).numpy().view(_BITS[t.element_size()])


def fingerprint(weights, dtype=None) -> str:
    """The server's content fingerprint (PushResult.fingerprint) of these tensors, cast to `dtype` as a push would.
    Needs the `xxhash` package (the client's `torch` extra installs it)."""
    import xxhash

    h = hashlib.sha256()
    for name, t in sorted(state_tensors(weights), key=lambda x: x[0]):
        t, mv = _bytes_of(t, dtype)
        h.update(f"{name}\0{DTYPE_NAMES[str(t.dtype)]}\0{xxhash.xxh3_128_hexdigest(mv)}\n".encode())
    return h.hexdigest()


@dataclass
class Change:
    """One tensor of a delta: `indices` (uint32, ascending) and the new values there, or dense (indices None)."""
    name: str
    dtype: str
    shape: list[int]
    values: np.ndarray                      # bit patterns (uint16 / uint32), the new values
    indices: np.ndarray | None = None


def diff(last: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Flat indices (uint32) where the bit patterns differ."""
    out = [np.flatnonzero(last[s:s + SCAN] != new[s:s + SCAN]) + s for s in range(0, new.size, SCAN)]
    return np.concatenate(out).astype(INDEX_DTYPE) if out else np.zeros(0, INDEX_DTYPE)


def delta_stream(changes: list[Change], version: int, base_version: int, *, target: int, mode: str = "wait",
                 chunk_bytes: int = 4 << 20, pack_bytes: int = PACK_BYTES) -> Iterator[pb.PushRequest]:
    """The PushRequests of a delta: header, chunks (small ones packed in TensorBatch messages), trailer."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    pieces = []                              # (name, dtype, shape, offset, indices bytes, data bytes)
    for c in changes:
        item = c.values.itemsize
        if c.indices is None:
            data = memoryview(c.values).cast("B")
            for off in range(0, max(len(data), 1), chunk_bytes):
                pieces.append((c.name, c.dtype, c.shape, off, b"", bytes(data[off:off + chunk_bytes])))
            continue
        step = max(1, chunk_bytes // (INDEX_DTYPE.itemsize + item))
        for start in range(0, c.indices.size, step):
            pieces.append((c.name, c.dtype, c.shape, start, c.indices[start:start + step].tobytes(),
                           c.values[start:start + step].tobytes()))
    h, total = hashlib.sha256(), 0
    for *_, idx, data in pieces:
        total += len(idx) + len(data)
    yield pb.PushRequest(header=pb.PushHeader(version=version, target=target, total_bytes=total,
                                              in_flight=MODES[mode], base_version=base_version))
    batch, batched = None, 0
    for name, dtype, shape, off, idx, data in pieces:
        h.update(idx)
        h.update(data)
        chunk = pb.TensorChunk(name=name, dtype=dtype, shape=shape, offset=off, data=data, indices=idx)
        size = len(idx) + len(data)
        if size > pack_bytes:
            if batch is not None:
                yield batch
                batch, batched = None, 0
            yield pb.PushRequest(chunk=chunk)
            continue
        if batch is not None and batched + size > pack_bytes:
            yield batch
            batch, batched = None, 0
        if batch is None:
            batch = pb.PushRequest()
        batch.batch.chunks.append(chunk)
        batched += size
    if batch is not None:
        yield batch
    yield pb.PushRequest(trailer=pb.PushTrailer(sha256=h.hexdigest()))


class WeightDeltas:
    """Pushes a policy (or the drafter) through `client` (a RolloutClient) as deltas against its own last push.

    push(weights, version) sends a full push (an anchor) first, then every `anchor_every` pushes, and when the server
    refuses a delta's base; otherwise a delta. Keeps one copy of the pushed weights (in `dtype`) to diff against.
    The last result says which it was (`last_kind`: "full", "delta" or "full after refusal") and what it cost
    (`last_changed` elements, `last_bytes` sent). full_push(weights, version, mode=, timeout=) sends the anchors
    (default: the client's PushWeights / UpdateDraft stream; a trainer on a weight-transfer group passes its
    WeightSync.push, whose bandwidth full pushes need)."""

    def __init__(self, client, *, target: str = "policy", dtype=None, anchor_every: int = 20,
                 chunk_bytes: int = 4 << 20, full_push=None):
        if target not in ("policy", "drafter"):
            raise ValueError(f"target must be 'policy' or 'drafter', got {target!r}")
        if anchor_every < 1:
            raise ValueError(f"anchor_every must be >= 1, got {anchor_every}")
        self.client, self.target, self.dtype = client, target, dtype
        if full_push is None:
            full = client.push_weights if target == "policy" else client.update_draft
            full_push = lambda w, v, mode, timeout: full(w, v, mode=mode, timeout=timeout, chunk_bytes=chunk_bytes)  # noqa: E731
        self.full_push = full_push
        self.anchor_every, self.chunk_bytes = anchor_every, chunk_bytes
        self.base_version = 0                      # the version this object's last push made (0: none yet)
        self.since_anchor = 0
        self._last: dict[str, np.ndarray] = {}       # name -> the bit patterns of its last pushed value
        self._dtypes: dict[str, str] = {}
        self.last_kind, self.last_changed, self.last_bytes = "", 0, 0
        self.last_changes: list[Change] = []           # the last delta (save_delta writes it as a file)

    def push(self, weights, version: int, *, mode: str = "wait", timeout: float | None = None) -> PushResult:
        import grpc

        tensors = [(n, _bytes_of(t, self.dtype)[0]) for n, t in state_tensors(weights)]
        if self.base_version == 0 or self.since_anchor + 1 >= self.anchor_every or \
                set(self._last) != {n for n, _ in tensors}:
            return self._full(tensors, version, mode, timeout, "full")
        changes, changed = self._changes(tensors)
        stream = delta_stream(changes, version, self.base_version, target=TARGETS[self.target], mode=mode,
                              chunk_bytes=self.chunk_bytes)
        call = self.client.stub.PushWeights if self.target == "policy" else self.client.stub.UpdateDraft
        try:
            reply = call(stream, timeout=timeout, metadata=self.client.auth.admin())
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.FAILED_PRECONDITION or "base_version" not in (e.details() or ""):
                raise
            log.warning("the server refused a delta against version %d (%s); pushing version %d whole",
                        self.base_version, e.details(), version)
            return self._full(tensors, version, mode, timeout, "full after refusal")
        for c in changes:                          # the server holds these values now
            bits = self._last[c.name]
            if c.indices is None:
                bits[:] = c.values
            else:
                bits[c.indices] = c.values
        self.base_version, self.since_anchor = version, self.since_anchor + 1
        self.last_kind, self.last_changed, self.last_changes = "delta", changed, changes
        self.last_bytes = sum(c.values.nbytes + (0 if c.indices is None else c.indices.nbytes) for c in changes)
        return PushResult.from_proto(reply)

    def fingerprint(self) -> str:
        """The content fingerprint of what this object last pushed (what the server must serve): compare it with
        PushResult.fingerprint or Status.policy_fingerprint."""
        import xxhash

        h = hashlib.sha256()
        for name in sorted(self._last):
            h.update(f"{name}\0{self._dtypes[name]}\0{xxhash.xxh3_128_hexdigest(self._last[name])}\n".encode())
        return h.hexdigest()

    def _changes(self, tensors) -> tuple[list[Change], int]:
        changes, changed = [], 0
        for name, t in tensors:
            last = self._last[name]
            new = _bits(t)
            idx = diff(last, new)
            if idx.size == 0:
                continue
            changed += idx.size
            dtype, shape = DTYPE_NAMES[str(t.dtype)], list(t.shape)
            if idx.size * (INDEX_DTYPE.itemsize + new.itemsize) >= new.nbytes:     # dense is smaller
                changes.append(Change(name, dtype, shape, new.copy()))
                continue
            changes.append(Change(name, dtype, shape, new[idx], idx))
        if not changes:                  # nothing changed: the smallest tensor whole, so the version still moves
            name, t = min(tensors, key=lambda x: x[1].numel())
            changes.append(Change(name, DTYPE_NAMES[str(t.dtype)], list(t.shape), _bits(t).copy()))
        return changes, changed

    def _full(self, tensors, version: int, mode: str, timeout, kind: str) -> PushResult:
        result = self.full_push(dict(tensors), version, mode=mode, timeout=timeout)
        self._last = {n: _bits(t).copy() for n, t in tensors}
        self._dtypes = {n: DTYPE_NAMES[str(t.dtype)] for n, t in tensors}
        self.base_version, self.since_anchor = version, 0
        self.last_kind, self.last_changed, self.last_changes = kind, sum(t.numel() for _, t in tensors), []
        self.last_bytes = sum(t.numel() * t.element_size() for _, t in tensors)
        return result


def save_delta(path, changes: list[Change]) -> None:
    """Write a delta for LoadWeights (LoadWeightsRequest.base_version): NAME whole, or NAME::indices and
    NAME::values."""
    import torch
    from safetensors.torch import save_file

    out = {}
    for c in changes:
        signed = c.values.view({2: np.int16, 4: np.int32}[c.values.itemsize])     # torch lacks most unsigned ops
        values = torch.from_numpy(signed.copy()).view(getattr(torch, c.dtype))
        if c.indices is None:
            out[c.name] = values.reshape(c.shape)
        else:
            out[c.name + "::indices"] = torch.from_numpy(c.indices.astype(np.int64))
            out[c.name + "::values"] = values
    save_file(out, str(path))
