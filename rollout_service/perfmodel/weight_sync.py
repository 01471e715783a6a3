"""Weight sync: one step's push of the policy, whole or as a delta, over a link, and its share of an RL step.

    full     every element in bf16: hw.bytes_per_param (2) bytes a parameter
    delta    only the elements whose bf16 value changed since the last push, each sent as a uint32 flat index and
             its bf16 value (PushHeader.base_version, TensorChunk.indices + data): 6 bytes, so a delta is
             2 / (6 density) times smaller than a full push: 33x at 1% of elements changed, 17x at 2%
    anchored a full push ("anchor") every N steps and deltas between: (full + (N - 1) delta) / N per step, in bytes
             and in seconds alike (both are linear)
    seconds  transfer + apply. Transfer: rl.push_seconds for the link or push path (each engine device receives its
             shard over its own link, as an HGX GPU has its own NIC: a tp-8 engine takes 1/8 of one link's time;
             the trainer's side is not the bound; `links=1`: the whole policy over one link); a delta takes the full
             push's time scaled by its bytes. Apply, full: the engines' pause to copy their weights in
             (rl.swap_seconds); delta: a scatter of the changed elements into the served weights (modelled:
             SCATTER_EFF, APPLY_FIXED_S).
    share    seconds / (step_s + seconds): step_s is the rest of a sync RL step, generate + train (rl.rl_step),
             which the caller takes from the RL step model (perf/projections.py --weight-sync: simulate.build)
Not modelled: compressing the delta. zlib level 1 halves the payload (47-68x against full) but costs ~0.13 s of
one CPU core per 10 MB, so it pays only on links below ~0.3 Gb/s.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from rollout_service.perfmodel.hardware import Hardware
from rollout_service.perfmodel.model import Transformer
from rollout_service.perfmodel.rl import PUSH_PATHS, push_seconds, swap_seconds
from rollout_service.perfmodel.step import device_weight_bytes

# Fraction of a policy's elements whose bf16 value changes in one RL step. Measured on this repo's default model
# (SmolLM2-135M, AdamW at the trainer's default lr 5e-6, bf16 cast of float32 master weights): 0.98%, 1.43%, 1.01%
# over 3 steps. Hugging Face TRL's delta sync reports ~1% per step, never more than 2% (TRL #5417, #5937).
DENSITY = 0.01
DENSITY_MAX = 0.02
INDEX_BYTES = 4             # a uint32 flat element index per changed element (TensorChunk.indices)
# A full push every N steps: the client's default (rollout_client.delta, anchor_every=20). Fireworks: every 20-30 steps.
ANCHOR_EVERY = 20

# Links a push crosses, bytes/s per direction into one engine device (None: the hardware's NVLink, link_bw: 450 GB/s
# on H100/H200, NVLink 4; 900 GB/s on GB200/B200, NVLink 5). 400 Gb/s is the H100/H200 profiles' NIC (push_bw,
# ConnectX-7, PUSH_PATHS' "link"); 100 Gb/s a cheaper cluster's. Any PUSH_PATHS name (nccl, ipc, ...) works too.
LINKS = {"nvlink": None, "400g": 50e9, "100g": 12.5e9}

# Applying a delta on a GPU engine is a scatter of the changed elements into the served weights (vLLM 0.32's
# checkpoint_weight_patch.py, the `sparse_nccl` engine). Modelled, not measured: a 2-byte write scattered over HBM
# moves a 32-byte sector in and out, so of the ~70 bytes that cross HBM per changed element its 6 bytes of payload
# are ~1/10 (SCATTER_EFF of the profile's achieved bandwidth); plus a fixed cost for launching the scatter over the
# engine's tensors and synchronising (APPLY_FIXED_S, a guess).
SCATTER_EFF = 0.1
APPLY_FIXED_S = 5e-3


@dataclass(frozen=True)
class Sync:
    """One way of pushing the policy, per RL step: bytes the trainer sends (the whole policy's), seconds (transfer
    into the engine's devices in parallel, then apply) and the share of the sync RL step (None without step_s)."""
    bytes: float
    transfer_s: float
    apply_s: float
    share: float | None = None

    @property
    def seconds(self) -> float:
        return self.transfer_s + self.apply_s


@dataclass(frozen=True)
class WeightSync:
    link: str
    density: float
    anchor_every: int
    full: Sync          # every step a full push
    delta: Sync         # one delta step alone
    anchored: Sync      # the mean step with a full push every anchor_every steps

    def ratio(self, sync: Sync) -> float:
        """How many times fewer bytes than a full push."""
        return self.full.bytes / sync.bytes


def transfer_seconds(policy: Transformer, hw: Hardware, link: str, tp: int = 1, ep: int = 1,
                     links: int | None = None) -> float:
    """A full push's transfer over `link` (LINKS, or a PUSH_PATHS path): rl.push_seconds, each engine device over its
    own link; `links` (LINKS only): the whole policy over that many links instead (1: the trainer's one NIC)."""
    if link in PUSH_PATHS and links is None:
        return push_seconds(policy, hw, tp, link, ep)
    rate = hw.link_bw if LINKS[link] is None else LINKS[link]
    if links is not None:
        return policy.params() * hw.bytes_per_param / (links * rate)
    return push_seconds(policy, replace(hw, push_bw=rate), tp, "link", ep)


def delta_apply_seconds(policy: Transformer, hw: Hardware, density: float, tp: int = 1, ep: int = 1) -> float:
    """A delta's scatter into one device's weights (modelled above). On this CPU host (the `cpu` profile) vLLM
    re-packs (oneDNN) every layer a push touches, and a ~1% delta spread over every tensor touches every layer: the
    delta applies at a full push's cost, the CPU's floor and not a GPU cost."""
    if hw.name == "cpu":
        return swap_seconds(policy, hw, tp, ep)
    changed = density * device_weight_bytes(policy, hw.bytes_per_param, tp, ep) / hw.bytes_per_param
    return APPLY_FIXED_S + changed * (INDEX_BYTES + hw.bytes_per_param) / (hw.mem_bw * hw.mem_eff * SCATTER_EFF)


def anchored(full: float, delta: float, every: int) -> float:
    """The mean per step of a full push every `every` steps and deltas between."""
    return (full + (every - 1) * delta) / every


def weight_sync(policy: Transformer, hw: Hardware, link: str = "400g", density: float = DENSITY,
                anchor_every: int = ANCHOR_EVERY, tp: int = 1, ep: int = 1, step_s: float | None = None,
                links: int | None = None) -> WeightSync:
    """Full and delta pushes of `policy` into an engine of tp (ep) devices of `hw` over `link` (one per device, or
    `links` for the whole policy), at `density` of elements changed per step; `step_s`: the sync RL step's generate
    + train seconds, for the shares."""
    def share(s: Sync) -> Sync:
        return replace(s, share=None if step_s is None else s.seconds / (step_s + s.seconds))

    full_bytes = policy.params() * hw.bytes_per_param
    delta_bytes = density * policy.params() * (INDEX_BYTES + hw.bytes_per_param)
    full_s = transfer_seconds(policy, hw, link, tp, ep, links)
    full = Sync(full_bytes, full_s, swap_seconds(policy, hw, tp, ep))
    delta = Sync(delta_bytes, full_s * delta_bytes / full_bytes, delta_apply_seconds(policy, hw, density, tp, ep))
    mean = Sync(*(anchored(f, d, anchor_every) for f, d in
                  ((full.bytes, delta.bytes), (full.transfer_s, delta.transfer_s), (full.apply_s, delta.apply_s))))
    return WeightSync(link, density, anchor_every, share(full), share(delta), share(mean))
