"""GRPO against the rollout service, synchronous or asynchronous, with online drafter adaptation.

    rollout-grpo --steps 3                         # starts the service on the default model, trains 3 steps
    rollout-grpo --target 127.0.0.1:50051 --mode async --steps 50 --out runs/async
    rollout-grpo --task calculator --speculation none --steps 10   # multi-turn episodes with a calculator tool

One step, top to bottom:
  1. generate   GRPO groups from the service (sync: now; async: the batch prefetched during the last step),
                drop groups older than --max-lag policy versions
  2. recompute  the trainer's own log-probs of the sampled tokens (pi_old) for the minibatches after the first
                (the first trains before any update, so its own forward pass is pi_old)
  3. train      clipped GRPO loss with truncated importance weights (grpo.py); the same forward pass's
                logits teach a draft model (drafter.py); KL to the start policy on --kl-samples sequences
  4. adapt      an EAGLE-3 head learns from pi_old's hidden states and logits of steps 2-3's forward passes
                (drafter.py; sync: now, async: in the background while the next batch generates)
  5. push       the new policy weights every step (PushWeights), the drafter every --draft-every steps
                (UpdateDraft); then evaluate on held-out problems every --eval-every steps
A mixture-of-experts policy (--model moe) asks for each sample's routes and replays them in every forward pass of
steps 2-3 (routing_replay.py, --routing-replay); one more forward pass without (or with) replay measures the
rollout-against-trainer log-prob mismatch both ways each step.
--task calculator trains on whole multi-turn tool episodes (episodes.py): the loss on the sampled tokens only, the
forward pass on the whole episode (tool results and template glue as context), advantages per episode.
The trainer talks to the service only through `rollout_client` (its RPCs, and its launcher for the
`rollout-service` commands: serve, prepare-model, prepare-drafter).
"""
from __future__ import annotations

import argparse
import copy
import contextlib
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import torch

