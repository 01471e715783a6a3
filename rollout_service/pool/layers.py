"""Which checkpoint tensors load into one engine layer, so that a partial push loads whole layers.

vLLM's layerwise reload (engine/worker_ext.py `_reload`) rebuilds a layer from nothing once it was sent any of its
weights: whatever the push leaves out of that layer is uninitialised memory, not the served value. A layer of vLLM
often fuses several checkpoint tensors: q/k/v into qkv_proj, gate/up into gate_up_proj, and every expert of a
mixture-of-experts layer into one FusedMoE (w13 and w2 for all experts). So a push of some experts, or of q_proj
alone, must carry the committed values of the rest of those layers: `completion` names them, and the committer
adds their values (pool/committed.py values_file) to what the engines load. Those values are not a new commit:
only the pushed tensors are recorded.
"""
from __future__ import annotations

import re

# checkpoint tensor name -> the vLLM module it loads into (the first match wins; else the name's module)
_FUSED = (
    (re.compile(r"^(.*\.(?:mlp|block_sparse_moe))\.experts\.\d+\.[^.]+\.weight$"), r"\1.experts"),
    (re.compile(r"^(.*\.self_attn)\.[qkv]_proj\.(?:weight|bias)$"), r"\1.qkv_proj"),
    (re.compile(r"^(.*\.mlp)\.(?:gate|up)_proj\.weight$"), r"\1.gate_up_proj"),
)


def engine_layer(name: str) -> str:
    """The engine module a checkpoint tensor loads into."""
    for pattern, layer in _FUSED:
        if pattern.match(name):
            return pattern.sub(layer, name)
    return name.rsplit(".", 1)[0]


def completion(names, all_names) -> list[str]:
    """The checkpoint tensors not in `names` that load into a layer some of `names` load into (sorted)."""
    touched = {engine_layer(n) for n in names}
    given = set(names)
    return sorted(n for n in all_names if n not in given and engine_layer(n) in touched)
