"""A partial push loads whole engine layers (pool/layers.py): the tensors that share a fused vLLM layer."""
from rollout_service.pool.layers import completion, engine_layer

NAMES = [f"model.layers.{i}.{part}" for i in range(2) for part in (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "mlp.gate.weight", *(f"mlp.experts.{e}.{p}_proj.weight" for e in range(4)
                                                   for p in ("gate", "up", "down")))] + \
    ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight",
     "lm_head.weight", "model.embed_tokens.weight"]


def test_fused_layers():
    assert engine_layer("model.layers.3.mlp.experts.7.down_proj.weight") == "model.layers.3.mlp.experts"
    mixtral = "model.layers.3.block_sparse_moe.experts"
    assert engine_layer(f"{mixtral}.1.w2.weight") == mixtral
    assert engine_layer("model.layers.3.self_attn.k_proj.bias") == "model.layers.3.self_attn.qkv_proj"
    assert engine_layer("model.layers.3.mlp.up_proj.weight") == "model.layers.3.mlp.gate_up_proj"
    assert engine_layer("model.layers.3.mlp.gate.weight") == "model.layers.3.mlp.gate"        # the router: its own
    assert engine_layer("lm_head.weight") == "lm_head"


def test_a_push_of_some_experts_brings_the_rest_of_their_layer_only():
    pushed = ["model.layers.1.mlp.experts.2.gate_proj.weight", "model.layers.1.mlp.gate.weight"]
    extra = completion(pushed, NAMES)
    assert len(extra) == 4 * 3 - 1 and all(n.startswith("model.layers.1.mlp.experts.") for n in extra)
    assert completion(["model.layers.0.self_attn.q_proj.weight"], NAMES) == [
        "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"]
    assert completion(["model.layers.0.mlp.up_proj.weight"], NAMES) == ["model.layers.0.mlp.gate_proj.weight"]
    assert completion(NAMES, NAMES) == [] and completion(["lm_head.weight"], NAMES) == []
