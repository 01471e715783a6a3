"""Receive a weight push into a staging area and validate it. Nothing here touches an engine.

A push is a header then TensorChunks (a tensor may span several chunks). Each chunk is checked as it
arrives (name, dtype, shape, bounds) and copied into the staging file; the end of the stream checks
completeness, the byte count and the sha256 over all chunk data in stream order. Only then is the file's
safetensors header written and the file handed to the engines; a failed push removes it.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rollout_service.errors import invalid
from rollout_service.weights.manifest import Manifest

ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
SAFETENSORS_DTYPE = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


ROOT_PREFIX = "rollout-service-"


def _staging_base() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _own_root() -> Path:
    return _staging_base() / f"{ROOT_PREFIX}{os.getpid()}"


def staging_root() -> Path:
    """/dev/shm when present (the worker then maps the file from memory), else the temp dir. One folder
    per server process: staged pushes and the committed overlays (memory, on /dev/shm)."""
    root = _own_root()
    root.mkdir(parents=True, exist_ok=True)
    return root


def remove_staging_root() -> None:
    """At shutdown: the folder holds a copy of every pushed tensor, and on /dev/shm that is RAM that would
    stay taken after the server exits."""
    shutil.rmtree(_own_root(), ignore_errors=True)


def sweep_stale_roots() -> int:
    """At start-up: remove the folders of server processes that no longer run (killed before they could
    clean up). Returns how many bytes that freed."""
    freed = 0
    for folder in _staging_base().glob(f"{ROOT_PREFIX}*"):
        pid = folder.name[len(ROOT_PREFIX):]
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        freed += sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        shutil.rmtree(folder, ignore_errors=True)
    return freed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:            # someone else's process
        return True
    return True


@dataclass
class _Tensor:
    dtype: str
    shape: tuple[int, ...]
    offset: int                               # in the staging file's data region
    nbytes: int
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


class Stager:
    """Receives one push straight into its staging file: a safetensors file in `out_dir`, memory-mapped, with
    room reserved for the header (written last, once the tensors are known) and a data region sized for
    every model tensor at its widest accepted dtype (sparse until written). Each chunk is copied once,
    from the message into the file. discard() removes the file; finish() hands it over."""

    def __init__(self, manifest: Manifest, total_bytes: int, sha256: str, partial: bool, out_dir: Path):
        self.manifest, self.total_bytes, self.sha256, self.partial = manifest, total_bytes, sha256, partial
        self._hash = hashlib.sha256()
        self._tensors: dict[str, _Tensor] = {}
        self._bytes = 0
        self._cursor = 0
        self._validate_s = 0.0
        self._started = time.perf_counter()
        cap = sum(int(np.prod(spec.shape, dtype=np.int64)) * max(ITEMSIZE.get(d, 8) for d in manifest.allowed_dtypes(n))
                  for n, spec in manifest.tensors.items())       # 8: a checkpoint's int64 tensor (EAGLE-3 d2t)
        widest = {n: {"dtype": "BF16", "shape": list(spec.shape), "data_offsets": [cap, cap]}
                  for n, spec in manifest.tensors.items()}
        self._header_room = len(_header_json(widest)) + 8
        self._header_room += -self._header_room % 8
        self._data_start = 8 + self._header_room
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(suffix=".safetensors", dir=out_dir)
        self.path = Path(name)
        try:
            os.ftruncate(fd, self._data_start + cap)
            self._mm = mmap.mmap(fd, self._data_start + cap)          # never empty: the header room is in it
        except BaseException:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        os.close(fd)
        self._view = np.frombuffer(self._mm, dtype=np.uint8)

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
        if dtype not in ITEMSIZE:
            raise invalid(f"tensor {name!r}: dtype {dtype!r} cannot be pushed (it is fixed by the checkpoint); "
                          f"leave it out and set partial=true")
        ten = self._tensors.get(name)
        if ten is None:
            nbytes = int(np.prod(shape, dtype=np.int64)) * ITEMSIZE[dtype]
            ten = self._tensors[name] = _Tensor(dtype, tuple(shape), self._cursor, nbytes)
            self._cursor += nbytes
        elif ten.dtype != dtype:
            raise invalid(f"tensor {name!r}: chunks disagree on dtype ({ten.dtype} then {dtype})")
        end = offset + len(data)
        if offset < 0 or end > ten.nbytes:
            raise invalid(f"tensor {name!r}: chunk [{offset}, {end}) runs past the tensor's {ten.nbytes} bytes")
        at = self._data_start + ten.offset + offset
        self._view[at:at + len(data)] = np.frombuffer(data, dtype=np.uint8)     # numpy copies without the GIL
        ten.received += len(data)
        self._validate_s += time.perf_counter() - t

    def finish(self) -> StagedWeights:
        """Check completeness and checksum, write the header: the file is then a safetensors file holding
        exactly the received tensors. On any error the file is removed."""
        try:
            return self._finish()
        except BaseException:
            self.discard()
            raise

    def _finish(self) -> StagedWeights:
        receive_s = time.perf_counter() - self._started
        t = time.perf_counter()
        if self._bytes != self.total_bytes:
            raise invalid(f"stream ended after {self._bytes} bytes of tensor data but header.total_bytes="
                          f"{self.total_bytes}: the push was cut short or the header is wrong")
        digest = self._hash.hexdigest()
        if digest != self.sha256.lower():
            raise invalid(f"sha256 mismatch: header says {self.sha256}, data hashes to {digest}")
        short = [n for n, x in self._tensors.items() if x.received != x.nbytes]
        if short:
            raise invalid(f"tensor {short[0]!r} is incomplete ({self._tensors[short[0]].received} of "
                          f"{self._tensors[short[0]].nbytes} bytes; {len(short)} incomplete in total)")
        partial = self.manifest.check_complete(self._tensors, self.partial)
        header = _header_json({n: {"dtype": SAFETENSORS_DTYPE[x.dtype], "shape": list(x.shape),
                                   "data_offsets": [x.offset, x.offset + x.nbytes]}
                               for n, x in self._tensors.items()})
        header += b" " * (self._header_room - len(header))       # the format allows trailing spaces
        self._view[:8] = np.frombuffer(struct.pack("<Q", self._header_room), dtype=np.uint8)
        self._view[8:self._data_start] = np.frombuffer(header, dtype=np.uint8)
        self._close()
        os.truncate(self.path, self._data_start + self._cursor)
        validate_s = self._validate_s + time.perf_counter() - t
        return StagedWeights(self.path, list(self._tensors), self._bytes, partial, receive_s - self._validate_s,
                             validate_s)

    def _close(self) -> None:
        self._view = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None

    def discard(self) -> None:
        """Remove the staging file (the push failed or was cut). Call once no add() is running."""
        try:
            self._close()
        except BufferError:        # a copy still holds the map: it is unmapped once that ends
            pass
        self.path.unlink(missing_ok=True)


def _header_json(entries: dict) -> bytes:
    return json.dumps(entries, separators=(",", ":")).encode()
