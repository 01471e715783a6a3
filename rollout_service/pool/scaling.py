"""Scale the engine pool while serving (ScaleEngines).

Out: a new engine is built by the factory and joins the pool (EnginePool.join) once it is up at the committed
policy and drafter versions (EnginePool.restart_at_committed, under the push lock, so no commit interleaves). In: the
newest engines retire first (EnginePool.retire: no new work, wait until every sequence
they hold has finished, then leave the pool under the push lock and stop). Admitted requests are never dropped
by scaling.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

import grpc

from rollout_service.engine.base import Engine
from rollout_service.errors import ServiceError, invalid

log = logging.getLogger(__name__)


class Scaler:
    def __init__(self, pool, factory: Callable[[str], Engine], *, max_engines: int = 64,
                 drain_timeout_s: float = 3600.0):
        self.pool = pool
        self.factory = factory
        self.max_engines = max_engines
        self.drain_timeout_s = drain_timeout_s
        self.lock = asyncio.Lock()                     # one scaling operation at a time
        self._next = len(pool.engines)

    async def scale(self, engines: int) -> None:
        if not 1 <= engines <= self.max_engines:
            raise invalid(f"engines must be in [1, {self.max_engines}], got {engines}")
        async with self.lock:
            while len(self.pool.engines) < engines:
                await self._add()
            while len(self.pool.engines) > engines:
                await self._remove(self.pool.engines[-1])

    async def _add(self) -> None:
        engine = self.factory(f"engine-{self._next}")
        self._next += 1
        log.info("scale out: starting %s", engine.id)
        if not await self.pool.join(engine):
            raise ServiceError(grpc.StatusCode.INTERNAL, f"scale out: {engine.id} failed to start; see the server log")

    async def _remove(self, engine: Engine) -> None:
        await self.pool.retire(engine, timeout_s=self.drain_timeout_s)
        log.info("scale in: %s stopped", engine.id)
