"""A verifiable task generated locally: arithmetic word problems (1 to 3 operations) with a checkable answer.
The bundled trainer's task and the default drafter's training prompts (rollout_tasks/__init__.py).

Pure functions: make_problem(seed) is deterministic, reward(text, answer) depends only on its inputs.
The evaluation split uses seeds disjoint from training (see split()).

The final answer is the number on the last 'Answer: N' line, or, when there is none, the last number in
the text. The reward is 1 for a correct final answer plus 0.1 for stating it on an answer line. Measured
on SmolLM2-135M-Instruct (one-operation problems, 128 samples): greedy 25% correct and 53% answer lines;
sampled at temperature 1.0, 0% correct, at 0.7, 5% (with only answer lines counted, 0% to 1%): a
strict-format reward at temperature 1 gives GRPO no signal to start from on this model.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

NAMES = ["Ava", "Ben", "Chen", "Dara", "Eli", "Farah", "Gus", "Hana"]
ITEMS = ["apples", "marbles", "stickers", "coins", "books", "shells"]
INSTRUCTION = "Solve the problem. End with a line of the form 'Answer: <number>', for example 'Answer: 7'."
ANSWER_RE = re.compile(r"Answer:\s*(-?\d+)\s*$", re.MULTILINE)
NUMBER_RE = re.compile(r"-?\d+")
EVAL_SEED_OFFSET = 10_000_000


@dataclass(frozen=True)
class Problem:
    question: str
    answer: int

    @property
    def prompt(self) -> str:
        return f"{self.question}\n{INSTRUCTION}"


def make_problem(seed: int, steps: int | None = None, max_ops: int = 3) -> Problem:
    """steps: exactly this many operations; else 1..max_ops, drawn from the seed."""
    rng = random.Random(seed)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    total = rng.randint(2, 20)
    parts = [f"{name} has {total} {item}."]
    n_ops = rng.randint(1, max_ops)
    for _ in range(steps or n_ops):
        op = rng.choice(["gets", "gives away", "doubles"] if total < 50 else ["gives away"])
        if op == "gets":
            k = rng.randint(1, 15)
            total += k
            parts.append(f"Then {name} gets {k} more.")
        elif op == "gives away":
            k = rng.randint(1, max(1, total - 1))
            total -= k
            parts.append(f"Then {name} gives away {k}.")
        else:
            total *= 2
            parts.append(f"Then the number of {item} doubles.")
    parts.append(f"How many {item} does {name} have now?")
    return Problem(" ".join(parts), total)


def split(n: int, *, eval: bool = False, start: int = 0, max_ops: int = 3) -> list[Problem]:
    base = EVAL_SEED_OFFSET if eval else 0
    return [make_problem(base + start + i, max_ops=max_ops) for i in range(n)]


def extract_answer(text: str) -> int | None:
    """The number on the last 'Answer: N' line (None without one)."""
    m = ANSWER_RE.findall(text.strip())
    return int(m[-1]) if m else None


def final_answer(text: str) -> int | None:
    """The answer line's number, else the last number in the text, else None."""
    got = extract_answer(text)
    if got is not None:
        return got
    nums = NUMBER_RE.findall(text)
    return int(nums[-1]) if nums else None


def correct(text: str, answer: int) -> bool:
    return final_answer(text) == answer


def reward(text: str, answer: int) -> float:
    """1 for a correct final answer, plus 0.1 for an 'Answer: N' line (right or wrong)."""
    return (1.0 if correct(text, answer) else 0.0) + (0.1 if extract_answer(text) is not None else 0.0)


def brevity_reward(text: str, answer: int) -> float:
    """Another task on the same prompts: answer briefly. 1 for an empty answer down to 0 at 200 characters or more
    (the answer's correctness does not count)."""
    return 1.0 - min(len(text.strip()), 200) / 200


REWARDS = {"arithmetic": reward, "brevity": brevity_reward}
