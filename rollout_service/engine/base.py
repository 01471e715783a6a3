"""What the pool needs from an engine. Implementations: VllmEngine (real), FakeEngine (unit tests)."""
from __future__ import annotations

import abc
import asyncio
import enum
from collections.abc import Callable

from rollout_service.engine.types import SeqRequest, SeqResult, TokenDelta


class EngineState(enum.Enum):
    STARTING = 1
    READY = 2
    PAUSED = 3
    UNHEALTHY = 4
    STOPPED = 5


class Engine(abc.ABC):
    """One inference engine. `generate` is cancellation-safe: cancelling it aborts the sequence."""

    # Whether its start may overlap other engines' (pool.start): an engine in a process of its own (a Ray actor)
    # starts apart from the others; engines started in this process from threads start one at a time.
    starts_apart = False

    def __init__(self, engine_id: str):
        self.id = engine_id
        self.state = EngineState.STARTING
        self.location = "local"
        self.policy_version = 0           # labels: the committed versions the pool last gave it (set_versions)
        self.draft_version = 0
        self.restarts = 0                 # times the supervisor brought it back after it died
        self.patches: list[dict] = []     # engine/patches.py's report from the engine's worker (vLLM engines)

    def alive(self) -> bool:
        """Whether the engine's processes are still there (checked by pool.supervisor every second)."""
        return True

    def death_reason(self) -> str:
        return ""

    async def k_control_snapshot(self) -> dict | None:
        """The k controller's state (speculation/k_controller.py KController.snapshot), or None where k is not
        chosen automatically."""
        return None

    async def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache (HTTP /reset_prefix_cache, /flush_cache); False where the engine cannot."""
        return False

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model; on return the engine is READY."""

    @abc.abstractmethod
    async def generate(self, req: SeqRequest, on_delta: Callable[[TokenDelta], None] | None = None) -> SeqResult:
        """Generate one sequence to completion. on_delta (with req.stream): called with the new tokens as the
        engine produces them, before the result is returned; an engine that cannot report them never calls it."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stop the engine and every process it started."""

    # ---- control plane: used only by weights.committer, under its lock ----------------------------
    @abc.abstractmethod
    async def pause(self, mode: str) -> None:
        """Stop generating: "abort" in-flight sequences, "wait" for them, or "keep" them paused."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Continue generating (kept sequences continue under the weights now loaded)."""

    @abc.abstractmethod
    async def load_weights(self, path: str, target: str) -> None:
        """Load the tensors of a safetensors file into the "policy" or the "drafter" in place (engine
        paused). Rollbacks and restarts use it; commits use prepare_weights + swap_weights."""

    @abc.abstractmethod
    async def prepare_weights(self, paths: list[str], target: str) -> bool:
        """Load the tensors of safetensors files beside the served "policy" or "drafter" weights, while
        the engine keeps generating. Nothing served changes; raises if they cannot be loaded. False: this
        engine loads in place instead (engine.weight_reload = "in_place"), so the commit calls load_weights
        while paused."""

    async def init_transfer(self, init_info: dict) -> int:
        """Join a weight-transfer group (vLLM's init_weight_transfer_engine with this engine's rank offset in
        `init_info`); returns once every worker joined. Returns how many ranks the engine takes (its workers)."""
        raise NotImplementedError(f"{type(self).__name__} has no weight-transfer backend")

    async def close_transfer(self) -> None:
        """Leave the weight-transfer group, if any."""

    def transfer_ranks(self) -> int:
        """Ranks this engine takes in a weight-transfer group (one per worker)."""
        return 1

    async def prepare_transfer(self, update_info: dict, target: str, record_path: str, on_receiving) -> None:
        """prepare_weights, the tensors arriving over the weight-transfer group: calls on_receiving() once the
        engine listens, returns once they are loaded beside the served weights (then swap_weights or
        discard_weights). record_path: also write them there as safetensors (empty: do not)."""
        raise NotImplementedError(f"{type(self).__name__} has no weight-transfer backend")

    async def receive_transfer(self, update_info: dict, record_path: str, on_receiving) -> None:
        """Take part in a push over the weight-transfer group without loading what arrives into a model (a LoRA
        adapter's tensors, loaded after as an adapter): calls on_receiving() once the engine listens, returns once
        every tensor arrived. record_path (non-empty on one engine): also write them there as safetensors."""
        raise NotImplementedError(f"{type(self).__name__} has no weight-transfer backend")

    @abc.abstractmethod
    async def swap_weights(self, target: str) -> None:
        """Serve the prepared weights from the next step on (engine paused)."""

    async def apply_weights(self, prepared: bool, paths: list[str], target: str) -> None:
        """The commit's step while paused: serve what prepare_weights loaded (prepared True), or load `paths` in
        place (it returned False)."""
        if prepared:
            await self.swap_weights(target)
        else:
            for path in paths:
                await self.load_weights(str(path), target)

    @abc.abstractmethod
    async def discard_weights(self) -> None:
        """Drop prepared weights, if any."""

    async def add_adapter(self, name: str, lora_id: int, path: str) -> None:
        """Load a LoRA adapter (a PEFT directory at `path`) as vLLM LoRA `lora_id` named `name`, while generating;
        raises when the engine cannot (an adapter it refuses, LoRA off)."""
        raise NotImplementedError(f"{type(self).__name__} serves no LoRA adapters")

    async def remove_adapter(self, lora_id: int) -> None:
        """Unload LoRA `lora_id` (no sequence runs on it any more)."""
        raise NotImplementedError(f"{type(self).__name__} serves no LoRA adapters")

    @abc.abstractmethod
    async def set_versions(self, policy_version: int, draft_version: int) -> None:
        """Label what the engine now serves; samples carry these from the next step on."""


class EngineGone(RuntimeError):
    """An engine died while a control-plane call waited for it (unless_dead)."""


async def unless_dead(engine, call, poll_s: float = 0.2):
    """Await `call` (a coroutine on `engine`), raising EngineGone once the engine is no longer alive. vLLM 0.32 never
    answers a call (AsyncLLM.add_lora, pause_generation, collective_rpc) sent to an engine core that then died: its
    AsyncMPClient leaves the call's future pending. A commit awaiting one held the push lock for good, and the
    supervisor, which restarts a dead engine under that lock, waited behind it: the pool never served again
    (bench/soak.py: an engine killed while an adapter push committed). Every control-plane call made under the push
    lock goes through this (weights/committer.py, weights/adapter_commit.py, pool/pool.py)."""
    task = asyncio.ensure_future(call)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if not engine.alive():
                raise EngineGone(f"{engine.id} died ({engine.death_reason() or 'not alive'})")
    finally:
        if not task.done():
            task.cancel()
