"""Online drafter adaptation: the drafter learns from the policy's training forward pass.

The policy's logits on the rollout tokens are computed anyway for the GRPO loss; `learn` takes them
(detached) and takes a distillation step of the drafter toward them: KL(policy || drafter) on the generated
positions. The drafter therefore follows the policy as RL moves it, and the trainer pushes it to the
service with `UpdateDraft` every few steps.

The drafter here is a `draft_model` (a small causal LM sharing the policy's tokenizer), which learns from
input ids and the policy's logits; an EAGLE-3 head (not built yet) would also take the hidden states of its
three feature layers from the same forward pass (`output_hidden_states=True`). Only the drafter's decoder layers and
final norm are
trained and pushed (a partial update): its embeddings and head stay those it was built with.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from rollout_client.launcher import run_command


def build_initial_drafter(policy_dir: str, out: Path, layers: int = 2) -> Path:
    """A drafter made of the policy's first `layers` decoder layers (its embeddings, norm and head):
    `rollout-service prepare-drafter --epochs 0`, seconds to build (cached in `out`), weak until it is
    distilled (offline with `rollout-service prepare-drafter`, or online)."""
    return Path(run_command("prepare-drafter", "--model", policy_dir, "--out", str(out),
                            "--layers", str(layers), "--epochs", "0"))


class OnlineDrafter:
    def __init__(self, drafter_dir: str | Path, *, lr: float = 1e-4):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(drafter_dir), dtype=torch.float32)
        self.trainable = {n: p for n, p in self.model.named_parameters()
                          if n.startswith("model.layers.") or n.startswith("model.norm.")}
        for n, p in self.model.named_parameters():
            p.requires_grad = n in self.trainable
        self.opt = torch.optim.AdamW(list(self.trainable.values()), lr=lr, weight_decay=0.0)
        self.losses: list[float] = []

    def learn(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, gen_mask: torch.Tensor,
              policy_logits: torch.Tensor, num_tokens: int, temperature: float = 1.0) -> None:
        """input_ids, attention_mask [B, L]; gen_mask [B, L-1]; policy_logits [B, L-1, V] (detached).
        Both distributions at the sampling temperature (vLLM drafts and verifies at it), so acceptance is
        what the KL is taken over. Accumulates gradients for one micro-batch; `step()` applies them."""
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        d_logp = F.log_softmax(logits[gen_mask].float() / temperature, -1)
        p_logp = F.log_softmax(policy_logits[gen_mask].float() / temperature, -1)
        loss = F.kl_div(d_logp, p_logp, log_target=True, reduction="sum") / max(num_tokens, 1)
        loss.backward()
        self.losses.append(float(loss.detach()))

    def step(self) -> float:
        """Apply the accumulated gradients; returns the batch's KL(policy || drafter) per token."""
        torch.nn.utils.clip_grad_norm_(list(self.trainable.values()), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        kl, self.losses = sum(self.losses), []
        return kl

    def weights(self) -> dict[str, torch.Tensor]:
        """The tensors a partial UpdateDraft sends."""
        return {n: p.detach() for n, p in self.trainable.items()}
