"""Receive a weight push into a staging area and validate it. Nothing here touches an engine.

A push is a header then TensorChunks (a tensor may span several chunks). Each chunk is checked as it
arrives (name, dtype, shape, bounds); the end of the stream checks completeness, the byte count and the
sha256 over all chunk data in stream order. Only then is a safetensors file written for the engines.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rollout_service.errors import invalid
from rollout_service.weights.manifest import Manifest

ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
SAFETENSORS_DTYPE = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def staging_root() -> Path:
    """/dev/shm when present (the worker then maps the file from memory), else the temp dir."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    root = base / f"rollout-service-{os.getpid()}"
    root.mkdir(parents=True, exist_ok=True)
    return root


@dataclass
class _Buffer:
    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray                          # uint8 [nbytes]
    received: int = 0


@dataclass
class StagedWeights:
    """A validated push, written to `path` (a safetensors file), ready to commit."""

    path: Path
    names: list[str]
    num_bytes: int
    partial: bool
    receive_s: float
    validate_s: float

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)


@dataclass
class Stager:
    manifest: Manifest
    total_bytes: int
    sha256: str
    partial: bool
    _hash: "hashlib._Hash" = field(default_factory=hashlib.sha256)
    _buffers: dict[str, _Buffer] = field(default_factory=dict)
    _bytes: int = 0
    _validate_s: float = 0.0
    _started: float = field(default_factory=time.perf_counter)

    def add(self, name: str, dtype: str, shape: tuple[int, ...], offset: int, data: bytes) -> None:
        t = time.perf_counter()
        self._hash.update(data)
        self._bytes += len(data)
        if self._bytes > self.total_bytes:
            raise invalid(f"header.total_bytes={self.total_bytes} but more tensor data arrived "
                          f"({self._bytes} bytes so far)")
        if not self.manifest.check_tensor(name, dtype, shape):
            self._validate_s += time.perf_counter() - t
            return
        buf = self._buffers.get(name)
        if buf is None:
            nbytes = int(np.prod(shape, dtype=np.int64)) * ITEMSIZE[dtype]
            buf = self._buffers[name] = _Buffer(dtype, tuple(shape), np.empty(nbytes, dtype=np.uint8))
        elif buf.dtype != dtype:
            raise invalid(f"tensor {name!r}: chunks disagree on dtype ({buf.dtype} then {dtype})")
        end = offset + len(data)
        if end > buf.data.size:
            raise invalid(f"tensor {name!r}: chunk [{offset}, {end}) runs past the tensor's {buf.data.size} bytes")
        buf.data[offset:end] = np.frombuffer(data, dtype=np.uint8)
        buf.received += len(data)
        self._validate_s += time.perf_counter() - t

    def finish(self, out_dir: Path) -> StagedWeights:
        """Check completeness and checksum; write the safetensors file the engines load."""
        receive_s = time.perf_counter() - self._started
        t = time.perf_counter()
        if self._bytes != self.total_bytes:
            raise invalid(f"stream ended after {self._bytes} bytes of tensor data but header.total_bytes="
                          f"{self.total_bytes}: the push was cut short or the header is wrong")
        digest = self._hash.hexdigest()
        if digest != self.sha256.lower():
            raise invalid(f"sha256 mismatch: header says {self.sha256}, data hashes to {digest}")
        short = [n for n, b in self._buffers.items() if b.received != b.data.size]
        if short:
            raise invalid(f"tensor {short[0]!r} is incomplete ({self._buffers[short[0]].received} of "
                          f"{self._buffers[short[0]].data.size} bytes; {len(short)} incomplete in total)")
        partial = self.manifest.check_complete(self._buffers, self.partial)
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(suffix=".safetensors", dir=out_dir)
        os.close(fd)
        write_safetensors(Path(name), self._buffers)
        validate_s = self._validate_s + time.perf_counter() - t
        return StagedWeights(Path(name), list(self._buffers), self._bytes, partial, receive_s - self._validate_s,
                             validate_s)


def write_safetensors(path: Path, buffers: dict[str, _Buffer]) -> None:
    """The received buffers as one safetensors file, written straight from them (save_file would first copy
    every tensor into a bytes object). Format: little-endian u64 header size, JSON header padded with spaces
    to 8 bytes, then the tensors' bytes in header order."""
    header, offset = {}, 0
    for name, b in buffers.items():
        header[name] = {"dtype": SAFETENSORS_DTYPE[b.dtype], "shape": list(b.shape),
                        "data_offsets": [offset, offset + b.data.size]}
        offset += b.data.size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for b in buffers.values():
            f.write(b.data)
