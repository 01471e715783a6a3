"""Engine supervision: notice an engine that died and bring it back at the committed versions.

An engine is dead when its own liveness check fails (vLLM: the engine-core process is gone, AsyncLLM is
`errored`) or when it reported itself UNHEALTHY. Its in-flight sequences fail on their own (vLLM raises
EngineDeadError into every pending generate), so their requests end with UNAVAILABLE ("retry the
request"); their request ids are released, so a retry with the same id runs again. The supervisor then
restarts the engine through `restart` (EnginePool.restart_at_committed: start from the checkpoint,
replay every committed policy and drafter push, label the versions) with exponential back-off when
restarts keep failing. While no engine is ready, Generate answers UNAVAILABLE ("retry shortly").
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from rollout_service.engine.base import Engine, EngineState

log = logging.getLogger(__name__)


class Supervisor:
    def __init__(self, pool, restart: Callable[[Engine], Awaitable[None]], *, interval_s: float = 1.0,
                 max_backoff_s: float = 60.0):
        self.pool = pool
        self.restart = restart
        self.interval_s = interval_s
        self.max_backoff_s = max_backoff_s
        self.restarting: dict[str, asyncio.Task] = {}
        self.failures: dict[str, int] = {}          # consecutive failed restarts, for back-off

    async def run(self) -> None:
        while not self.pool.closing:
            self.check()
            await self.pool.refresh_k_control(self.interval_s)
            await asyncio.sleep(self.interval_s)

    def check(self) -> list[str]:
        """One pass: returns the ids of engines found dead (and now being restarted)."""
        found = []
        for e in self.pool.engines:
            if self.pool.closing or e.id in self.restarting:
                continue
            dead = e.state is EngineState.UNHEALTHY or (
                e.state in (EngineState.READY, EngineState.PAUSED) and not e.alive())
            if dead:
                self.pool.mark_unhealthy(e, f"engine is dead ({e.death_reason() or 'unhealthy'}); failing its "
                                            "in-flight requests as retriable and restarting it at the committed "
                                            "versions")
                found.append(e.id)
                self.restarting[e.id] = asyncio.create_task(self._restart(e))
        return found

    async def _restart(self, engine: Engine) -> None:
        try:
            n = self.failures.get(engine.id, 0)
            if n:
                await asyncio.sleep(min(self.max_backoff_s, 2.0 ** n))
            if self.pool.closing:
                return
            await self.restart(engine)
            if engine.state is EngineState.READY:
                engine.restarts += 1
                self.pool.telemetry.engine_restarted(engine.id)
                self.failures.pop(engine.id, None)
            else:
                self.failures[engine.id] = n + 1
        finally:
            self.restarting.pop(engine.id, None)

    async def stop(self) -> None:
        for t in list(self.restarting.values()):
            t.cancel()
        await asyncio.gather(*self.restarting.values(), return_exceptions=True)
