"""Agentic rollouts: multi-turn tool episodes from the service (rollout_client's Episode API), scored by the task and
collated as GRPO rollouts the trainer packs like any other (`--task calculator`).

An episode is ONE exact token sequence, the engine's: the first prompt, then each turn's sampled tokens and the
tokens the server inserted after them (tool results, template glue). `Episode.mask` says which were sampled; a
Rollout of an episode carries the first prompt as `prompt_ids` and everything after it as `token_ids`, with
`sampled` marking the sampled tokens: `rollouts.pack` puts the loss and the importance weights on those positions
only, and the trainer's forward pass runs on the whole sequence (every turn, every inserted token as context).
"""
from __future__ import annotations

import time

import numpy as np

from rollout_client.episode import Episode, run_episodes
from rollout_tasks import calculator
from trainer_example.rollouts import Batch, Rollout, sample_oldest_version


def encode(problems) -> list[list[dict]]:
    """Each problem's first messages (the server renders them, tools and all)."""
    return [calculator.first_messages(p) for p in problems]


def generate_episodes(client, problems, first: list[list[dict]], *, n: int, max_turns: int, max_tokens: int,
                      temperature: float, min_policy_version: int = 0, policy: str = "") -> Batch:
    """n episodes per problem (a GRPO group), run to their end or max_turns turns (one Generate per turn for every
    unfinished episode, then the calculator; a turn stops at the end of its call, calculator.STOP), scored on the
    final answer; rollouts in group order."""
    t0 = time.perf_counter()
    episodes = [e for msgs in first for e in Episode.group(msgs, n=n, tools=calculator.TOOLS)]
    extra = {"policy": policy} if policy else {}
    run_episodes(client, episodes, {calculator.NAME: calculator.calculator}, max_turns=max_turns,
                 max_tokens=max_tokens, temperature=temperature, stop=calculator.STOP,
                 min_policy_version=min_policy_version, **extra)
    rollouts = [episode_rollout(e, g // n, problems[g // n].answer) for g, e in enumerate(episodes)]
    return Batch(rollouts, len(problems), time.perf_counter() - t0)


def episode_rollout(e: Episode, group: int, answer: int) -> Rollout:
    """One finished episode as a scored rollout: the first prompt, then every later token with its sampled flag and
    log-prob (0 where inserted; masked out of the loss). Its oldest policy version is its oldest turn's."""
    p = e.num_prompt_tokens
    stats = calculator.episode_metrics(e.messages, answer)
    turns = e.turns
    return Rollout(group=group, prompt_ids=list(e.token_ids[:p]),
                   token_ids=np.asarray(e.token_ids[p:], dtype=np.int64),
                   rollout_logp=np.asarray(e.logprobs[p:], dtype=np.float32),
                   sampled=np.asarray(e.mask[p:], dtype=bool),
                   reward=calculator.episode_reward(e.messages, answer), correct=stats["correct"],
                   oldest_version=min(sample_oldest_version(s) for s in turns),
                   draft_version=max(s.draft_version for s in turns),
                   num_drafted=sum(s.num_drafted for s in turns), num_accepted=sum(s.num_accepted for s in turns),
                   answer_line=stats["answer_line"], episode=stats)


def summary(rollouts: list[Rollout]) -> dict:
    """The step's tool use (rollout_tasks.calculator.summarize over its episodes): tool_call_rate, calls_per_episode,
    well_formed_rate, turns_per_episode, ..., and the sequences' lengths (tokens, sampled tokens)."""
    out = calculator.summarize([r.episode for r in rollouts])
    out.pop("accuracy")                 # the trainer's train_accuracy / format_rate, computed the same way
    out.pop("format_rate")
    out["episode_tokens"] = float(np.mean([len(r.prompt_ids) + len(r.token_ids) for r in rollouts]))
    out["sampled_tokens"] = float(np.mean([int(r.sampled.sum()) for r in rollouts]))
    return out


def evaluate(client, problems, *, max_turns: int, max_tokens: int, policy: str = ""
             ) -> tuple[list[bool], list[bool], dict]:
    """Greedy episodes on held-out problems: (correct per problem, answer line per problem, their tool use as
    `summary`)."""
    batch = generate_episodes(client, problems, encode(problems), n=1, max_turns=max_turns, max_tokens=max_tokens,
                              temperature=0.0, policy=policy)
    return [r.correct for r in batch.rollouts], [r.answer_line for r in batch.rollouts], summary(batch.rollouts)
