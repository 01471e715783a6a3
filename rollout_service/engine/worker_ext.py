"""Methods vLLM mixes into its worker processes (engine arg `worker_extension_cls`).

They run inside the worker that holds the model; the front end reaches them with
`AsyncLLM.collective_rpc("rollout_...", args=...)`. Arguments cross two process hops as msgpack, so
tensors travel as a safetensors file path (on /dev/shm where available), never as tensors.
Names are prefixed `rollout_` because vLLM forbids extension attributes that clash with Worker's.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import threading
import time
from dataclasses import dataclass

from rollout_service.engine import lifeline  # noqa: F401 - this worker's engine dies with the server
from rollout_service.engine import patches, quantize, shadow_reload

log = logging.getLogger(__name__)
# Imported by every vLLM worker after vLLM registered its CPU kernels: every patch that applies here, from the one
# registry (engine/patches.py); rollout_patch_report says what each did.
patches.install_all()


class RolloutWorkerExtension:
    def rollout_patch_report(self) -> list[dict]:
        """engine/patches.py's report for this worker (its model runner included)."""
        return patches.report(self.vllm_config)
    def rollout_load_weights(self, path: str, target: str = "policy") -> int:
        """Load every tensor of the safetensors file at `path` into the policy or the drafter, in place.

        Uses vLLM's layerwise reload: on CPU the loaded linear weights are repacked into kernel format
        (the original parameters are emptied), so a plain load_weights would not reach the kernels.
        Generation must be paused throughout. Used for rollback and restarts; commits prepare + swap.
        Returns the number of tensors loaded.
        """
        model, model_config = self._rollout_target(target)
        return _reload(self.vllm_config, model, model_config, lambda load: _from_files([path], load))[0]

    def rollout_freeze_startup_objects(self) -> None:
        """See _collect_previous_shadows: called once the engine is up, so commits never pay for it."""
        _collect_previous_shadows()

    def rollout_prepare_weights(self, paths: list[str], target: str, done_path: str) -> None:
        """Start loading `paths` into a shadow of the policy or drafter (engine/shadow_reload.py) in a
        background thread: this call returns at once and generation goes on meanwhile. When the thread
        ends it writes `done_path` (JSON: {"tensors": n} or {"error": "..."}); the front end watches for
        that file rather than polling with RPCs, which would keep this worker's message loop spinning on
        the cores the preparation needs. Then rollout_swap_weights (generation paused) applies the
        prepared weights, or rollout_discard_weights drops them."""
        self._rollout_prepare(target, done_path, lambda load: _from_files(paths, load), f"files {paths}")

    def rollout_transfer_prepare(self, update_info: dict, target: str, record_path: str, done_path: str) -> None:
        """rollout_prepare_weights, but the tensors arrive over the weight-transfer group (init_weight_transfer_engine,
        any registered backend: gloo here, nccl on GPU nodes) while generation goes on. The backend's transport is
        used as is; only its load target is the shadow. record_path (non-empty on one engine of the pool): also
        write the received tensors there as safetensors, the committed record restarts and rollbacks replay."""
        engine = self.weight_transfer_engine
        if engine is None:
            raise RuntimeError("this engine was started without a weight-transfer backend (engine.weight_transfer)")
        update_info = dict(update_info)
        fill = update_info.pop("rollout_fill", [])           # the committed rest of the layers the push touches
        typed = engine.parse_update_info(update_info)        # a malformed payload fails here, before anything starts

        def feed(load):
            from rollout_service.engine.record import Recorder

            recorder = Recorder(record_path, update_info) if record_path else None
            sink = _Sink(load, recorder)
            t0 = time.perf_counter()
            _receive_into(engine, typed, sink)
            if fill:                                         # after the pushed tensors: whole layers (layers.py)
                _from_files(fill, load)
            total = time.perf_counter() - t0
            return {"load_weights": sink.load_s, "record": sink.record_s,
                    "receive": total - sink.load_s - sink.record_s}
        self._rollout_prepare(target, done_path, feed, f"the {type(engine).__name__} group")

    def rollout_transfer_receive(self, update_info: dict, record_path: str, done_path: str) -> None:
        """Take part in a push over the weight-transfer group without loading what arrives into a model (a LoRA
        adapter's tensors: the front end makes the record a PEFT directory, which vLLM loads as a LoRA). Every rank of
        the group takes part in every broadcast; record_path (non-empty on one engine): write the tensors there as
        safetensors, elsewhere they are dropped once received. In a thread (generation goes on), reported through
        done_path like a preparation."""
        engine = self.weight_transfer_engine
        if engine is None:
            raise RuntimeError("this engine was started without a weight-transfer backend (engine.weight_transfer)")
        typed = engine.parse_update_info(dict(update_info))   # a malformed payload fails here, before anything starts

        def run():
            from rollout_service.engine.record import Recorder

            result: dict = {}
            t0 = time.perf_counter()
            try:
                sink = _Sink(lambda items: None, Recorder(record_path, update_info) if record_path else None)
                _receive_into(engine, typed, sink)
                result["tensors"] = len(update_info["names"])
                result["phases_s"] = {"record": sink.record_s, "receive": time.perf_counter() - t0 - sink.record_s}
            except BaseException as err:  # reported to the front end through done_path
                result["error"] = f"{type(err).__name__}: {err}"
                log.exception("receiving tensors over the weight-transfer group failed")
            _report(done_path, result)
        threading.Thread(target=run, name="rollout-transfer-receive", daemon=True).start()

    def rollout_transfer_init(self, init_info: dict, done_path: str) -> None:
        """vLLM's init_weight_transfer_engine in a thread: the rendezvous waits for the trainer's ranks (up to the
        group's timeout), and generation must not stop meanwhile. Reports through done_path like a preparation."""
        engine = self.weight_transfer_engine
        if engine is None:
            raise RuntimeError("this engine was started without a weight-transfer backend (engine.weight_transfer)")
        typed = engine.parse_init_info(init_info)           # a malformed payload fails here
        joining = getattr(self, "_rollout_joining", None)
        if joining is not None and joining.is_alive():      # one join at a time: it ends at its timeout
            _report(done_path, {"error": "RuntimeError: this worker is still joining an earlier weight-transfer "
                                         "group (abandoned; it ends at that group's timeout_s)"})
            return

        def run():
            result: dict = {}
            try:
                engine.init_transfer_engine(typed)
            except BaseException as err:  # reported to the front end through done_path
                result["error"] = f"{type(err).__name__}: {err}"
                log.warning("joining the weight-transfer group failed: %s", result["error"])
            _report(done_path, result)
        self._rollout_joining = threading.Thread(target=run, name="rollout-transfer-init", daemon=True)
        self._rollout_joining.start()

    def _rollout_prepare(self, target: str, done_path: str, feed, source: str) -> None:
        self.rollout_discard_weights()
        model, model_config = self._rollout_target(target)
        job = _Prepare(target)

        def run():
            result: dict = {}
            shadow = None
            try:
                t0 = time.perf_counter()
                _collect_previous_shadows()
                t1 = time.perf_counter()
                shadow = shadow_reload.make_shadow(model)
                t2 = time.perf_counter()
                result["tensors"], phases = _reload(self.vllm_config, shadow.root, model_config, feed)
                result["phases_s"] = {"gc": t1 - t0, "shadow": t2 - t1, "load": time.perf_counter() - t2, **phases}
                job.shadow = shadow
            except BaseException as err:  # reported to the front end through done_path
                if shadow is not None:
                    shadow_reload.release(shadow)
                result["error"] = f"{type(err).__name__}: {err}"
                log.exception("preparing %s weights from %s failed", target, source)
            finally:
                _report(done_path, result)
        self._rollout_pending = job
        job.thread = threading.Thread(target=run, name="rollout-prepare-weights", daemon=True)
        job.thread.start()

    def rollout_swap_weights(self, target: str = "policy") -> None:
        """Make the prepared weights the served ones (call with generation paused)."""
        job = getattr(self, "_rollout_pending", None)
        if job is None or job.shadow is None or job.target != target:
            raise RuntimeError(f"no prepared {target} weights to swap in")
        self._rollout_pending = None
        try:
            shadow_reload.swap(job.shadow)
        finally:
            shadow_reload.release(job.shadow)    # the next preparation collects any rest

    def rollout_discard_weights(self) -> None:
        """Drop prepared weights (waits for a preparation still running)."""
        job = getattr(self, "_rollout_pending", None)
        self._rollout_pending = None
        if job is not None and job.thread is not None:
            job.thread.join()
        if job is not None and job.shadow is not None:
            shadow_reload.release(job.shadow)
            _collect_previous_shadows()

    def _rollout_target(self, target: str):
        if target == "policy":
            return self.model_runner.get_model(), self.vllm_config.model_config
        if target == "drafter":
            return (self.model_runner.get_draft_model(),
                    self.vllm_config.speculative_config.draft_model_config)
        raise ValueError(f"unknown target {target!r}")


