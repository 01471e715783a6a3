"""Rollouts: ask the service for a batch of GRPO groups, score them, and pack them into tensors.

Everything that talks to the service goes through `rollout_client`; nothing here knows the RPCs.
`Prefetcher` is the asynchronous mode's producer: it keeps one batch in flight while the trainer trains.
"""
from __future__ import annotations

import queue
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np
import torch

from rollout_tasks.arithmetic import Problem, correct, extract_answer, reward


@dataclass
class Rollout:
    """One scored sample of one prompt."""

    group: int
    prompt_ids: list[int]
    token_ids: np.ndarray          # int64 [gen_len]
    rollout_logp: np.ndarray       # float32 [gen_len], what the service sampled from
    reward: float
    correct: bool
    oldest_version: int            # lowest policy version that produced any of its tokens
    draft_version: int
    num_drafted: int
    num_accepted: int
    advantage: float = 0.0         # set by assign_advantages
    answer_line: bool = False      # stated its answer on an 'Answer: N' line
    routes: np.ndarray | None = None   # an MoE policy's experts, uint8/uint16 [rows, layers, top_k] (routing replay)
    routes_first_row: int = 0          # position of routes[0] in prompt + generated tokens
    sampled: np.ndarray | None = None  # bool [gen_len]: a multi-turn episode's tokens the model sampled (the rest,
                                       # tool results and template glue, were inserted); None: all were sampled
    episode: dict | None = None        # a multi-turn episode's own metrics (episodes.py: tool calls, turns, ...)


@dataclass
class Batch:
    rollouts: list[Rollout]
    num_groups: int
    generate_s: float              # wall time of the Generate call that produced it


def sample_oldest_version(s) -> int:
    return min([v for v, _ in s.version_spans] or [s.policy_version])


def generate_batch(client, problems: list[Problem], prompt_ids: list[list[int]], *, n: int, max_tokens: int,
                   temperature: float, min_policy_version: int = 0, routed_experts: bool = False,
                   policy: str = "", reward_fn=reward) -> Batch:
    """One Generate call: n samples for each prompt, scored by the task's pure reward (`reward_fn`). routed_experts:
    ask for each sample's routes (an MoE policy; routing_replay.py replays them). policy: the LoRA adapter to sample
    ("" for the service's base policy)."""
    t0 = time.perf_counter()
    extra = {"return_routed_experts": True} if routed_experts else {}
    if policy:
        extra["policy"] = policy
    groups = client.generate_all(prompt_ids, n=n, max_tokens=max_tokens, temperature=temperature,
                                 return_text=True, min_policy_version=min_policy_version,
                                 request_id=f"grpo-{uuid.uuid4().hex[:12]}", **extra)
    out = []
    for g, (problem, ids, samples) in enumerate(zip(problems, prompt_ids, groups)):
        for s in samples:
            routes = getattr(s, "routed_experts", None)
            out.append(Rollout(group=g, prompt_ids=ids, token_ids=s.token_ids, rollout_logp=s.logprobs,
                               reward=reward_fn(s.text, problem.answer), correct=correct(s.text, problem.answer),
                               oldest_version=sample_oldest_version(s), draft_version=s.draft_version,
                               num_drafted=s.num_drafted, num_accepted=s.num_accepted,
                               answer_line=extract_answer(s.text) is not None,
                               routes=routes.ids if routes is not None else None,
                               routes_first_row=routes.first_row if routes is not None else 0))
    return Batch(out, len(problems), time.perf_counter() - t0)


def assign_advantages(batch: "Batch", group_size: int) -> torch.Tensor:
    """GRPO advantages from the whole groups (before any are dropped); returns rewards [groups, n]."""
    from trainer_example.grpo import group_advantages

    rewards = torch.tensor([r.reward for r in batch.rollouts], dtype=torch.float32).view(batch.num_groups,
                                                                                         group_size)
    for r, a in zip(batch.rollouts, group_advantages(rewards).flatten().tolist()):
        r.advantage = a
    return rewards


def drop_stale(rollouts: list[Rollout], version: int, max_lag: int) -> tuple[list[Rollout], int]:
    """Keep whole groups whose every sample came from a policy at most `max_lag` versions behind `version`.
    A group with any stale sample is dropped as a whole (its advantages would be biased otherwise)."""
    stale = {r.group for r in rollouts if version - r.oldest_version > max_lag}
    kept = [r for r in rollouts if r.group not in stale]
    return kept, len(rollouts) - len(kept)


