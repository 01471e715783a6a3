"""What a LoRA adapter push may contain (PEFT's format), checked against the served model before a byte is applied.

An adapter is PEFT's `adapter_config.json` (r, lora_alpha, target_modules, ...) and its tensors
`base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r] for linear modules of the decoder
layers (`model.layers.<i>.<...>`, whose base weight is [out, in]). From the config and the base model's manifest this
module builds the adapter's own Manifest (every tensor it must carry, with its shape), so the push path's Stager and
LoadWeights' header checks validate an adapter exactly as they validate base weights. Everything vLLM 0.32 refuses
(DoRA, LoRA bias, modules_to_save, ranks above max_lora_rank) is refused here first, naming the field.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import grpc

from rollout_service.engine.types import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
from rollout_service.errors import ServiceError, invalid_field
from rollout_service.weights.manifest import Manifest, TensorSpec

PREFIX = "base_model.model."
MAX_CONFIG_BYTES = 64 << 10
LAYER = re.compile(r"model\.layers\.\d+\.")      # decoder layers (Llama, Qwen, Mistral, ...)
CONFIG_FILE, WEIGHTS_FILE = ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE


@dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter config: its rank, the modules it adapts and the manifest of its tensors."""

    config: dict                 # PEFT's adapter_config.json, as given
    rank: int
    modules: list[str]           # base modules adapted ("model.layers.0.self_attn.q_proj", ...)
    manifest: Manifest

    @property
    def target_modules(self) -> list[str]:
        return sorted({m.rsplit(".", 1)[-1] for m in self.modules})

    @property
    def num_bytes(self) -> int:
        from rollout_service.wire import ITEMSIZE

        total = 0
        for spec in self.manifest.tensors.values():
            n = 1
            for d in spec.shape:
                n *= d
            total += n * ITEMSIZE[spec.dtype]
        return total


def _matches(module: str, targets) -> bool:
    """PEFT's rule: a list matches a module whose name is an entry or ends with '.' + entry; a string is a regex
    the whole name must match."""
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith("." + t) for t in targets)


def parse_config(text: str | bytes, base: Manifest, max_rank: int, field: str, rpc: str = "") -> AdapterSpec:
    """PEFT's adapter_config.json -> AdapterSpec, or INVALID_ARGUMENT naming `field` and what is wrong."""
    def bad(why: str) -> ServiceError:
        return invalid_field(field, why, sep=" ", rpc=rpc)

    if len(text) > MAX_CONFIG_BYTES:
        raise bad(f"is {len(text)} bytes; an adapter_config.json is at most {MAX_CONFIG_BYTES}")
    try:
        config = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"is not JSON (PEFT's adapter_config.json): {e}") from None
    if not isinstance(config, dict):
        raise bad("must be a JSON object (PEFT's adapter_config.json)")
    if config.get("peft_type", "LORA") != "LORA":
        raise bad(f"peft_type {config.get('peft_type')!r}: only LORA adapters are served")
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise bad(f"r (the LoRA rank) must be a positive integer, got {r!r}")
    if r > max_rank:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"{rpc + ': ' if rpc else ''}{field}: rank r={r} exceeds the server's engine.lora.max_rank="
                           f"{max_rank}; train a smaller adapter or restart the server with --max-lora-rank")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise bad(f"lora_alpha must be a positive number, got {alpha!r}")
    for key, why in (("use_dora", "DoRA is not served by vLLM"), ("modules_to_save", "modules_to_save (full copies "
                     "of base modules) are not served; adapt them with LoRA instead"),
                     ("rank_pattern", "per-module ranks (rank_pattern) are not served"),
                     ("alpha_pattern", "per-module alphas (alpha_pattern) are not served"),
                     ("layers_to_transform", "layers_to_transform is not served; name the modules in "
                                             "target_modules instead"),
                     ("lora_bias", "LoRA bias is not served by vLLM")):
        if config.get(key):
            raise bad(f"{key}: {why}")
    if config.get("bias", "none") != "none":
        raise bad(f"bias {config.get('bias')!r}: only 'none' is served (vLLM has no LoRA bias)")
    targets = config.get("target_modules")
    if not targets or not (isinstance(targets, str) or (isinstance(targets, list) and
                                                        all(isinstance(t, str) for t in targets))):
        raise bad("target_modules must name the modules adapted (a list of names or a regex string)")
    linear = {n[:-len(".weight")]: spec for n, spec in base.tensors.items()
              if n.endswith(".weight") and len(spec.shape) == 2}
    modules = sorted(m for m in linear if _matches(m, targets))
    outside = [m for m in modules if not LAYER.match(m)]
    if outside:
        raise bad(f"target_modules reach {outside[0]!r}: only linear modules of the decoder layers "
                  "(model.layers.<i>...) are served with LoRA")
    if not modules:
        raise bad(f"target_modules {targets!r} match no linear module of the served model (for example "
                  f"{sorted({m.rsplit('.', 1)[-1] for m in linear if LAYER.match(m)})})")
    tensors = {}
    for m in modules:
        out_dim, in_dim = linear[m].shape
        dtype = linear[m].dtype
        tensors[f"{PREFIX}{m}.lora_A.weight"] = TensorSpec(dtype, (r, in_dim))
        tensors[f"{PREFIX}{m}.lora_B.weight"] = TensorSpec(dtype, (out_dim, r))
    return AdapterSpec(config, r, modules, Manifest(tensors, frozenset(), base.serving_dtype))


def check_size(num_bytes: int, max_mb: float, where: str) -> None:
    limit = int(max_mb * (1 << 20))
    if num_bytes > limit:
        raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{where}: the adapter holds {num_bytes} bytes of tensors, above the server's "
                           f"engine.lora.max_adapter_mb={max_mb:g} ({limit} bytes); push a smaller adapter (lower "
                           "rank or fewer target_modules) or raise --max-adapter-mb")


def write_dir(folder: Path, config: dict, weights: Path, keep: bool, durable: bool = False) -> Path:
    """A PEFT adapter directory vLLM loads: `folder`/adapter_config.json and adapter_model.safetensors (moved from
    `weights`, or copied with keep=True). durable: the files, the folder and its two parents (the adapter's and the
    adapters' folders) fsynced, so a record naming it may follow. Blocking: call it in a thread."""
    import shutil

    from rollout_service.durable import fsync_path

    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_FILE).write_text(json.dumps(config))
    if keep:
        shutil.copyfile(weights, folder / WEIGHTS_FILE)
    else:
        shutil.move(weights, folder / WEIGHTS_FILE)
    if durable:
        for path in (folder / CONFIG_FILE, folder / WEIGHTS_FILE, folder, folder.parent, folder.parent.parent):
            fsync_path(path)
    return folder