_frozen = False


def _receive_into(engine, typed, sink: "_Sink") -> None:
    """One push over the weight-transfer group, every tensor handed to `sink` as it arrives (closed after, also when
    the receive fails); on accelerators the device is synchronized before the tensors count as received."""
    engine.set_weight_update_target(sink, None)
    try:
        engine.receive_weights(typed)
        if torch_accelerated():
            import torch

            torch.accelerator.synchronize()
    finally:
        engine.reset_weight_update_target()
        sink.close()


def _report(done_path: str, result: dict) -> None:
    tmp = f"{done_path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, done_path)


def _collect_previous_shadows() -> None:
    """Free what earlier commits' shadows left in reference cycles (release() breaks the ones it knows
    of, vLLM's loaders make more; without this the worker grew ~0.3 GB per push, bench/weight_push.py's
    memory line). A full collection over everything vLLM built at start-up took ~0.4 s, so the first
    call (at engine start-up: rollout_freeze_startup_objects) freezes those objects (gc.freeze: they live as
    long as the worker) and later collections only traverse what was made since: ~3 ms."""
    global _frozen
    if not _frozen:
        gc.collect()
        gc.freeze()
        _frozen = True
    gc.collect()


@dataclass
class _Prepare:
    target: str
    thread: threading.Thread | None = None
    shadow: object = None


