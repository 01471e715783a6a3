"""LoRA adapters for the integration tests (test_lora.py, test_ray.py): PEFT adapters over the tiny model with random
A and B, the independent reference (the base with the adapter merged, in transformers), and the check of served
log-probs against it."""
import copy

import numpy as np
import torch

from rollout_service.drafting.reference import processed_logprobs

PROMPTS = [[1, 504, 3458, 314, 260], [1, 1046, 2683, 77]]
RANK = 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_dir, seed: int, r: int = RANK, targets=TARGETS):
    """A PEFT LoRA model over the tiny base with random A and B (PEFT starts B at zero: an adapter that changes
    nothing would prove nothing)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    return model.eval()


def merged(peft_model, base):
    """An independent transformers model: `base` (a transformers model) with the adapter's weights merged in."""
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    m = get_peft_model(copy.deepcopy(base), copy.deepcopy(peft_model.peft_config["default"]))
    set_peft_model_state_dict(m, get_peft_model_state_dict(peft_model))
    return m.merge_and_unload().eval()


def check(samples, reference, prompts=PROMPTS, temperature=1.0, atol=1e-3):
    for p, group in enumerate(samples):
        for s in group:
            ref = processed_logprobs(reference, prompts[p], s.token_ids.tolist(), temperature, 0, 1.0)
            np.testing.assert_allclose(s.logprobs, ref.numpy(), atol=atol, rtol=0)
