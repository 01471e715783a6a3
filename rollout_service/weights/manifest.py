"""What a push may contain: the served checkpoint's tensor names, shapes and dtypes (read from the
safetensors headers only; nothing is loaded)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from rollout_service.errors import invalid
from rollout_service.weights.paths import open_regular
from rollout_service.wire import FROM_SAFETENSORS_CODE



FLOAT_DTYPES = frozenset({"float32", "bfloat16", "float16"})


@dataclass(frozen=True)
class TensorSpec:
    dtype: str                 # contract dtype name ("bfloat16", ...)
    shape: tuple[int, ...]


@dataclass
class Manifest:
    tensors: dict[str, TensorSpec]
    ignored: frozenset[str]    # names a trainer's state_dict carries that the checkpoint does not (tied lm_head)
    serving_dtype: str         # the dtype the engine computes in (a push may also use this dtype)
    quantized: bool = False    # served quantized (engine.quantization): the engine converts any float push
    # values derived from the above, computed once (staging.Stager's file layout); never part of a comparison
    derived: dict = field(default_factory=dict, compare=False, repr=False)

    def allowed_dtypes(self, name: str) -> set[str]:
        own = {self.tensors[name].dtype, self.serving_dtype}
        if self.quantized and own <= FLOAT_DTYPES:
            return set(FLOAT_DTYPES)
        return own

    def check_tensor(self, name: str, dtype: str, shape: tuple[int, ...], where: str = "") -> bool:
        """Raise INVALID_ARGUMENT unless `name` is a model tensor of this shape and an accepted dtype.
        Returns False for names that are accepted but ignored (a tied lm_head)."""
        if name in self.ignored:
            return False
        spec = self.tensors.get(name)
        if spec is None:
            raise invalid(f"{where}tensor {name!r} is not a parameter of the served model (names follow the "
                          "Hugging Face state dict of the checkpoint)")
        if tuple(shape) != spec.shape:
            raise invalid(f"{where}tensor {name!r}: shape {list(shape)} does not match the model's "
                          f"{list(spec.shape)}")
        allowed = self.allowed_dtypes(name)
        if dtype not in allowed:
            raise invalid(f"{where}tensor {name!r}: dtype {dtype!r} not accepted; send one of {sorted(allowed)}")
        return True

    def check_complete(self, names, partial: bool, where: str = "") -> bool:
        """Raise unless `names` cover the model (or `partial`) and hold at least one model tensor.
        Returns True when some model tensors are missing (a partial push)."""
        missing = sorted(set(self.tensors) - set(names))
        if missing and not partial:
            raise invalid(f"{where}{len(missing)} of the model's tensors are missing (first: {missing[0]!r}); "
                          "send all of them or set partial=true")
        if not set(names) & set(self.tensors):
            raise invalid(f"{where}no tensor of the served model found")
        return bool(missing)


def safetensors_files(path: Path) -> list[Path]:
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file at {path}")
    return files


MAX_HEADER_BYTES = 100_000_000     # the safetensors format's own limit


def read_headers(files: list[Path]) -> dict[str, tuple[TensorSpec, int]]:
    """name -> (spec, byte size), from the safetensors headers of `files` (no tensor data is read).
    A file that is not safetensors raises ValueError naming it (never reads an absurd length)."""
    out = {}
    for f in files:
        try:
            with open_regular(f) as fh:         # a FIFO or device named *.safetensors is refused, never read
                size = os.fstat(fh.fileno()).st_size
                n = int.from_bytes(fh.read(8), "little")
                if size < 8 or n > min(size - 8, MAX_HEADER_BYTES):
                    raise ValueError("bad header length")
                header = json.loads(fh.read(n))
            for name, meta in header.items():
                if name != "__metadata__":
                    start, end = meta["data_offsets"]
                    spec = TensorSpec(FROM_SAFETENSORS_CODE.get(meta["dtype"], str(meta["dtype"]).lower()),
                                      tuple(int(d) for d in meta["shape"]))
                    out[name] = (spec, int(end) - int(start))
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
            raise ValueError(f"{f} is not a readable safetensors file ({e})") from None
    return out


def read_manifest(model_dir: str | Path, serving_dtype: str, quantized: bool = False) -> Manifest:
    model_dir = Path(model_dir)
    tensors = {name: spec for name, (spec, _) in read_headers(safetensors_files(model_dir)).items()}
    config = json.loads((model_dir / "config.json").read_text()) if (model_dir / "config.json").exists() else {}
    ignored = frozenset({"lm_head.weight"}) if config.get("tie_word_embeddings") and \
        "lm_head.weight" not in tensors else frozenset()
    return Manifest(tensors, ignored, serving_dtype, quantized)