from rollout_client import RolloutClient
from rollout_client.launcher import ServiceProcess, run_command
from rollout_tasks.arithmetic import REWARDS, correct, extract_answer, split
from rollout_tasks.chat import chat_token_ids, user_turn
from trainer_example import episodes, grpo, routing_replay
from trainer_example.rollouts import (Packed, Prefetcher, assign_advantages, drop_stale, generate_batch,
                                      micro_batches, pack)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="rollout-grpo", description=__doc__.splitlines()[0])
    ap.add_argument("--target", help="host:port of a running service (default: start one on --model)")
    ap.add_argument("--model", help="policy directory (default: the embedded SmolLM2-135M-Instruct); `moe`: SmolLM2 "
                                    "upcycled into a mixture of experts (`rollout-service prepare-model --moe`)")
    ap.add_argument("--routing-replay", choices=["on", "off"], default="on",
                    help="an MoE policy: train on forward passes that route every token to the experts the engine "
                         "routed it to (on), or let the trainer's routers choose (off); the other one is run too, "
                         "without gradients, to log the log-prob mismatch both ways")
    ap.add_argument("--lora", type=int, default=0, metavar="RANK",
                    help="train only a LoRA adapter of this rank (PEFT, every linear layer of the decoder) and push "
                         "only the adapter (PushWeights with TARGET_ADAPTER: kilobytes to megabytes, no pause) as "
                         "policy --policy-name; the service's base weights stay as they are, so trainers with "
                         "different adapters share one service. 0 (default): train and push the whole model")
    ap.add_argument("--policy-name", default="grpo",
                    help="--lora: the adapter's name on the service (each trainer sharing a service needs its own)")
    ap.add_argument("--reward", choices=sorted(REWARDS), default="arithmetic",
                    help="the task's reward: arithmetic (a correct final answer, plus 0.1 for an answer line) or "
                         "brevity (shorter answers score higher)")
    ap.add_argument("--task", choices=["arithmetic", "calculator"], default="arithmetic",
                    help="arithmetic: one sample per prompt (--reward); calculator: multi-turn episodes in which the "
                         "model may call a calculator tool (rollout_tasks/calculator.py), rewarded on the final "
                         "answer, trained on the sampled tokens of the whole episode (episodes.py)")
    ap.add_argument("--max-turns", type=int, default=3,
                    help="--task calculator: assistant turns per episode at most (a turn that calls no tool ends it)")
    ap.add_argument("--mode", choices=["sync", "async"], default="sync")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8, help="prompts (GRPO groups) per step")
    ap.add_argument("--group-size", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per sample (--task calculator: per turn)")
    ap.add_argument("--temperature", type=float, default=0.5,
                    help="sampling temperature; the trainer's log-probs use logits / T to match the sampler's. "
                         "0.5: SmolLM2-135M at 1.0 almost never answers correctly, so GRPO groups carry no signal")
    ap.add_argument("--engine-dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                    help="dtype of the service the trainer starts (float32 matches the trainer's own numerics; "
                         "bfloat16: pushes are cast to it; with --target, say the service's dtype here)")
    ap.add_argument("--max-ops", type=int, default=1, help="operations per word problem: 1..max-ops (task.py)")
    ap.add_argument("--lr", type=float, default=5e-6)
    ap.add_argument("--clip-eps", type=float, default=0.2)
    ap.add_argument("--rollout-correction", choices=grpo.CORRECTIONS, default="tis",
                    help="importance correction of the gap between the served policy (a quantized one: --quantization)"
                         " and the trainer's, per token on r = pi_old / pi_rollout: tis truncates r at --is-cap, mis "
                         "drops tokens with r outside [1/cap, cap], none uses 1 (grpo.py)")
    ap.add_argument("--is-cap", type=float, default=2.0,
                    help="the rollout correction's cap on the importance weight pi_old / pi_rollout")
    ap.add_argument("--quantization", choices=["none", "int8"], default="none",
                    help="the served precision of the service this command starts (serve --quantization): int8 "
                         "rollouts from a policy the trainer trains in float32; with --target, say the service's")
    ap.add_argument("--minibatches", type=int, default=2, help="optimizer steps per batch")
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per forward pass")
    ap.add_argument("--kl-samples", type=int, default=16,
                    help="sequences per step on which KL to the start policy is estimated (a metric only)")
    ap.add_argument("--max-lag", type=int, default=1, help="async: never train on samples older than this")
    ap.add_argument("--speculation", choices=["eagle3", "draft_model", "ngram", "suffix", "none"],
                    default=None,
                    help="when this command starts the service (k chosen per step by the service's controller): "
                         "eagle3, an EAGLE-3 head (the fastest drafter here; adapted online with --adapt-drafter); "
                         "draft_model, a small model adapted online toward the policy (unless --no-adapt-drafter); "
                         "ngram and suffix need no drafter (suffix drafts from the group's and earlier steps' own "
                         "samples). Default: eagle3, or none with --lora (the drafter serves the base policy)")
    ap.add_argument("--drafter", help="drafter directory (default: `rollout-service prepare-drafter --kind "
                                      "eagle3|draft_model`, cached; draft_model with --model: the policy's first 2 "
                                      "layers)")
    ap.add_argument("--adapt-drafter", action=argparse.BooleanOptionalAction, default=None,
                    help="train the drafter online toward the policy and push it with UpdateDraft every "
                         "--draft-every steps (default: on for draft_model; off for eagle3, whose head is trained "
                         "on the step's samples from the policy's own hidden states; with --target, eagle3 needs "
                         "--drafter, the head the service loaded)")
    ap.add_argument("--draft-every", type=int, default=2, help="steps between drafter pushes")
    ap.add_argument("--drafter-lr", type=float, default=1e-4, help="the drafter's learning rate (AdamW)")
    ap.add_argument("--head-batch", type=int, default=8, help="eagle3: samples per optimiser step of the head")
    ap.add_argument("--head-epochs", type=int, default=1, help="eagle3: passes over each step's samples")
    ap.add_argument("--save-final", action=argparse.BooleanOptionalAction, default=True,
                    help="save the trained policy (OUT/policy, with its tokenizer) and an adapted EAGLE-3 head "
                         "(OUT/eagle3-head, the served format) at the end")
    ap.add_argument("--head-samples", type=int, default=0,
                    help="eagle3: samples per step the head trains on (0: all of them); fewer bound the adaptation's "
                         "cost (about 0.3 s per sample of 64 tokens on 2 CPU cores)")
    ap.add_argument("--weight-sync", choices=["transfer", "push"], default="transfer",
                    help="how each step's policy reaches the engines: `transfer` over the service's weight-transfer "
                         "group (rollout_client.transfer.WeightSync; gloo here), `push` as a PushWeights stream")
    ap.add_argument("--weight-delta", choices=["auto", "on", "off"], default="auto",
                    help="push only the elements that changed since the last push (rollout_client.delta: a full "
                         "anchor every --anchor-every steps, the deltas as PushWeights streams). auto: on where the "
                         "service computes in bfloat16 (about 1%% of a bf16 policy changes per step), off in float32 "
                         "(nearly every element changes: a delta is as large as a full push)")
    ap.add_argument("--anchor-every", type=int, default=20, help="--weight-delta: a full push every this many steps")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--eval-size", type=int, default=32)
    ap.add_argument("--out", default="runs/grpo", help="directory for metrics.jsonl and the service log")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.task == "calculator":
        if args.model == "moe":
            ap.error("--task calculator with --model moe: routing replay over multi-turn episodes is not built (each "
                     "turn's routes would have to be joined across the episode); use a dense policy")
        if args.reward != "arithmetic":
            ap.error("--reward: --task calculator has its own reward (the final answer, rollout_tasks/calculator.py)")
    if args.speculation is None:      # calculator: the drafters were trained on arithmetic answers, not tool episodes
        args.speculation = "none" if args.lora or args.task == "calculator" else "eagle3"
    if args.lora:
        args.weight_sync = "push"       # an adapter is a few MB: one PushWeights stream, no transfer group
    return args


class Trainer:
    """The policy being trained, its frozen start copy (for KL), the optimiser, and the online drafter: a draft
    model (`drafter`) or an EAGLE-3 head (`head`), by `drafter_kind`, the service's speculation method."""

    def __init__(self, policy_dir: str, args, drafter_dir: str | None, drafter_kind: str = "draft_model",
                 draft_steps: int = 3):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from trainer_example.drafter import OnlineDrafter, OnlineEagle3Head

        self.args = args
        self.tok = AutoTokenizer.from_pretrained(policy_dir)
        self.policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
        self.start = copy.deepcopy(self.policy).eval().requires_grad_(False)
        self.moe = routing_replay.is_moe(self.policy)
        self.replay = self.moe and args.routing_replay == "on"
        self.route_stats = routing_replay.RouteStats()
        if args.lora:                   # only the adapter trains; it starts at B = 0: exactly the base policy
            from peft import LoraConfig, get_peft_model

            self.policy = get_peft_model(self.policy, LoraConfig(
                r=args.lora, lora_alpha=2 * args.lora, lora_dropout=0.0,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        self.opt = torch.optim.AdamW([p for p in self.policy.parameters() if p.requires_grad], lr=args.lr,
                                     weight_decay=0.0)
        adapt = args.adapt_drafter if args.adapt_drafter is not None else drafter_kind == "draft_model"
        adapt = adapt and not args.lora          # the drafter serves the base policy, shared by every adapter
        self.drafter = self.head = None
        self.deltas = None              # --weight-delta: what was last pushed (rollout_client.delta.WeightDeltas)
        if drafter_dir and adapt and drafter_kind == "draft_model":
            self.drafter = OnlineDrafter(drafter_dir, lr=args.drafter_lr)
        elif drafter_dir and adapt and drafter_kind == "eagle3":
            self.head = OnlineEagle3Head(drafter_dir, self.policy, lr=args.drafter_lr, steps=draft_steps,
                                         temperature=args.temperature, batch=args.head_batch,
                                         epochs=args.head_epochs, background=args.mode == "async", seed=args.seed,
                                         max_rows=args.head_samples)

    def collect_s(self) -> float:
        """Seconds the adapting EAGLE-3 head has spent copying this step's features so far."""
        return self.head.collect_s if self.head is not None else 0.0

    def forward(self, mb: Packed) -> torch.Tensor:
        """The policy's logits (B, L, V) on a micro-batch of pi_old's rows; an adapting EAGLE-3 head keeps the
        hidden states of its feature layers and the logits from the same pass (call it only while the policy is
        pi_old: the recompute, and the first minibatch's training pass)."""
        with self.routing(self.policy, mb):
            out = self.policy(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                              output_hidden_states=self.head is not None)
        if self.head is not None:
            self.head.collect(out.hidden_states, out.logits, mb.input_ids, mb.attention_mask, mb.gen_mask)
        return out.logits

    def routing(self, model, mb: Packed, replay: bool | None = None):
        """The context of one forward pass of `model` on `mb`: an MoE policy follows the samples' routes when
        `replay` (default: --routing-replay); an unforced pass at pi_old counts its routers' disagreements with
        the engine's routes (self.route_stats)."""
        if not self.moe or mb.routes is None:
            return contextlib.nullcontext()
        replay = self.replay if replay is None else replay
        stats = self.route_stats if not replay and model is self.policy else None
        return routing_replay.replay(model, mb.routes, mb.routed, stats, force=replay)

    @torch.no_grad()
    def counterfactual(self, packed: Packed) -> torch.Tensor | None:
        """pi_old log-probs [B, L-1] of every row under the routing the trainer does not train on (replay off when
        --routing-replay on, and the reverse): the other side of the mismatch metrics. None for a dense policy or
        samples without routes. Call before the first optimiser step of the batch."""
        if not self.moe or packed.routes is None:
            return None
        out = torch.zeros_like(packed.rollout_logp)
        self.policy.eval()
        for r, width in micro_batches(packed, self.args.micro_batch):
            mb = packed.slice(r, width)
            with self.routing(self.policy, mb, replay=not self.replay):
                logits = self.policy(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1]
            out[r, :width - 1] = grpo.token_logprobs(logits, mb.targets, self.args.temperature)
        return out

    def routing_metrics(self, packed: Packed, old: torch.Tensor, other: torch.Tensor | None) -> dict:
        """Rollout against trainer, per generated token, with and without routing replay: mean |delta log p| and
        KL(rollout || trainer) (k3). old: pi_old as trained on (train() completes it); other: `counterfactual`."""
        if other is None:
            return {}
        on, off = (old, other) if self.replay else (other, old)
        d_on, kl_on = routing_replay.mismatch(on, packed.rollout_logp, packed.gen_mask)
        d_off, kl_off = routing_replay.mismatch(off, packed.rollout_logp, packed.gen_mask)
        stats, self.route_stats = self.route_stats, routing_replay.RouteStats()
        return {"routing_replay": self.replay, "logp_mismatch_replay": d_on, "kl_k3_replay": kl_on,
                "logp_mismatch_no_replay": d_off, "kl_k3_no_replay": kl_off,
                "routes_differing": stats.differing_fraction, "route_decisions": stats.decisions}

    def push(self, client, sync, version: int, mode: str, dtype):
        """5. push: the adapter alone (--lora; in-flight samples finish on their adapter version, no pause), else the
        policy: what changed since the last push (--weight-delta; anchors and refused deltas whole), or whole (over
        the transfer group, or a PushWeights stream)."""
        if self.args.lora:
            return client.push_adapter(self.args.policy_name, self.policy, version, dtype=dtype)
        push = sync.push if sync is not None else client.push_weights
        if self.args.weight_delta == "on":
            if self.deltas is None:
                from rollout_client.delta import WeightDeltas

                self.deltas = WeightDeltas(client, dtype=dtype, anchor_every=self.args.anchor_every,
                                           full_push=lambda w, v, mode, timeout: push(w, v, mode=mode,
                                                                                      timeout=timeout))
            return self.deltas.push(self.push_weights(), version, mode=mode)
        return push(self.push_weights(), version, mode=mode, dtype=dtype)

    def weights_match(self, pushed, dtype) -> bool | None:
        """Whether the service committed exactly the weights pushed: its fingerprint of them (PushResult.fingerprint)
        against this side's (rollout_client.delta). None where the push has none (an adapter)."""
        if not pushed.fingerprint or self.args.lora:
            return None
        if self.deltas is not None:
            return pushed.fingerprint == self.deltas.fingerprint()
        from rollout_client.delta import fingerprint

        return pushed.fingerprint == fingerprint(self.push_weights(), dtype)

    def push_stats(self) -> dict:
        """What the last push sent (--weight-delta): full, delta, or full after a refused delta."""
        d = self.deltas
        return {} if d is None else {"push_kind": d.last_kind, "push_bytes": d.last_bytes,
                                     "push_changed_elements": d.last_changed}

    def push_weights(self):
        """The policy's tensors under the checkpoint's names, which the service validates pushes against:
        transformers 5 fuses an MoE layer's experts in memory (mlp.experts.gate_up_proj [E, 2I, H]) and writes them
        per expert on save (block_sparse_moe.experts.{e}.w1.weight ...); a dense policy is pushed as it is."""
        if not self.moe:
            return self.policy
        from transformers.core_model_loading import revert_weight_conversion

        state = revert_weight_conversion(self.policy, self.policy.state_dict())
        if self.policy.config.tie_word_embeddings:      # the reverted dict sorts lm_head first: send the embedding
            state.pop("lm_head.weight", None)
        return state

    def encode(self, problems) -> list:
        """The prompts for `problems`: token ids (arithmetic), or each episode's first messages (calculator: the server
        renders them with the tools)."""
        if self.args.task == "calculator":
            return episodes.encode(problems)
        return [chat_token_ids(self.tok, user_turn(p.prompt)) for p in problems]

    def minibatches(self, batch_size: int) -> list[torch.Tensor]:
        """The rows of each of --minibatches optimiser steps, in a random order."""
        return list(torch.randperm(batch_size).chunk(self.args.minibatches))

    @torch.no_grad()
    def recompute(self, packed: Packed, parts: list[torch.Tensor]) -> torch.Tensor:
        """pi_old log-probs of every target token of the minibatches after the first, [B, L-1]; NaN in the
        first's rows. The first minibatch needs none: it trains before any optimiser step, so its own forward
        pass is pi_old (the policy runs in eval mode throughout, so that forward is the same function as this one)."""
        old = torch.full_like(packed.rollout_logp, float("nan"))
        if len(parts) < 2:
            return old
        rows = torch.cat(parts[1:])
        sub = packed.select(rows)
        old[rows] = 0.0                 # padding past each row's end stays finite (the loss masks it)
        self.policy.eval()
        for r, width in micro_batches(sub, self.args.micro_batch):
            mb = sub.slice(r, width)
            logits = self.forward(mb)[:, :-1]       # an MoE policy: routed as --routing-replay says
            old[rows[r], :width - 1] = grpo.token_logprobs(logits, mb.targets, self.args.temperature)
        return old

    def train(self, packed: Packed, parts: list[torch.Tensor], old: torch.Tensor) -> dict:
        """One optimiser step per part (`minibatches`); the drafter learns from the same forward passes.
        Rows whose pi_old is NaN take it from their own forward pass (only valid before the first step), written
        back into `old`.
        KL to the start policy is estimated on the first --kl-samples sequences of the first part, where
        that forward pass is pi_old."""
        self.policy.eval()              # no dropout: the training forward is pi_old for the first part
        stats, kl_draft, kl_sum, kl_n, kl_rows = [], None, 0.0, 0, 0
        for i, part in enumerate(parts):
            mbatch = packed.select(part)
            part_old = old[part]
            for rows, width in micro_batches(mbatch, self.args.micro_batch):
                mb = mbatch.slice(rows, width)
                if i == 0:              # pi_old: an adapting head learns from this pass too
                    logits = self.forward(mb)[:, :-1]
                else:
                    with self.routing(self.policy, mb):
                        logits = self.policy(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1]
                logp = grpo.token_logprobs(logits, mb.targets, self.args.temperature)
                mb_old = part_old[rows, :width - 1]
                own = torch.isnan(mb_old)
                if own.any():
                    if i > 0:
                        raise ValueError("pi_old missing for a minibatch after the first optimiser step")
                    mb_old = torch.where(own, logp.detach(), mb_old)
                    old[part[rows], :width - 1] = mb_old
                if i == 0 and kl_rows < self.args.kl_samples:
                    with torch.no_grad():
                        with self.routing(self.start, mb):
                            ref_logits = self.start(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
                        d = (grpo.token_logprobs(ref_logits[:, :-1], mb.targets, self.args.temperature)
                             - mb_old)[mb.gen_mask]
                        kl_sum, kl_n = kl_sum + float((torch.exp(d) - d - 1).sum()), kl_n + d.numel()
                    kl_rows += mb.input_ids.shape[0]
                loss, st = grpo.grpo_loss(logp, mb_old, mb.rollout_logp, mb.advantages,
                                          mb.gen_mask, clip_eps=self.args.clip_eps, is_cap=self.args.is_cap,
                                          correction=self.args.rollout_correction, num_tokens=mbatch.num_tokens)
                loss.backward()
                stats.append(st)
                if self.drafter is not None:
                    self.drafter.learn(mb.input_ids, mb.attention_mask, mb.gen_mask, logits.detach(),
                                       num_tokens=packed.num_tokens, temperature=self.args.temperature)
            torch.nn.utils.clip_grad_norm_(self.policy.parameters(), 1.0)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        if self.drafter is not None:
            kl_draft = self.drafter.step()
        n = len(stats)
        return {"loss": sum(s.loss for s in stats), "clip_fraction": sum(s.clip_fraction for s in stats) / n,
                "is_weight_mean": sum(s.mean_is_weight for s in stats) / n,
                "is_truncated_fraction": sum(s.truncated_fraction for s in stats) / n, "drafter_kl": kl_draft,
                "rollout_correction": self.args.rollout_correction,
                "rollout_logp_mismatch": sum(s.logp_mismatch for s in stats) / n,
                "rollout_kl_k3": sum(s.kl_k3 for s in stats) / n,
                "kl_to_start": kl_sum / max(kl_n, 1), "kl_samples": kl_rows}


def evaluate(client, trainer: Trainer, size: int, max_tokens: int, max_ops: int) -> tuple[float, float, str, dict]:
    """Held-out (accuracy, answer-line rate, per-problem correctness as a '0'/'1' string, the calculator task's tool
    use), greedy decoding, on seeds disjoint from training; the same problems every time, so evaluations can be
    compared pairwise."""
    problems = split(size, eval=True, max_ops=max_ops)
    args = trainer.args
    if args.task == "calculator":
        hits, lines, tools = episodes.evaluate(client, problems, max_turns=args.max_turns, max_tokens=max_tokens,
                                               policy=args.policy_name if args.lora else "")
        return sum(hits) / len(problems), sum(lines) / len(problems), "".join("1" if h else "0" for h in hits), tools
    groups = client.generate_all(trainer.encode(problems), n=1, max_tokens=max_tokens, temperature=0.0,
                                 return_text=True, policy=trainer.args.policy_name if trainer.args.lora else "")
    texts = [g[0].text for g in groups]
    hits = [correct(t, p.answer) for p, t in zip(problems, texts)]
    return (sum(hits) / len(problems), sum(extract_answer(t) is not None for t in texts) / len(problems),
            "".join("1" if h else "0" for h in hits), {})


def speculation_summary(rollouts, before, after, stats=()) -> dict:
    """Acceptance of this step's samples (accepted / drafted), per draft position (`position_acceptance`: GetStatus's
    stats of the (policy, drafter) versions that generated them, weighted by drafts where several did; the service
    keeps them per version pair, so with a new policy every step this is the step's own), and the k the service
    chose for the steps its engines ran meanwhile (GetStatus k_control before and after generating: a histogram of
    k by engine step; `draft_acceptance` the controller's running estimate of the drafter's acceptance)."""
    drafted = sum(r.num_drafted for r in rollouts)
    accepted = sum(r.num_accepted for r in rollouts)
    versions = {r.oldest_version for r in rollouts}
    drafters = {r.draft_version for r in rollouts}
    rows = [s for s in stats if s.policy_version in versions and s.draft_version in drafters and s.num_drafted > 0
            and len(s.per_position_acceptance)]
    width = max((len(s.per_position_acceptance) for s in rows), default=0)
    weight = sum(s.num_drafted for s in rows)
    out = {"acceptance_rate": accepted / drafted if drafted else None, "drafted": drafted,
           "draft_versions": sorted(drafters),
           "position_acceptance": [sum(s.num_drafted * s.per_position_acceptance[i] for s in rows
                                       if len(s.per_position_acceptance) > i) / weight for i in range(width)],
           "draft_acceptance": list(after.acceptance), "k_mode": after.mode, "k_steps": [], "k_mean": None}
    steps = [a - (before.steps_by_k[k] if k < len(before.steps_by_k) else 0) for k, a in enumerate(after.steps_by_k)]
    if sum(steps) > 0:
        out.update(k_steps=steps, k_mean=sum(k * n for k, n in enumerate(steps)) / sum(steps))
    return out


def run(client, args, policy_dir: str, drafter_dir: str | None, out: Path) -> list[dict]:
    """drafter_dir: the drafter the service loaded (a draft model or an EAGLE-3 head, by the service's
    speculation method), to adapt online; None: none to adapt."""
    from tqdm import tqdm

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    status = client.status()
    trainer = Trainer(policy_dir, args, drafter_dir, status.speculation_method,
                      draft_steps=status.num_speculative_tokens or 3)
    version, draft_version = status.policy_version, status.draft_version
    served = status.quantization.method or "none"      # what the rollouts' log-probs are the log-probs of
    if args.task == "calculator":   # n episodes per problem, each up to --max-turns turns of --max-tokens
        generate = episodes.generate_episodes
        gen = dict(n=args.group_size, max_turns=args.max_turns, max_tokens=args.max_tokens,
                   temperature=args.temperature)
    else:
        generate = generate_batch
        gen = dict(n=args.group_size, max_tokens=args.max_tokens, temperature=args.temperature,
                   routed_experts=trainer.moe, reward_fn=REWARDS[args.reward])
    if args.lora:                   # the adapter's own version line, from 1 (or after what a previous run pushed)
        version = next((a.version for a in status.adapters if a.name == args.policy_name), 0) + 1
        trainer.push(client, None, version, "wait", None)
        gen["policy"] = args.policy_name
    cursor = [0]

    def next_problems():
        problems = split(args.prompts, start=args.seed * 1_000_000 + cursor[0], max_ops=args.max_ops)
        cursor[0] += args.prompts
        return problems, trainer.encode(problems)

    metrics_path = out / "metrics.jsonl"
    metrics_path.parent.mkdir(parents=True, exist_ok=True)
    metrics_file = open(metrics_path, "a")
    eval_acc, eval_format, eval_hits, eval_tools = evaluate(client, trainer, args.eval_size, args.max_tokens,
                                                            args.max_ops)
    eval_before, eval_before_hits, eval_before_tools = eval_acc, eval_hits, eval_tools
    print(f"held-out accuracy before training: {eval_acc:.3f}, answer lines {eval_format:.3f} "
          f"({args.eval_size} problems, greedy)" + _tools_text(eval_tools))
    sync = None
    if args.weight_sync == "transfer":          # once: the service's engines and this trainer form the group
        from rollout_client.transfer import WeightSync

        sync = WeightSync(client)
        sync.connect()
    prefetch = None
    if args.mode == "async":
        prefetch = Prefetcher(client, next_problems, lambda: version, max_lag=args.max_lag, generate=generate,
                              **gen).start()
    # A bfloat16 engine takes bfloat16 pushes (the service takes the checkpoint's or the serving dtype); "auto" serves
    # bfloat16 on a CPU with native bf16 (and on GPU nodes): the status says which.
    bf16 = args.engine_dtype == "bfloat16" or status.quantization.dtype == "bfloat16"
    push_dtype = torch.bfloat16 if bf16 else None
    if args.weight_delta == "auto":
        args.weight_delta = "on" if bf16 and not args.lora else "off"
    print("weight sync: " + ("bfloat16 deltas (what changed since the last push), a full push every "
                             f"{args.anchor_every} steps" if args.weight_delta == "on" else
                             "full pushes" + (" (the service computes in float32, where nearly every element changes "
                                              "each step: deltas would be as large; --engine-dtype bfloat16 for them)"
                                              if not bf16 and not args.lora else "")))
    rows, t_start = [], time.perf_counter()
    bar = tqdm(range(args.steps), desc=f"GRPO {args.mode}", unit="step")
    try:
        for step in bar:
            t0 = time.perf_counter()
            k_before = client.status().k_control
            # 1. generate
            if prefetch:
                batch = prefetch.get(more=step + 1 < args.steps)
            else:
                batch = generate(client, *next_problems(), **gen)
            rewards = assign_advantages(batch, args.group_size)
            rollouts, dropped = drop_stale(batch.rollouts, version, args.max_lag)
            t1 = time.perf_counter()
            row = {"step": step, "mode": args.mode, "quantization": served, "eval_before": eval_before,
                   "eval_size": args.eval_size,
                   "policy_version": version, "samples": len(rollouts),
                   "dropped_stale": dropped, "max_lag_used": max((version - r.oldest_version for r in rollouts),
                                                                 default=0),
                   "reward_mean": float(rewards.mean()),
                   "train_accuracy": sum(r.correct for r in batch.rollouts) / len(batch.rollouts),
                   "format_rate": sum(r.answer_line for r in batch.rollouts) / len(batch.rollouts),
                   **(episodes.summary(batch.rollouts) if args.task == "calculator" else {}),
                   **speculation_summary(rollouts, k_before, (after := client.status()).k_control,
                                         after.speculation)}
            recompute_s = train_s = replay_check_s = 0.0
            if rollouts:
                packed = pack(rollouts)
                # 2. recompute pi_old for the minibatches that train after the first optimiser step
                parts = trainer.minibatches(len(rollouts))
                c1 = trainer.collect_s()
                old = trainer.recompute(packed, parts)
                t2, c2 = time.perf_counter(), trainer.collect_s()
                recompute_s = t2 - t1 - (c2 - c1)       # the head's feature copies count as adaptation (step 4)
                other = trainer.counterfactual(packed)  # an MoE policy: pi_old routed the other way (a metric)
                replay_check_s, t2 = time.perf_counter() - t2, time.perf_counter()
                # 3. train
                row.update(trainer.train(packed, parts, old))
                train_s = time.perf_counter() - t2 - (trainer.collect_s() - c2)
                row.update(trainer.routing_metrics(packed, old, other))
            # 4. adapt the EAGLE-3 head (sync: now; async: hand over to its thread, take the last job's head)
            head_weights, row["adapt_s"] = None, 0.0
            if trainer.head is not None:
                adapted = trainer.head.adapt()
                head_weights = adapted.pop("weights")
                row.update(adapted)
            t_push = time.perf_counter()
            # 5. push
            version += 1
            pushed = trainer.push(client, sync, version, "keep" if prefetch else "wait", push_dtype)
            t_draft = time.perf_counter()
            drafter_weights = trainer.drafter.weights() if trainer.drafter is not None else head_weights
            if drafter_weights is not None and (step + 1) % args.draft_every == 0:
                draft_version += 1
                client.update_draft(drafter_weights, draft_version, partial=True, mode="keep" if prefetch else "wait")
                row["draft_pushed"] = draft_version
            t4 = time.perf_counter()
            if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
                eval_acc, eval_format, eval_hits, eval_tools = evaluate(client, trainer, args.eval_size,
                                                                        args.max_tokens, args.max_ops)
                row["eval_accuracy"], row["eval_format_rate"], row["eval_correct"] = eval_acc, eval_format, eval_hits
                row.update({f"eval_{k}": v for k, v in eval_tools.items()})
            if step == 0:
                row["eval_before_correct"] = eval_before_hits
                row.update({f"eval_before_{k}": v for k, v in eval_before_tools.items()})
            row.update(generate_s=t1 - t0, generation_wall_s=batch.generate_s, recompute_s=recompute_s,
                       train_s=train_s, replay_check_s=replay_check_s,
                       push_s=t4 - t_push, draft_push_s=t4 - t_draft, push_pause_s=pushed.pause_s,
                       push_path=args.weight_sync, **trainer.push_stats(),
                       weights_match=trainer.weights_match(pushed, push_dtype),
                       push_dtype="bfloat16" if push_dtype is not None else "float32",
                       step_s=t4 - t0,
                       draft_version=draft_version, elapsed_s=time.perf_counter() - t_start)
            rows.append(row)
            metrics_file.write(json.dumps(row) + "\n")
            metrics_file.flush()
            bar.set_postfix(reward=f"{row['reward_mean']:.2f}", eval=f"{eval_acc:.2f}",
                            accept=_fmt(row["acceptance_rate"]))
            bar.write(step_line(row))
            if mismatch := policy_mismatch(row):
                bar.write(mismatch)
        if args.save_final:
            bar.write(f"saved the final policy and drafter: {save_final(trainer, policy_dir, out)}")
    finally:
        bar.close()
        metrics_file.close()
        if prefetch:
            prefetch.stop()
        if sync is not None:
            sync.close()
        if trainer.head is not None:
            trainer.head.close()
    return rows



def save_final(trainer: Trainer, policy_dir: str, out: Path) -> list[str]:
    """--save-final: the trained policy (out/policy, Hugging Face format, the tokenizer beside it) and an adapted
    EAGLE-3 head (out/eagle3-head, the served format), for measuring the head against the policy it followed."""
    saved = [str(out / "policy")]
    trainer.policy.save_pretrained(out / "policy")
    trainer.tok.save_pretrained(out / "policy")
    if trainer.head is not None:
        from rollout_service.drafting import eagle3

        trainer.head.close()                   # wait for a background job still training
        eagle3.save_head(trainer.head.head, policy_dir, out / "eagle3-head", trainer.head.aux_layers,
                         {"adapted_online": True, "jobs": trainer.head.trained})
        saved.append(str(out / "eagle3-head"))
    return saved


def policy_mismatch(r: dict) -> str | None:
    """A warning when samples drawn under the policy the trainer holds (no lag) carry log-probs it disagrees with:
    their importance weights pi_old / pi_rollout must then be 1 up to float noise. Off by more means the service
    served other weights than the trainer pushed (a transfer that corrupted them was found this way, 2026-11-26)."""
    if r.get("weights_match") is False:
        return (f"WARNING step {r['step']}: the service committed other weights than the trainer pushed (its "
                f"fingerprint of version {r['policy_version'] + 1} differs from the trainer's)")
    if r.get("max_lag_used") or "is_weight_mean" not in r or r.get("quantization", "none") != "none":
        return None                           # (a quantized service serves other weights than pushed, by design)
    if r.get("weights_match") and r.get("push_dtype") == "bfloat16":
        return None                           # the same weights, computed in bf16: the gap is bf16's, not a fault
    if abs(r["is_weight_mean"] - 1.0) <= 0.02 and r["is_truncated_fraction"] <= 0.005:
        return None
    return (f"WARNING step {r['step']}: the served policy disagrees with the trainer's on samples without lag "
            f"(importance weight mean {r['is_weight_mean']:.3f}, {r['is_truncated_fraction']:.1%} truncated; "
            "expected 1.000 and 0%): the engines may serve other weights than the ones pushed")


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def step_line(r: dict) -> str:
    return (f"step {r['step']:3d} v{r['policy_version']}->v{r['policy_version'] + 1}: "
            f"generate {r['generate_s']:5.1f}s  recompute {r['recompute_s']:5.1f}s  train {r['train_s']:5.1f}s  "
            + (f"adapt {r['adapt_s']:4.1f}s  " if r.get("head_collect_s") is not None else "")
            + (f"mismatch check {r['replay_check_s']:4.1f}s  " if r.get("replay_check_s") else "")
            + f"push {r['push_s']:4.1f}s | reward {r['reward_mean']:.2f}  samples {r['samples']} "
            f"(dropped {r['dropped_stale']})  acceptance {_fmt(r['acceptance_rate'])}"
            + (f" of {r['drafted']} drafted" if r.get("drafted") is not None else "")
            + (f" (per position {' '.join(f'{a:.2f}' for a in r['position_acceptance'])})"
               if r.get("position_acceptance") else "")
            + (f"  k chosen: mean {r['k_mean']:.2f}, steps by k {'/'.join(map(str, r['k_steps']))}"
               if r.get("k_mean") is not None else "")
            + f"  drafter v{r['draft_version']}"
            + (f"  rollout |dlogp| {r['rollout_logp_mismatch']:.4f} KL {r['rollout_kl_k3']:.1e} "
               f"{r['rollout_correction']} {'masked' if r['rollout_correction'] == 'mis' else 'truncated'} "
               f"{r['is_truncated_fraction']:.1%}" if r.get("rollout_logp_mismatch") is not None else "")
            + (f" (pushed in {r['draft_push_s']:.1f}s)" if r.get("draft_pushed") is not None else "")
            + _head_text(r)
            + (f"  held-out accuracy {r['eval_accuracy']:.3f}" if "eval_accuracy" in r else "")
            + _tools_text(r)
            + _replay_text(r))


def _tools_text(r: dict) -> str:
    """--task calculator: the episodes' tool use (a step's row, or an evaluation's summary)."""
    if r.get("tool_call_rate") is None:
        return ""
    formed = r.get("well_formed_rate")
    return (f"  tool calls in {r['tool_call_rate']:.0%} of episodes ({r['calls_per_episode']:.2f} per episode, "
            f"{r['attempts_per_episode']:.2f} tried, well-formed {'-' if formed is None else f'{formed:.0%}'}), "
            f"calculator right {r['calc_hit_rate']:.0%}, turns {r['turns_per_episode']:.2f}, "
            f"{r['episode_tokens']:.0f} tokens ({r['sampled_tokens']:.0f} sampled)")


def _replay_text(r: dict) -> str:
    """An MoE policy: rollout-against-trainer log-prob mismatch with and without routing replay, and how many of the
    engine's router decisions the trainer's own routers would have made otherwise."""
    if r.get("logp_mismatch_replay") is None:
        return ""
    differing = r.get("routes_differing")
    return (f"  |dlogp| replay {r['logp_mismatch_replay']:.4f} / no replay {r['logp_mismatch_no_replay']:.4f}, "
            f"KL k3 {r['kl_k3_replay']:.2e} / {r['kl_k3_no_replay']:.2e}"
            + (f", routes differing {differing:.2%} of {r['route_decisions']}" if differing is not None else "")
            + f" (trained {'with' if r['routing_replay'] else 'without'} replay)")


def _head_text(r: dict) -> str:
    """The EAGLE-3 head's online adaptation this step: the job that finished (its time, samples, loss, and its
    expected acceptance per draft step on those fresh samples before training on them)."""
    if r.get("head_train_s") is None:
        return ""
    where = "in the background, " if r["mode"] == "async" else ""
    return (f"  head trained {where}{r['head_train_s']:.1f}s on {r['head_samples']} samples (loss "
            f"{r['head_loss_first']:.2f} -> {r['head_loss_last']:.2f}, expected acceptance before "
            f"{' '.join(f'{a:.2f}' for a in r['head_expected_acceptance'])})")


def choose_drafter(args, policy_dir: str, out: Path) -> str | None:
    """--drafter; else eagle3: an EAGLE-3 head trained on the policy's own samples, `rollout-service
    prepare-drafter --kind eagle3` (the first time with progress bars, ~14 min on 2 cores; cached for every later
    run); draft_model: for the default model the distilled drafter, `rollout-service prepare-drafter` (~7-12 min
    the first time), else (a --model of your own) one cut from the policy's first two layers in seconds, weak
    until adapted online."""
    if args.speculation not in ("draft_model", "eagle3"):
        return None
    if args.drafter:
        return args.drafter
    if args.speculation == "eagle3":
        return run_command("prepare-drafter", "--kind", "eagle3", *(["--model", policy_dir] if args.model else []))
    if not args.model:
        return run_command("prepare-drafter")
    from trainer_example.drafter import build_initial_drafter

    return str(build_initial_drafter(policy_dir, out / "drafter-init"))


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    # SIGTERM (a scheduler, `kill`) unwinds like Ctrl-C: the service this trainer started is stopped cleanly.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    policy_dir = (run_command("prepare-model", "--moe") if args.model == "moe"
                  else args.model or run_command("prepare-model"))
    if args.target:
        with RolloutClient(args.target) as client:
            method = client.status().speculation_method
            drafter = args.drafter if method in ("draft_model", "eagle3") else None
            if method == "eagle3" and args.adapt_drafter and not drafter:
                print("--adapt-drafter against a service with an EAGLE-3 head needs --drafter (the head it loaded): "
                      "the head is not adapted")
            rows = run(client, args, policy_dir, drafter, out)
    else:
        drafter = choose_drafter(args, policy_dir, out)
        extra = ["--dtype", args.engine_dtype, "--speculation", args.speculation, "--quantization", args.quantization]
        if args.lora:                   # the service's LoRA buffers: the next of vLLM's ranks (8, 16, 32, ...)
            extra += ["--max-adapters", "4", "--max-lora-rank", str(max(8, 1 << (args.lora - 1).bit_length()))]
        extra += ["--draft-model", drafter] if drafter else []
        print(f"starting rollout-service on {policy_dir} (speculation: {args.speculation}"
              f"{', drafter ' + drafter if drafter else ''}); log: {out / 'service.log'}")
        with ServiceProcess(policy_dir, extra_args=extra, log_path=out / "service.log") as svc:
            with RolloutClient(svc.target) as client:
                rows = run(client, args, policy_dir, drafter, out)
    summary(rows, out)
    return 0


def summary(rows: list[dict], out: Path) -> None:
    if not rows:
        return
    later = rows[1:] or rows
    mean = {k: sum(r.get(k, 0.0) for r in later) / len(later)
            for k in ("generate_s", "recompute_s", "train_s", "adapt_s", "push_s", "step_s")}
    acc = [r for r in rows if r.get("acceptance_rate") is not None]
    print(f"\n{len(rows)} steps; mean step {mean['step_s']:.1f} s = generate {mean['generate_s']:.1f} + recompute "
          f"{mean['recompute_s']:.1f} + train {mean['train_s']:.1f} + adapt {mean['adapt_s']:.1f} "
          f"+ push {mean['push_s']:.1f}"
          + (" (first step excluded)" if len(rows) > 1 else ""))
    if acc:
        print("acceptance per step: " + ", ".join(f"{r['acceptance_rate']:.2f} (drafter v{r['draft_versions'][-1]})"
                                                   for r in acc))
    print(f"metrics: {out / 'metrics.jsonl'}  (plots: python -m trainer_example.plot {out / 'metrics.jsonl'})")


if __name__ == "__main__":
    raise SystemExit(main())
