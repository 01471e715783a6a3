"""Methods vLLM mixes into its worker processes (engine arg `worker_extension_cls`).

They run inside the worker that holds the model; the front end reaches them with
`AsyncLLM.collective_rpc("rollout_...", args=...)`. Arguments cross two process hops as msgpack, so
tensors travel as a safetensors file path (on /dev/shm where available), never as tensors.
Names are prefixed `rollout_` because vLLM forbids extension attributes that clash with Worker's.
"""
from __future__ import annotations

import logging

from rollout_service.speculation import cpu_fix

log = logging.getLogger(__name__)
# Imported by every vLLM worker after vLLM registered its CPU kernels: patch the rejection sampler's
# broken expansion here, only where the bug is detected.
CPU_SPEC_FIX_INSTALLED = cpu_fix.install()


class RolloutWorkerExtension:
    def rollout_cpu_fix_installed(self) -> bool:
        """Whether this worker runs with the CPU speculative sampling fix."""
        return CPU_SPEC_FIX_INSTALLED

    def rollout_load_weights(self, path: str, target: str = "policy") -> int:
        """Load every tensor of the safetensors file at `path` into the policy or the drafter.

        Uses vLLM's layerwise reload: on CPU the loaded linear weights are repacked into kernel format
        (the original parameters are emptied), so a plain load_weights would not reach the kernels.
        Returns the number of tensors loaded.
        """
        from safetensors import safe_open
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        if target == "policy":
            model, model_config = self.model_runner.get_model(), self.vllm_config.model_config
        elif target == "drafter":
            model = self.model_runner.get_draft_model()
            model_config = self.vllm_config.speculative_config.draft_model_config
        else:
            raise ValueError(f"unknown target {target!r}")
        with safe_open(path, "pt") as f:
            names = list(f.keys())
            tensors = ((n, f.get_tensor(n)) for n in names)
            with set_current_vllm_config(self.vllm_config):
                if target == "policy":
                    reload_weights(self.vllm_config, model, tensors, None, True)
                    _refresh_tied_head(model, model_config)
                else:
                    from vllm.model_executor.model_loader.reload import (
                        finalize_layerwise_reload, initialize_layerwise_reload)

                    initialize_layerwise_reload(model)
                    model.load_weights(tensors)
                    finalize_layerwise_reload(model, model_config)
                    _refresh_tied_head(model, model_config)
        return len(names)


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
