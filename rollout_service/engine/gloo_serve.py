"""The `gloo` weight-transfer backend in vLLM's own server, without the service: on a CPU, where vLLM's `nccl`
engine cannot run, `vllm serve` (or `trl vllm-serve`, which runs it) takes a trainer's weights over gloo with

    vllm serve MODEL --worker-extension-cls rollout_service.engine.gloo_serve.GlooBackend \\
        --weight-transfer-config '{"backend": "gloo"}'

and VLLM_SERVER_DEV_MODE=1 for its weight-transfer endpoints. Each worker resolves the extension class before it
builds its weight-transfer engine; importing this module registers engine/gloo_transfer.py's engine with vLLM's
factory. The class adds no methods: nothing else of the service runs in that server. The trainer's side is
rollout_client/trl_gloo.py (TRL's NCCL calls swapped for gloo). bench/trl_grpo.py runs TRL's GRPO trainer so.
"""
from __future__ import annotations

from rollout_service.engine import gloo_transfer

gloo_transfer.register()


class GlooBackend:
    """vLLM worker extension whose import registers the gloo weight-transfer backend (no methods)."""
