"""Scale the engine pool while serving (ScaleEngines).

Out: a new engine is built by the factory, brought up at the committed policy and drafter versions
(WeightCommitter.restart_at_committed: start, replay every committed push, label versions; under the push
lock, so no commit interleaves) and only then joins routing. In: the newest engines are drained first
(no new work is routed to them), wait until every sequence they hold has finished, and then leave the
pool and stop, under the push lock. Admitted requests are never dropped by scaling.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

import grpc

from rollout_service.engine.base import Engine, EngineState
from rollout_service.errors import ServiceError, invalid

log = logging.getLogger(__name__)


class Scaler:
    def __init__(self, pool, committer, factory: Callable[[str], Engine], *, max_engines: int = 64,
                 drain_timeout_s: float = 3600.0):
        self.pool = pool
        self.committer = committer
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
        engine.state = EngineState.STARTING
        self.pool.add_engine(engine)                    # visible in status while starting, not routed to
        self.pool.joining.add(engine.id)
        log.info("scale out: starting %s", engine.id)
        try:
            await self.committer.restart_at_committed(engine)
        finally:
            self.pool.joining.discard(engine.id)
        if engine.state is not EngineState.READY:
            self.pool.remove_engine(engine)
            await engine.shutdown()
            raise ServiceError(grpc.StatusCode.INTERNAL, f"scale out: {engine.id} failed to start; see the server log")

    async def _remove(self, engine: Engine) -> None:
        self.pool.draining.add(engine.id)
        log.info("scale in: draining %s (%d sequences)", engine.id, self.pool.load[engine.id])
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.drain_timeout_s
            while self.pool.load[engine.id] and loop.time() < deadline:
                await asyncio.sleep(0.1)
            async with self.committer.lock:             # never mid-commit
                self.pool.remove_engine(engine)
            await engine.shutdown()
        finally:
            self.pool.draining.discard(engine.id)
        log.info("scale in: %s stopped", engine.id)
