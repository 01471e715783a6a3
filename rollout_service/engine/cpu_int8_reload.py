"""vLLM's CPU int8 linear kernel after a weight reload (patch cpu_int8_reload_scales).

`CPUInt8ScaledMMLinearKernel.process_weights_for_onednn` builds a oneDNN handle (`kernel.dnnl_handler`) that keeps
a pointer to the weight scales it was given, not a copy. vLLM's layerwise reload processes a layer's freshly loaded
tensors and then copies their values into the layer's original tensors and puts those back
(`_copy_and_restore_kernel_tensors`): the tensors the handle points to are freed, and the reloaded layer computes
with whatever reuses that memory (measured: outputs of 1e29 after reloading a W8A8 layer's own weights). This keeps
the scales the handle was built from alive with the kernel (the same values as the layer's own)."""
from __future__ import annotations


def install() -> bool:
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel

    original = CPUInt8ScaledMMLinearKernel.process_weights_for_onednn
    if getattr(original, "_rollout", False):
        return True

    def process_weights_for_onednn(self, layer):
        original(self, layer)
        _, w_s_name, i_s_name, _, _ = self.layer_param_names
        self._rollout_handle_tensors = (getattr(layer, w_s_name), getattr(layer, i_s_name, None))

    process_weights_for_onednn._rollout = True
    CPUInt8ScaledMMLinearKernel.process_weights_for_onednn = process_weights_for_onednn
    return True