@dataclass
class Packed:
    """Right-padded tensors for a list of rollouts. Position t predicts token t + 1 ("shifted")."""

    input_ids: torch.Tensor        # int64 [B, L]
    attention_mask: torch.Tensor   # int64 [B, L]
    targets: torch.Tensor          # int64 [B, L-1], input_ids[:, 1:]
    gen_mask: torch.Tensor         # bool  [B, L-1], True where the target is a generated token
    rollout_logp: torch.Tensor     # float32 [B, L-1], the service's log-prob of each generated target
    advantages: torch.Tensor       # float32 [B]
    routes: torch.Tensor | None = None   # int64 [B, L, layers, top_k]: the experts the engine routed each token to
    routed: torch.Tensor | None = None   # bool [B, L]: rows that carry a route (not padding, not a last token)

    @property
    def num_tokens(self) -> int:
        return int(self.gen_mask.sum())

    def select(self, rows) -> "Packed":
        return Packed(self.input_ids[rows], self.attention_mask[rows], self.targets[rows], self.gen_mask[rows],
                      self.rollout_logp[rows], self.advantages[rows],
                      None if self.routes is None else self.routes[rows],
                      None if self.routed is None else self.routed[rows])

    def slice(self, rows: slice, width: int) -> "Packed":
        """Rows `rows`, trimmed to `width` positions."""
        return Packed(self.input_ids[rows, :width], self.attention_mask[rows, :width],
                      self.targets[rows, :width - 1], self.gen_mask[rows, :width - 1],
                      self.rollout_logp[rows, :width - 1], self.advantages[rows],
                      None if self.routes is None else self.routes[rows, :width],
                      None if self.routed is None else self.routed[rows, :width])


def pack(rollouts: list[Rollout]) -> Packed:
    """Right-padded rows of prompt + generated tokens; gen_mask marks the targets sampled by the model (a multi-turn
    episode's inserted tokens are context only: no loss, no log-probs)."""
    seqs = [r.prompt_ids + r.token_ids.tolist() for r in rollouts]
    width = max(len(s) for s in seqs)
    b = len(seqs)
    ids = torch.zeros(b, width, dtype=torch.long)
    attn = torch.zeros(b, width, dtype=torch.long)
    gen = torch.zeros(b, width - 1, dtype=torch.bool)
    rlp = torch.zeros(b, width - 1, dtype=torch.float32)
    for i, (r, s) in enumerate(zip(rollouts, seqs)):
        p, g = len(r.prompt_ids), len(r.token_ids)
        ids[i, :len(s)] = torch.tensor(s)
        attn[i, :len(s)] = 1
        gen[i, p - 1:p - 1 + g] = True if r.sampled is None else torch.from_numpy(np.asarray(r.sampled, dtype=bool))
        rlp[i, p - 1:p - 1 + g] = torch.from_numpy(np.asarray(r.rollout_logp, dtype=np.float32))
    adv = torch.tensor([r.advantage for r in rollouts], dtype=torch.float32)
    routes = routed = None
    shaped = [r.routes for r in rollouts if r.routes is not None]
    if shaped:                     # an MoE policy's samples: their routes, padded like the tokens
        from trainer_example.routing_replay import pack_routes

        routes, routed = pack_routes([r.routes for r in rollouts], [r.routes_first_row for r in rollouts],
                                     [len(s) for s in seqs], width, *shaped[0].shape[1:])
    return Packed(ids, attn, ids[:, 1:], gen, rlp, adv, routes, routed)


def micro_batches(packed: Packed, size: int):
    """(rows, width) of successive groups of at most `size` rows; width is their longest row's length."""
    for s in range(0, packed.input_ids.shape[0], size):
        rows = slice(s, s + size)
        yield rows, int(packed.attention_mask[rows].sum(1).max())


class Prefetcher:
    """Asynchronous RL's producer thread: generates the next batch while the trainer trains on this one.

    Exactly one batch is generated ahead: `get()` hands over the batch requested one step earlier and asks
    for the next, so a batch is at most one push older than the policy that trains on it (plus any further
    pushes that land while it is still generating, which the "keep" commit mode records per token).
    `version()` returns the trainer's latest pushed policy version; each request asks the service to admit
    it only at a policy no older than version - max_lag (server-side staleness admission), and the trainer
    still drops any group that came out staler than that (`drop_stale`)."""

    def __init__(self, client, next_problems, version, *, max_lag: int, generate=generate_batch, **gen_kwargs):
        """generate: generate_batch, or episodes.generate_episodes (multi-turn tool episodes), with gen_kwargs."""
        self.client, self.next_problems, self.version, self.max_lag = client, next_problems, version, max_lag
        self.generate = generate
        self.gen_kwargs = gen_kwargs
        self.wanted: queue.Queue = queue.Queue()
        self.ready: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="rollout-prefetch", daemon=True)

    def start(self) -> "Prefetcher":
        self.wanted.put(True)
        self.thread.start()
        return self

    def _run(self) -> None:
        while self.wanted.get():
            try:
                problems, prompt_ids = self.next_problems()
                self.ready.put(self.generate(self.client, problems, prompt_ids,
                                             min_policy_version=max(0, self.version() - self.max_lag),
                                             **self.gen_kwargs))
            except BaseException as e:      # handed to the trainer, which raises it
                self.ready.put(e)

    def get(self, more: bool = True) -> Batch:
        """The batch requested at the previous call (or at start); requests the next one unless `more` is False."""
        if more:
            self.wanted.put(True)
        item = self.ready.get()
        if isinstance(item, BaseException):
            raise RuntimeError(f"rollout generation failed: {item}") from item
        return item

    def stop(self) -> None:
        """Ends the thread once the batch it is generating (if any) is done."""
        self.wanted.put(False)
        self.thread.join(timeout=600)
