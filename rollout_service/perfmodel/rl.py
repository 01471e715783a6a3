"""An RL step: generate a rollout batch, train on it, push the weights; synchronous or asynchronous.

    sync:  step = generate (the batch drains to its longest sample) + train + push, every GPU doing each in turn
    async: the same GPUs split between engines and trainer (in the proportion that balances the two; a continuous
           split, integer GPU counts ignored). Generation never waits for training: engines keep their sequences in
           flight, the next step's prompts filling the slots finished ones leave, so the long tail no longer idles
           them; with a maximum policy lag >= 1 the trainer works on step i while the engines generate step i + 1.
           Balanced, the step is what each takes on all the GPUs, added:
           step = generate at a full batch + the engines' commit pause + train + push
Training time: (6 + 2) x active parameters FLOPs per token (forward and backward, and the log-prob recompute of
the samples) at the profile's train_mfu over `train_gpus`, unless a measured seconds per token is given. The push
sends the policy's bf16 weights at hw.push_bw; engines pause only to swap (weights per device over HBM bandwidth).
So at equal GPUs async gains exactly what the draining tail wastes. The lag bound changes nothing here once it is
>= 1 (steady state); it bounds staleness, and it lets a long step's tail overlap the next step, which the steady
state already assumes.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from rollout_service.perfmodel.hardware import Hardware
from rollout_service.perfmodel.model import Transformer


@dataclass
class RLStep:
    mode: str
    generate_s: float
    train_s: float
    push_s: float
    step_s: float

    def as_dict(self) -> dict:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}


def train_seconds(policy: Transformer, hw: Hardware, tokens: int, train_gpus: int,
                  s_per_token: float | None = None) -> float:
    if s_per_token is not None:
        return s_per_token * tokens
    return 8 * policy.active_params() * tokens / (train_gpus * hw.flops * hw.train_mfu)


def push_seconds(policy: Transformer, hw: Hardware, tp: int = 1) -> float:
    """Each of an engine's tp devices receives its shard over its own link."""
    return policy.params() * hw.bytes_per_param / (tp * hw.push_bw)


def rl_step(mode: str, generate_drain_s: float, generate_full_s: float, train_s: float, push_s: float,
            pause_s: float = 0.0, max_lag: int = 1) -> RLStep:
    """generate_drain_s: the batch generated alone, draining; generate_full_s: the same tokens at a full batch."""
    if mode == "sync" or max_lag < 1:
        return RLStep("sync", generate_drain_s, train_s, push_s, generate_drain_s + train_s + push_s)
    step = generate_full_s + pause_s + train_s + push_s
    return RLStep(f"async (lag {max_lag})", generate_full_s, train_s, push_s, step)
