"""A verifiable task generated locally: multi-step arithmetic word problems with a checkable answer.

Pure functions: make_problem(seed) is deterministic, reward(text, answer) depends only on its inputs.
The evaluation split uses seeds disjoint from training (see split()).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

NAMES = ["Ava", "Ben", "Chen", "Dara", "Eli", "Farah", "Gus", "Hana"]
ITEMS = ["apples", "marbles", "stickers", "coins", "books", "shells"]
INSTRUCTION = "Solve the problem. End with a line of the form 'Answer: <number>'."
ANSWER_RE = re.compile(r"Answer:\s*(-?\d+)\s*$", re.MULTILINE)
EVAL_SEED_OFFSET = 10_000_000


@dataclass(frozen=True)
class Problem:
    question: str
    answer: int

    @property
    def prompt(self) -> str:
        return f"{self.question}\n{INSTRUCTION}"


def make_problem(seed: int, steps: int | None = None) -> Problem:
    rng = random.Random(seed)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    total = rng.randint(2, 20)
    parts = [f"{name} has {total} {item}."]
    for _ in range(steps or rng.randint(1, 3)):
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


def split(n: int, *, eval: bool = False, start: int = 0) -> list[Problem]:
    base = EVAL_SEED_OFFSET if eval else 0
    return [make_problem(base + start + i) for i in range(n)]


def extract_answer(text: str) -> int | None:
    m = ANSWER_RE.findall(text.strip())
    return int(m[-1]) if m else None


def reward(text: str, answer: int) -> float:
    """1 for a correct final answer line, 0.1 for a well-formed but wrong one, 0 otherwise."""
    got = extract_answer(text)
    if got is None:
        return 0.0
    return 1.0 if got == answer else 0.1
