"""A content fingerprint of a target's weights (PushResult.fingerprint, Status.policy_fingerprint).

sha256 over every tensor, in name order, of "<name>\\0<dtype>\\0<xxh3-128 hex of its bytes>\\n": the bytes as the
tensor is stored (row-major, little-endian), in the dtype it was last pushed in, or the checkpoint's own. xxh3 (the
`xxhash` package), not sha256, per tensor: 18 GB/s against 1.8 on one core here, and a commit hashes every tensor
it records (269 MB: 0.04 s against 0.18 s, which on 2 cores slowed the engines' prepare it overlaps). A trainer
computes the same from its tensors (rollout_client.delta.fingerprint) and compares. Per-tensor digests are read
straight from safetensors files (a byte range per tensor, never a tensor object), so a commit hashes only the files it
records.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
from pathlib import Path

import xxhash

from rollout_service.wire import FROM_SAFETENSORS_CODE

Digest = tuple[str, str]           # (contract dtype name, xxh3-128 hex of the tensor's bytes)


def tensor_ranges(path: Path) -> dict[str, tuple[str, int, int]]:
    """name -> (contract dtype, start, end): where each tensor's bytes lie in a safetensors file (its header only)."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    out = {}
    for name, meta in header.items():
        if name != "__metadata__":
            a, b = meta["data_offsets"]
            out[name] = (FROM_SAFETENSORS_CODE.get(meta["dtype"], str(meta["dtype"]).lower()), 8 + n + a, 8 + n + b)
    return out


def file_digests(path: Path) -> dict[str, Digest]:
    """name -> (dtype, xxh3-128 hex) of every tensor in a safetensors file. Blocking: hashes the whole file."""
    ranges = tensor_ranges(path)
    with open(path, "rb") as fh:
        if not os.fstat(fh.fileno()).st_size:
            return {}
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                return {name: (dtype, xxhash.xxh3_128_hexdigest(view[a:b])) for name, (dtype, a, b) in ranges.items()}
            finally:
                view.release()


def combine(digests: dict[str, Digest]) -> str:
    """The fingerprint of a whole target from its tensors' digests."""
    h = hashlib.sha256()
    for name in sorted(digests):
        dtype, hexdigest = digests[name]
        h.update(f"{name}\0{dtype}\0{hexdigest}\n".encode())
    return h.hexdigest()