def _from_files(paths: list[str], load) -> None:
    from safetensors import safe_open

    def tensors():
        for path in paths:
            with safe_open(path, "pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
    load(tensors())


class _Sink:
    """What a weight-transfer backend loads into (its `model`): the recorder if any, then the reload's load. (The
    record written beside the load in a thread of its own did not pay on 2 cores: both are memory-bound.)"""

    def __init__(self, load, recorder):
        self.load, self.recorder = load, recorder
        self.load_s = self.record_s = 0.0            # where the receive's time goes (the rest: waiting for bytes)

    def load_weights(self, items):
        items = list(items)
        t0 = time.perf_counter()
        if self.recorder is not None:
            self.recorder.write(items)
        t1 = time.perf_counter()
        self.load(items)
        self.record_s += t1 - t0
        self.load_s += time.perf_counter() - t1

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.close()


def torch_accelerated() -> bool:
    import torch

    return torch.cuda.is_available()


def _reload(vllm_config, model, model_config, feed) -> tuple[int, dict]:
    """vLLM's layerwise reload into `model` (served or shadow): feed(load) calls load(iterable of (name, tensor))
    once or more, and may return a dict of its phases' seconds. Returns the tensor count and the phases."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                         initialize_layerwise_reload)

    count = 0

    def counted(items):
        nonlocal count
        for item in items:
            count += 1
            yield item

    quantized = _quantized_names(model_config)

    def load(items):
        if quantized:                     # the served precision: int8 tensors and scales from the pushed floats
            items = quantize.quantized_items(items, quantized, model_config.dtype)
        model.load_weights(counted(items))
    with set_current_vllm_config(vllm_config):
        initialize_layerwise_reload(model)
        phases = feed(load) or {}
        t = time.perf_counter()
        _finalize_noted(lambda: finalize_layerwise_reload(model, model_config))
        _refresh_tied_head(model, model_config)
        phases["finalize"] = time.perf_counter() - t
    return count, phases


_quantized_cache: dict[str, frozenset[str]] = {}


def _quantized_names(model_config) -> frozenset[str]:
    """The checkpoint names this model serves in int8 (engine.quantization = int8: the served checkpoint is
    engine/quantize.py's, with a `<name>_scale` beside each); empty for a float model, and for vLLM's own online
    quantization (fp8, mxfp8: its process_weights_after_loading quantizes the floats loaded)."""
    path = str(model_config.model)
    if path not in _quantized_cache:
        qc = getattr(model_config.hf_config, "quantization_config", None) or {}
        ours = isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors"
        _quantized_cache[path] = quantize.quantized_names_of(path) if ours else frozenset()
    return _quantized_cache[path]


class _ReloadNotes(logging.Filter):
    """vLLM's layerwise reload warns "<layer>: Failed to load weights" once per layer a push sent nothing for. Some
    get nothing on every push, by design: rotary embeddings (their cos/sin cache is computed, never in a checkpoint)
    and, with tied embeddings, ParallelLMHead (the head is the embedding's weight, refreshed by _refresh_tied_head);
    a partial push leaves out whatever it does not carry. While one of our reloads finalizes, those warnings are
    collected here instead (`kept`) and said as one line by _explain_kept."""

    def __init__(self):
        super().__init__()
        self.kept: list[str] | None = None      # a list while one of our reloads finalizes

    def filter(self, record: logging.LogRecord) -> bool:
        if self.kept is None or record.msg != "%s: Failed to load weights" or not record.args:
            return True
        self.kept.append(str(record.args[0]))
        return False


_notes = _ReloadNotes()
_explained = False


def _layerwise_logger() -> logging.Logger:
    """The logger vLLM's layerwise reload warns on: its module's own object, not a lookup by name (a library that
    replaces logging's manager, as AReaL's logging does, makes getLogger(name) return a different object)."""
    from vllm.model_executor.model_loader.reload import layerwise
    return layerwise.logger


def _finalize_noted(finalize) -> list[str]:
    """Run vLLM's finalize_layerwise_reload (`finalize()`), its per-layer "Failed to load weights" warnings collected
    and explained: the expected ones (rotary embeddings, a tied head) in one line once per process, any others in
    one line per push (a partial push leaves those layers as they were). Returns the layers that got nothing."""
    global _explained
    layerwise = _layerwise_logger()
    layerwise.addFilter(_notes)                                    # (once: addFilter keeps one copy)
    _notes.kept = []
    disabled, layerwise.disabled = layerwise.disabled, False     # a logging config may have disabled it: collect
    level = layerwise.level
    if not layerwise.isEnabledFor(logging.WARNING):
        layerwise.setLevel(logging.WARNING)                        # (collected here, said by us or not at all)
    try:
        finalize()
    finally:
        kept, _notes.kept = _notes.kept, None
        layerwise.disabled = disabled
        layerwise.setLevel(level)
    expected = [k for k in kept if k.endswith("RotaryEmbedding") or k == "ParallelLMHead"]
    others = [k for k in kept if k not in expected]
    if expected and not _explained:
        _explained = True
        # once per worker, at WARNING: a worker's own loggers show nothing below it (no handler: Python's last resort)
        log.warning("weight reloads leave rotary embeddings (computed, not weights) and a tied LM head (it is the "
                    "embedding's weight) untouched, as they should; vLLM's \"Failed to load weights\" warnings for "
                    "them are not shown")
    if others:
        counts = {k: others.count(k) for k in dict.fromkeys(others)}
        log.warning("this push carried no tensors for %d layers, which keep their previous weights (as a partial "
                    "push intends): %s", len(others), ", ".join(f"{k} x{n}" for k, n in counts.items()))
    return kept


def _refresh_tied_head(model, model_config) -> None:
    """With tied embeddings the head shares the embedding's weight, but on CPU it keeps its own packed
    copy for the GEMM. Layerwise reload re-packs only the layers it loaded, so a push that carries the
    embedding without touching the head would leave the head stale: re-pack it from the shared weight.
    Covered by tests/integration/test_tied_push.py."""
    if not getattr(model_config.hf_config, "tie_word_embeddings", False):
        return
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if head is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)
