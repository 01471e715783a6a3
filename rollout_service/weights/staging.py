"""Receive a weight push into a staging area and validate it. Nothing here touches an engine.

A push is a header then TensorChunks (a tensor may span several chunks). Each chunk is checked as it
arrives (name, dtype, shape, bounds) and copied into the staging file; the end of the stream checks
completeness, the byte count and the sha256 over all chunk data in stream order. Only then is the file's
safetensors header written and the file handed to the engines; a failed push leaves it as the spare the
next push stages into (recycle).
"""
from __future__ import annotations

import bisect
import hashlib
import json
import math
import mmap
import os
import struct
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rollout_service.errors import invalid
from rollout_service.weights.manifest import Manifest
from rollout_service.scratch import recycle, take_spare
from rollout_service.wire import ITEMSIZE, SAFETENSORS_CODE

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)    # Linux >= 5.14; Python 3.11 lacks the name
POPULATE_STEP = 16 << 20             # bytes per madvise call: a few milliseconds with the GIL held


@dataclass
class ReceivedTensor:
    dtype: str
    shape: tuple[int, ...]
    offset: int                               # in the staging file's data region
    nbytes: int
    spans: list = field(default_factory=list)  # sorted [start, end) byte ranges received (no overlaps)

    @property
    def received(self) -> int:
        return sum(end - start for start, end in self.spans)

    def cover(self, start: int, end: int, name: str) -> None:
        """Record [start, end): refuses a chunk overlapping one already received, so `received` == nbytes
        means every byte was written (a recycled staging file holds stale bytes in any gap)."""
        spans = self.spans
        i = bisect.bisect_left(spans, (start, end))
        if (i > 0 and spans[i - 1][1] > start) or (i < len(spans) and spans[i][0] < end):
            raise invalid(f"tensor {name!r}: chunk [{start}, {end}) overlaps bytes already received")
        if i > 0 and spans[i - 1][1] == start:           # merge with the previous range (in-order chunks)
            spans[i - 1] = (spans[i - 1][0], end)
        else:
            spans.insert(i, (start, end))


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
        """Given up before the committer took it (the push was cancelled while staging): the spare."""
        recycle(self.path, self.path.parent)


