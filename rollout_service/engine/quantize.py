"""The served precision: float weights (what a trainer pushes) -> what a quantized engine serves.

`engine.quantization` = "int8": compressed-tensors W8A8 (int8 weights with one symmetric scale per output channel,
computed from the weights; int8 activations with a symmetric scale per token, computed by the kernel at every step;
oneDNN on CPU). vLLM 0.32 loads such a checkpoint but has no online int8 for linear layers, so this module makes the
checkpoint: `write_checkpoint` once at start-up (the float model's quantized copy, which the engines load), and
`quantized_items` at every commit, inside the worker that prepares the new version (engine/worker_ext.py). Both run
the same `quantize_int8`, so a version pushed by any path is served exactly as the same weights would be at
start-up. Embeddings, norms and the LM head stay in the engine's float dtype (compressed-tensors' usual `ignore`).

"fp8" and "mxfp8" are vLLM's own online quantization (GPU nodes): the engine loads float weights and its
process_weights_after_loading quantizes them, at start-up and again at every layerwise reload; nothing here runs.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

GPU_ONLY = {"fp8": "fp8_per_channel", "mxfp8": "mxfp8"}      # ours -> vLLM's online quantization name
INT8_MAX = 127
SCALE_SUFFIX = "_scale"                                      # "<module>.weight" -> "<module>.weight_scale"

# What GetStatus says each precision serves (Status.quantization).
DESCRIPTIONS = {
    "none": {"scheme": "", "weights": "", "activations": ""},
    "int8": {"scheme": "compressed-tensors w8a8",
             "weights": "int8, symmetric, one scale per output channel (absmax / 127 of the pushed weights, computed "
                        "at every commit); embeddings, norms and the LM head in dtype",
             "activations": "int8, symmetric, one scale per token, computed at every step"},
    "fp8": {"scheme": "vllm online fp8_per_channel",
            "weights": "float8_e4m3, one scale per output channel, computed by vLLM from the loaded float weights",
            "activations": "float8_e4m3, dynamic per-token scales"},
    "mxfp8": {"scheme": "vllm online mxfp8",
              "weights": "MXFP8 (float8_e4m3 with a shared power-of-two scale per 32 values), computed by vLLM",
              "activations": "MXFP8, dynamic"},
}


def describe(method: str, dtype: str, drafter_method: str = "", batch_invariant: bool = False) -> dict:
    """Status.quantization's fields for a server's configuration."""
    return {"method": method, **DESCRIPTIONS[method], "dtype": dtype, "drafter_method": drafter_method,
            "batch_invariant": batch_invariant}


def quantizes(name: str, ndim: int) -> bool:
    """Whether int8 quantizes this checkpoint tensor: the weight of every linear layer (2-D `.weight`), not the
    embeddings, the LM head or norms (compressed-tensors' ignore list: lm_head; embeddings are not Linear)."""
    return (ndim == 2 and name.endswith(".weight") and "embed" not in name and "lm_head" not in name
            and "norm" not in name)


def quantize_int8(w):
    """w: float [out, in] -> (q int8 [out, in], scale float32 [out, 1]) with w ~= q * scale (round to nearest,
    symmetric, per output channel). Computed in float32 whatever w's float dtype; an all-zero row gets a tiny scale."""
    import torch

    w = w.detach().to(torch.float32)
    scale = (w.abs().amax(dim=1, keepdim=True) / INT8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def quantized_items(items: Iterable, quantized: frozenset[str], dtype) -> Iterator:
    """(name, float tensor) -> what the quantized engine loads: for a name in `quantized`, (name, int8) and
    (name + "_scale", float32 scales); any other floating tensor cast to the engine's `dtype` (a bf16 trainer's
    embedding into a float32 engine; None: as they come)."""
    for name, t in items:
        if name in quantized:
            if not t.is_floating_point():
                raise ValueError(f"tensor {name!r}: the engine quantizes it to int8 and needs it as a float tensor, "
                                 f"got {t.dtype}")
            q, scale = quantize_int8(t)
            yield name, q
            yield name + SCALE_SUFFIX, scale
        elif dtype is not None and t.is_floating_point() and t.dtype != dtype:
            yield name, t.to(dtype)
        else:
            yield name, t


def compressed_tensors_config() -> dict:
    """config.json's quantization_config for int8 W8A8 (llm-compressor's W8A8 recipe: channel weights, dynamic
    per-token activations)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                  "dynamic": True},
        }},
    }


def quantized_names_of(served_dir: str | Path) -> frozenset[str]:
    """The float checkpoint names a quantized checkpoint serves in int8 (those with a `_scale` beside them)."""
    from safetensors import safe_open

    names: set[str] = set()
    for f in sorted(Path(served_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            names.update(fh.keys())
    return frozenset(n for n in names if n + SCALE_SUFFIX in names)


def write_checkpoint(src: str | Path, out: str | Path) -> Path:
    """The float checkpoint at `src`, quantized to int8 W8A8 into `out` (tokenizer and other files copied, config.json
    given quantization_config). A float model with a quantization_config of its own is refused."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    src, out = Path(src), Path(out)
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        raise ValueError(f"{src} is already quantized ({config['quantization_config'].get('quant_method')}); "
                         "engine.quantization quantizes a float checkpoint")
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copyfile(f, out / f.name)
    config["quantization_config"] = compressed_tensors_config()
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for i, f in enumerate(sorted(src.glob("*.safetensors"))):
        with safe_open(str(f), "pt") as fh:
            tensors = {name: fh.get_tensor(name) for name in fh.keys()}
        quantized = frozenset(n for n, t in tensors.items() if quantizes(n, t.ndim) and t.is_floating_point())
        pairs = quantized_items(tensors.items(), quantized, None)
        save_file({n: t.contiguous() for n, t in pairs}, str(out / f"model-{i:05d}.safetensors"),
                  metadata={"format": "pt"})
    return out


def _source_key(src: Path) -> str:
    """A float checkpoint's identity for the cache of its quantized copy: its path, config.json, and every weight
    file's size, inode and modification time (a rewritten checkpoint gets a new copy; no tensor is read)."""
    import hashlib

    h = hashlib.sha256(str(src.resolve()).encode())
    h.update((src / "config.json").read_bytes())
    for f in sorted(src.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_ino}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:16]


def served_checkpoint(src: str | Path, method: str) -> str:
    """The directory an engine loads for the served precision `method`: the float checkpoint itself (none; fp8 and
    mxfp8, which vLLM quantizes as it loads), or its int8 copy, written once (~1 s per 100 M parameters) under the
    service's cache directory and reused while the checkpoint is unchanged."""
    from rollout_service.models import cache_dir, cache_lock, replace_dir

    if method != "int8":
        return str(src)
    src = Path(src)
    out = cache_dir() / "quantized" / f"{src.name}-{_source_key(src)}-int8"
    if (out / "config.json").is_file():
        return str(out)
    import shutil
    import tempfile

    with cache_lock(out):
        if not (out / "config.json").is_file():                 # another preparer may have made it meanwhile
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
            try:
                write_checkpoint(src, tmp)
                replace_dir(tmp, out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return str(out)
