"""vLLM's CPU mixture-of-experts kernel after a weight reload (patch cpu_moe_reload_prepack).

`UnquantizedFusedMoEMethod._setup_kernel` runs the experts' own `process_weights_after_loading` (on CPU:
`cpu_prepack_moe_weight`, the grouped-GEMM layout the `cpu_fused_moe` kernel reads) only on the first load; on a
weight update it copies the new weights in and skips it, so after any reload (layerwise, in place or in a shadow) the
CPU kernel reads checkpoint-layout weights as if packed: every expert's output is wrong (measured: the same
checkpoint reloaded moved log-probs by 0.09 nats on a tiny Qwen3-MoE). GPU experts' hook is a no-op there. This runs
the hook on updates too, for CPU experts only."""
from __future__ import annotations


def install() -> bool:
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    original = UnquantizedFusedMoEMethod._setup_kernel
    if getattr(original, "_rollout", False):
        return True

    def _setup_kernel(self, layer, w13, w2):
        update = self.moe_kernel is not None
        original(self, layer, w13, w2)
        experts = getattr(self.moe_kernel, "fused_experts", None)
        if update and isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(layer)      # the prepack the first load ran

    _setup_kernel._rollout = True
    UnquantizedFusedMoEMethod._setup_kernel = _setup_kernel
    return True
