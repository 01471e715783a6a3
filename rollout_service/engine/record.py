"""Write tensors received over a weight-transfer group into a safetensors file as they arrive (inside a vLLM
worker): the committed record that restarts and rollbacks replay, as a streamed push's staging file is.

The file is laid out from the push's metadata before the first byte arrives (header, then each tensor at its
offset), so each received tensor is one pwrite at its offset (the kernel's copy: a mapped file took 0.15-0.2 s
per 269 MB here in page-table faults alone). A tensor of the wrong dtype or shape raises.
"""
from __future__ import annotations

import json
import math
import os

from rollout_service.wire import ITEMSIZE, SAFETENSORS_CODE


class Recorder:
    def __init__(self, path: str, update_info: dict):
        names, dtypes, shapes = update_info["names"], update_info["dtype_names"], update_info["shapes"]
        header, offset = {}, 0
        self.where: dict[str, tuple[int, int, str, tuple[int, ...]]] = {}
        for name, dtype, shape in zip(names, dtypes, shapes):
            if dtype not in ITEMSIZE:
                raise ValueError(f"tensor {name!r}: dtype {dtype!r} cannot be recorded (one of {sorted(ITEMSIZE)})")
            size = math.prod(shape) * ITEMSIZE[dtype]
            header[name] = {"dtype": SAFETENSORS_CODE[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            self.where[name] = (offset, size, dtype, tuple(shape))
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.base = 8 + len(raw)
        self.path = path
        # no O_TRUNC: the front end hands over the recycled spare file when it has one (scratch.take_spare), whose
        # pages are allocated already; ftruncate keeps them up to the new size
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(self.fd, self.base + offset)
        os.pwrite(self.fd, len(raw).to_bytes(8, "little") + raw, 0)

    def write(self, items) -> None:
        import torch

        for name, t in items:
            off, size, dtype, shape = self.where[name]
            if str(t.dtype).removeprefix("torch.") != dtype or tuple(t.shape) != shape:
                raise ValueError(f"tensor {name!r} arrived as {t.dtype} {list(t.shape)}, "
                                 f"announced {dtype} {list(shape)}")
            data = memoryview(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
            written = 0
            while written < size:
                written += os.pwrite(self.fd, data[written:], self.base + off + written)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