class Stager:
    """Receives one push straight into its staging file: a safetensors file in `out_dir`, memory-mapped, with
    room reserved for the header (written last, once the tensors are known) and a data region sized for
    every model tensor at its widest accepted dtype (sparse until written). Each chunk is copied once,
    from the message into the file. The file is the spare left by an earlier push when there is one
    (recycle(); its allocated pages are faulted in up front, in this constructor, before the stream).
    discard() recycles the file; finish() hands it over."""

    def __init__(self, manifest: Manifest, total_bytes: int, sha256: str, partial: bool, out_dir: Path):
        self.manifest, self.total_bytes, self.sha256, self.partial = manifest, total_bytes, sha256, partial
        self._hash = hashlib.sha256()
        self._tensors: dict[str, ReceivedTensor] = {}
        self._bytes = 0
        self._cursor = 0
        self._validate_s = 0.0
        self._started = time.perf_counter()
        cap, self._header_room = _layout(manifest)
        self._data_start = 8 + self._header_room
        self.out_dir = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(suffix=".safetensors", dir=out_dir)
        os.close(fd)
        self.path = Path(name)
        size = self._data_start + cap
        self.recycled_bytes = min(take_spare(out_dir, self.path), size)
        try:
            fd = os.open(self.path, os.O_RDWR)
            try:
                os.ftruncate(fd, size)
                self._mm = mmap.mmap(fd, size)          # never empty: the header room is in it
            finally:
                os.close(fd)
        except BaseException:
            self.path.unlink(missing_ok=True)
            raise
        if self.recycled_bytes:
            self._populate(self.recycled_bytes - self.recycled_bytes % mmap.PAGESIZE)
        self._view = np.frombuffer(self._mm, dtype=np.uint8)

    def _populate(self, nbytes: int) -> None:
        populate(self._mm, nbytes)

    def add(self, name: str, dtype: str, shape: tuple[int, ...], offset: int, data: bytes,
            indices: bytes = b"") -> None:
        if indices:
            raise invalid(f"tensor {name!r}: a sparse chunk (TensorChunk.indices) in a full push; sparse chunks are "
                          "for delta pushes (header.base_version)")
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
            nbytes = math.prod(shape) * ITEMSIZE[dtype]
            ten = self._tensors[name] = ReceivedTensor(dtype, tuple(shape), self._cursor, nbytes)
            self._cursor += nbytes
        elif ten.dtype != dtype:
            raise invalid(f"tensor {name!r}: chunks disagree on dtype ({ten.dtype} then {dtype})")
        end = offset + len(data)
        if offset < 0 or end > ten.nbytes:
            raise invalid(f"tensor {name!r}: chunk [{offset}, {end}) runs past the tensor's {ten.nbytes} bytes")
        ten.cover(offset, end, name)
        at = self._data_start + ten.offset + offset
        self._view[at:at + len(data)] = np.frombuffer(data, dtype=np.uint8)     # numpy copies without the GIL
        self._validate_s += time.perf_counter() - t

    def finish(self) -> StagedWeights:
        """Check completeness and checksum, write the header: the file is then a safetensors file holding
        exactly the received tensors. On any error the file is given up (discard)."""
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
        header = _header_json({n: {"dtype": SAFETENSORS_CODE[x.dtype], "shape": list(x.shape),
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
        """Give up the staging file (the push failed or was cut): it becomes the spare. Call once no add()
        is running."""
        try:
            self._close()
        except BufferError:        # a copy still holds the map: it is unmapped once that ends
            pass
        recycle(self.path, self.out_dir)


def populate(mm: mmap.mmap, nbytes: int) -> None:
    """Map a recycled file's pages now instead of one fault per page later. mmap.madvise holds the GIL for the
    whole call (0.14 s for 600 MB here, over 0.5 s on a loaded CI machine: the event loop starved while
    this ran in a worker thread), so it goes in POPULATE_STEP pieces and the loop gets the GIL between them."""
    nbytes -= nbytes % mmap.PAGESIZE
    for start in range(0, nbytes, POPULATE_STEP):
        try:
            mm.madvise(MADV_POPULATE_WRITE, start, min(POPULATE_STEP, nbytes - start))
        except OSError:      # older kernels: the pages fault in on first write, still without zeroing
            return


def header_bytes(entries: dict) -> bytes:
    """A safetensors header for `entries` (name -> dtype code, shape, data_offsets), padded to 8 bytes."""
    header = _header_json(entries)
    return header + b" " * (-len(header) % 8)


def _layout(manifest: Manifest) -> tuple[int, int]:
    """(data bytes, header room) of a staging file for `manifest`: every tensor at its widest accepted dtype, and room
    for a header naming all of them. Computed once per manifest (an adapter push's config is parsed once too:
    WeightService.adapter_spec), as it cost milliseconds per push for an adapter's ~400 tensors."""
    layout = manifest.derived.get("staging")
    if layout is None:
        cap = sum(math.prod(spec.shape) * max(ITEMSIZE.get(d, 8) for d in manifest.allowed_dtypes(n))
                  for n, spec in manifest.tensors.items())       # 8: a checkpoint's int64 tensor (EAGLE-3 d2t)
        widest = {n: {"dtype": "BF16", "shape": list(spec.shape), "data_offsets": [cap, cap]}
                  for n, spec in manifest.tensors.items()}
        room = len(_header_json(widest)) + 8
        layout = manifest.derived["staging"] = (cap, room + -room % 8)
    return layout


def _header_json(entries: dict) -> bytes:
    return json.dumps(entries, separators=(",", ":")).encode()
