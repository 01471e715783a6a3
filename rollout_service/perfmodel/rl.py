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
sends the policy's bf16 weights by the path the user chose (PUSH_PATHS); engines pause only to swap (weights per
device over HBM bandwidth: swap_seconds). A push of only the elements that changed: weight_sync.py.
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


# How fast each push path moves weights into one engine device, bytes/s (None: the hardware's push_bw, the NIC line
# rate), and whether the rate is per device (a tp-sharded engine receives its shards in parallel) or for the whole
# policy. Sources:
# - nccl: verl's NCCL broadcast, trainer to engine, 8.25 GB/s per GPU (published; issue 28), capped by the link.
# - ipc: a trainer on the same GPU hands its weights over by CUDA IPC handles and the engine copies them: 2 GB in
#   12 ms on an H200 the first time (handle open + copy: 165 GB/s), 1.4 ms after (perf/gpu_ipc_probe.py,
#   bench/results/gpu_ipc_probe.json, 2026-11-26); the first-time rate is used.
# - stream: PushWeights through the front end (gRPC, staging, one copy for every engine): 0.24-0.33 GB/s measured
#   on 2 CPU cores (bench/weight_transfer.py); host-bound, not per device. A GPU node's host is faster; this is the
#   floor the path was measured at.
# - gloo: the CPU backend, 0.33-0.60 GB/s end to end on 2 cores (bench/weight_transfer.py).
# - link: the NIC line rate of the hardware profile (push_bw), the bound no path exceeds across nodes.
PUSH_PATHS = {"nccl": (8.25e9, True), "ipc": (165e9, True), "stream": (0.3e9, False), "gloo": (0.6e9, False),
              "link": (None, True)}


def push_seconds(policy: Transformer, hw: Hardware, tp: int = 1, path: str = "link", ep: int = 1) -> float:
    """Seconds to move the policy's weights into an engine by `path` (PUSH_PATHS); a per-device path moves each
    device's share in parallel (step.device_weight_bytes: with expert parallelism, its experts and dense shard)."""
    from rollout_service.perfmodel.step import device_weight_bytes

    rate, per_device = PUSH_PATHS[path]
    if rate is None:
        rate = hw.push_bw
    elif path == "nccl":
        rate = min(rate, hw.push_bw)
    if per_device:
        return device_weight_bytes(policy, hw.bytes_per_param, tp, ep) / rate
    return policy.params() * hw.bytes_per_param / rate


def swap_seconds(policy: Transformer, hw: Hardware, tp: int = 1, ep: int = 1) -> float:
    """What the engines pause for to take a full push in: each device's weights copied once at its memory
    bandwidth (step.device_weight_bytes)."""
    from rollout_service.perfmodel.step import device_weight_bytes

    return device_weight_bytes(policy, hw.bytes_per_param, tp, ep) / (hw.mem_bw * hw.mem_eff)


def rl_step(mode: str, generate_drain_s: float, generate_full_s: float, train_s: float, push_s: float,
            pause_s: float = 0.0, max_lag: int = 1) -> RLStep:
    """generate_drain_s: the batch generated alone, draining; generate_full_s: the same tokens at a full batch."""
    if mode == "sync" or max_lag < 1:
        return RLStep("sync", generate_drain_s, train_s, push_s, generate_drain_s + train_s + push_s)
    step = generate_full_s + pause_s + train_s + push_s
    return RLStep(f"async (lag {max_lag})", generate_full_s, train_s, push_s, step)
