"""Online drafter adaptation: the drafter learns from the policy's training forward pass.

The policy's logits on the rollout tokens are computed anyway for the GRPO loss; `learn` takes them
(detached) and takes a distillation step of the drafter toward them: KL(policy || drafter) on the generated
positions. The drafter therefore follows the policy as RL moves it, and the trainer pushes it to the
service with `UpdateDraft` every few steps.

Two drafters learn so:
- `OnlineDrafter`, a `draft_model` (a small causal LM sharing the policy's tokenizer), from input ids and the
  policy's logits. Only its decoder layers and final norm are trained and pushed (a partial update): its
  embeddings and head stay those it was built with.
- `OnlineEagle3Head`, an EAGLE-3 head, from the hidden states entering its three feature layers and the
  policy's logits, both from the same forward pass (`output_hidden_states=True`) of pi_old: the recompute's and
  the first minibatch's training pass. It trains with the step of `rollout-service prepare-drafter --kind eagle3`
  (rollout_service/drafting/eagle3.py: one loss, one step), on the step's own samples, inline in sync mode or in
  a background thread in async mode (while the next batch generates), and is pushed as the float tensors of its
  model.safetensors (partial; `d2t` stays).
"""
from __future__ import annotations

import threading
import time
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


class OnlineEagle3Head:
    """An EAGLE-3 head (vLLM format, as `prepare-drafter --kind eagle3` saves it) that follows the policy.

    Per step: `collect` the features of each forward pass of pi_old over the step's samples (cheap: the hidden
    states are computed anyway; this keeps copies of the three feature layers and the top-k of the policy's
    distribution at the sampling temperature), then `adapt()`: a pass of `eagle3.train_step` over those samples in
    batches of `batch` rows. Sync (`background=False`): at once, on the critical path. Async: handed to a worker
    thread, which trains while the trainer pushes the policy and the next batch generates; the next `adapt()`
    waits for it first (one job in flight), so the head pushed at a step is the one trained on the previous step's
    samples. Every `adapt()` returns the tensors to push (a snapshot, the worker never writes them) and the cost.
    The head's embeddings are the policy's (vLLM shares them), snapshotted when a step's first features arrive.
    Its own random generator: adapting draws nothing from the policy's."""

    def __init__(self, head_dir: str | Path, policy, *, lr: float = 1e-4, steps: int = 3, temperature: float = 1.0,
                 batch: int = 8, epochs: int = 1, background: bool = False, seed: int = 0, max_rows: int = 0):
        from rollout_service.drafting import eagle3

        self.eagle3 = eagle3
        self.policy = policy
        self.head = eagle3.load_head(head_dir, policy)
        self.aux_layers = list(self.head_config(head_dir)["eagle_aux_hidden_state_layer_ids"])
        self.steps, self.temperature, self.batch, self.epochs = steps, temperature, batch, epochs
        self.max_rows = max_rows            # samples kept per step (0: all): bounds the adaptation's cost
        self.to_draft = eagle3.draft_index(self.head)
        self.opt = torch.optim.AdamW([p for p in self.head.parameters() if p.requires_grad], lr=lr,
                                     weight_decay=0.0)
        self.gen = torch.Generator().manual_seed(seed)
        self.background = background
        self.feats: list[tuple] = []
        self.collect_s = 0.0                # this step's feature copies (on the critical path)
        self.trained = 0                    # jobs finished: the head has changed since it was loaded
        self._job: threading.Thread | None = None
        self._job_result: dict | None = None
        self._job_error: BaseException | None = None

    @staticmethod
    def head_config(head_dir) -> dict:
        import json

        return json.loads((Path(head_dir) / "config.json").read_text())

    def collect(self, hidden_states, logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                gen_mask: torch.Tensor) -> None:
        """One micro-batch of a pi_old forward pass: hidden_states (the `output_hidden_states` tuple, (B, L, H)
        each), logits (B, L, V) (all positions, unshifted), input_ids and attention_mask (B, L), gen_mask (B, L-1)
        (True where the target token was generated). Rows with fewer than two generated tokens teach nothing."""
        t0 = time.perf_counter()
        if not self.feats:
            self._embed = self.policy.get_input_embeddings().weight.detach().float().clone()
        lengths = attention_mask.sum(1).tolist()
        gen = gen_mask.long()
        firsts = gen.argmax(1).tolist()                # the first generated target's position = last prompt's
        for b in range(len(lengths)):
            if self.max_rows and len(self.feats) >= self.max_rows:
                break                               # the step's first rows (the trainer's passes run in random order)
            if int(gen[b].sum()) >= 2:              # row by row: views of the pass's tensors, no copies of them
                self.feats += self.eagle3.features(
                    tuple(h[b:b + 1] for h in hidden_states), logits[b:b + 1], input_ids[b:b + 1], [lengths[b]],
                    [firsts[b]], self.aux_layers, temperature=self.temperature)
        self.collect_s += time.perf_counter() - t0

    def _train(self, feats: list[tuple], embed: torch.Tensor) -> dict:
        t0 = time.perf_counter()
        self.head.embed = embed                     # the policy's embeddings when the features were taken
        fit = self.eagle3.step_accuracy(self.head, feats, self.steps, self.temperature)
        losses = []
        for _ in range(self.epochs):
            order = torch.randperm(len(feats), generator=self.gen).tolist()
            for b in range(0, len(order), self.batch):
                losses.append(self.eagle3.train_step(self.head, self.opt, feats, order[b:b + self.batch],
                                                     steps=self.steps, to_draft=self.to_draft,
                                                     temperature=self.temperature))
        self.trained += 1
        return {"head_train_s": time.perf_counter() - t0, "head_samples": len(feats),
                "head_loss_first": losses[0] if losses else None, "head_loss_last": losses[-1] if losses else None,
                "head_expected_acceptance": fit}

    def _run_job(self, feats, embed) -> None:
        try:
            self._job_result = self._train(feats, embed)
        except BaseException as e:                  # raised in the trainer by the next adapt() or close()
            self._job_error = e

    def _join(self) -> dict | None:
        if self._job is None:
            return None
        self._job.join()
        self._job = None
        if self._job_error is not None:
            err, self._job_error = self._job_error, None
            raise RuntimeError(f"the EAGLE-3 head's online training failed: {err}") from err
        return self._job_result

    def adapt(self) -> dict:
        """Train on this step's collected samples (now, or in the background) and return this step's metrics:
        `adapt_s` the adaptation's time on the trainer's critical path (feature copies + training inline, or
        waiting for the previous background job), `head_train_s` and the head's fit of the job that finished
        here (its expected acceptance per draft step on those samples before training on them: fresh samples of
        the current policy, so a held-out estimate), and `weights` to push (None: the head has not changed)."""
        t0 = time.perf_counter()
        feats, self.feats = self.feats, []
        embed = getattr(self, "_embed", None)
        if self.background:
            done = self._join()
            weights = self.eagle3.pushable_tensors(self.head) if done is not None else None
            if feats:
                self._job = threading.Thread(target=self._run_job, args=(feats, embed), name="eagle3-adapt",
                                             daemon=True)
                self._job.start()
        else:
            done = self._train(feats, embed) if feats else None
            weights = self.eagle3.pushable_tensors(self.head) if done is not None else None
        out = dict(done or {}, adapt_s=self.collect_s + time.perf_counter() - t0, head_collect_s=self.collect_s,
                   weights=weights)
        self.collect_s = 0.0
        return out

    def close(self) -> None:
        """Wait for a background job still running (its head is not pushed)."""
        self._join()
