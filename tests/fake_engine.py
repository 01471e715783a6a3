"""FakeEngine: a deterministic stand-in for unit tests of routing and bookkeeping only.

Never used by integration tests, benchmarks or the demo (those run real vLLM).
"""
from __future__ import annotations

import asyncio
import math
import random

from rollout_service.engine.base import Engine, EngineState
from rollout_service.engine.types import SeqRequest, SeqResult, TokenDelta


class FakeEngine(Engine):
    def __init__(self, engine_id: str, *, vocab_size: int = 1000, step_s: float = 0.001,
                 fail_after: int | None = None):
        super().__init__(engine_id)
        self.vocab_size = vocab_size
        self.step_s = step_s
        self.fail_after = fail_after     # raise on the N-th generate call (engine failure injection)
        self.calls = 0
        self.active: set[str] = set()    # sequences currently generating
        self.aborted: list[str] = []
        self.seen: list[SeqRequest] = []
        self.events: list[tuple] = []     # control-plane calls, in order
        self.weights: dict = {}           # tensors loaded by load_weights since start
        self.fail_load = 0                # fail the next N load_weights / swap_weights calls
        self.fail_prepare = 0             # fail the next N prepare_weights calls
        self.prepared = None              # (target, tensors) from prepare_weights
        self.in_place = False             # engine.weight_reload = "in_place": prepare_weights declines
        self.dead = False                 # kill(): the engine's "process" is gone
        self.starts = 0
        self.fail_starts = 0              # fail the next N start calls
        self.aborting = False             # pause("abort"): running sequences end now, with finish "abort"
        self.cache: list[list[int]] = []  # sequences computed since start (prompt + output): a prefix cache
        self.adapters: dict[int, str] = {}   # LoRA id -> name (add_adapter)
        self.fail_adapter = 0             # fail the next N add_adapter calls

    def kill(self) -> None:
        """Simulate the engine process dying: pending and new generate calls raise, alive() is False."""
        self.dead = True

    def alive(self) -> bool:
        return not self.dead

    def dies_unanswered(self):
        """A stand-in for a control-plane method: the engine dies and the call is never answered (as vLLM 0.32 leaves a
        call sent to an engine core that then died)."""
        async def call(*args):
            self.kill()
            await asyncio.Event().wait()
        return call

    def death_reason(self) -> str:
        return "killed" if self.dead else ""

    async def start(self) -> None:
        self.starts += 1
        if self.fail_starts:
            self.fail_starts -= 1
            raise RuntimeError("injected start failure")
        self.weights = {}                 # a (re)started engine holds the checkpoint only
        self.adapters = {}                # and no adapter
        self.cache = []                   # and an empty prefix cache
        self.dead = False
        self.state = EngineState.READY

    async def generate(self, req: SeqRequest, on_delta=None) -> SeqResult:
        self.calls += 1
        self.seen.append(req)
        if self.dead:
            raise RuntimeError("engine process died")
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise RuntimeError("injected engine failure")
        if req.lora_id and req.lora_id not in self.adapters:
            raise RuntimeError(f"adapter {req.lora_name} (LoRA {req.lora_id}) is not loaded on {self.id}")
        rng = random.Random(req.seed if req.seed is not None else random.random())
        self.active.add(req.seq_id)
        tokens: list[int] = []
        try:
            finish = "length"
            for _ in range(req.max_tokens):
                await asyncio.sleep(self.step_s)
                if self.dead:
                    raise RuntimeError("engine process died")
                if self.aborting:             # as vLLM's pause in abort mode: the tokens so far, finish "abort"
                    finish = "abort"
                    break
                tok = rng.randrange(self.vocab_size)
                tokens.append(tok)
                if req.stream and on_delta is not None:
                    on_delta(TokenDelta(start=len(tokens) - 1, token_ids=[tok], logprobs=[-math.log(self.vocab_size)],
                                        version_spans=[(self.policy_version, len(tokens) - 1)],
                                        top_token_ids=self._top(tokens[-1:], req.top_logprobs),
                                        top_logprobs=self._top_lp(1, req.top_logprobs)))
                if tok in req.stop_token_ids:
                    finish = "stop"
                    break
        except asyncio.CancelledError:
            self.aborted.append(req.seq_id)
            raise
        finally:
            self.active.discard(req.seq_id)
        prompt = req.prompt_token_ids
        cached = max((_common_prefix(prompt, seen) for seen in self.cache), default=0)
        self.cache.append(prompt + tokens)
        return SeqResult(token_ids=tokens, logprobs=[-math.log(self.vocab_size)] * len(tokens),
                         finish_reason=finish, policy_version=self.policy_version,
                         version_spans=[(self.policy_version, 0)], draft_version=self.draft_version,
                         top_token_ids=self._top(tokens, req.top_logprobs),
                         top_logprobs=self._top_lp(len(tokens), req.top_logprobs),
                         num_cached_tokens=min(cached, len(prompt) - 1))

    def _top(self, tokens: list[int], k: int) -> list[list[int]]:
        """Fake top-k: the sampled token first, then the ids after it."""
        return [[(t + j) % self.vocab_size for j in range(k)] for t in tokens] if k else []

    def _top_lp(self, n: int, k: int) -> list[list[float]]:
        return [[-math.log(self.vocab_size)] * k for _ in range(n)] if k else []

    async def shutdown(self) -> None:
        self.state = EngineState.STOPPED

    async def pause(self, mode: str) -> None:
        self.events.append(("pause", mode))
        self.state = EngineState.PAUSED
        self.aborting = mode == "abort"

    async def resume(self) -> None:
        self.events.append(("resume",))
        self.aborting = False
        self.state = EngineState.READY

    async def load_weights(self, path: str, target: str) -> None:
        self.events.append(("load", target))
        if self.fail_load:
            self.fail_load -= 1
            raise RuntimeError("injected load failure")
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            for name in f.keys():
                self.weights[name] = f.get_tensor(name)

    async def prepare_weights(self, paths: list[str], target: str) -> bool:
        self.events.append(("prepare", target))
        if self.in_place:
            return False
        if self.fail_prepare:
            self.fail_prepare -= 1
            raise RuntimeError("injected prepare failure")
        from safetensors import safe_open

        self.prepared = (target, {})
        for path in paths:
            with safe_open(path, "pt") as f:
                for name in f.keys():
                    self.prepared[1][name] = f.get_tensor(name)
        return True

    async def swap_weights(self, target: str) -> None:
        self.events.append(("swap", target))
        if self.fail_load:
            self.fail_load -= 1
            raise RuntimeError("injected swap failure")
        assert self.prepared is not None and self.prepared[0] == target, "swap without prepared weights"
        self.weights.update(self.prepared[1])
        self.prepared = None

    async def discard_weights(self) -> None:
        self.events.append(("discard",))
        self.prepared = None

    async def add_adapter(self, name: str, lora_id: int, path: str) -> None:
        self.events.append(("add_adapter", name, lora_id))
        if self.fail_adapter:
            self.fail_adapter -= 1
            raise RuntimeError("injected adapter load failure")
        self.adapters[lora_id] = name

    async def remove_adapter(self, lora_id: int) -> None:
        self.events.append(("remove_adapter", lora_id))
        self.adapters.pop(lora_id, None)

    async def set_versions(self, policy_version: int, draft_version: int) -> None:
        self.policy_version, self.draft_version = policy_version, draft_version


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
