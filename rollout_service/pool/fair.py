"""Fair shares of each engine between tenants (security.tenants): one tenant's burst never starves another.

Each engine has `slots` (its batch, engine.max_num_seqs): a sequence holds one while the engine generates it. When
every slot is taken, sequences wait here, per tenant in arrival order; a freed slot goes to the waiting tenant with
the fewest sequences running on that engine (ties: the one served longest ago). So a tenant that floods the pool
gets the slots nobody else wants, and a small tenant's next sequence starts as soon as one of the flood's finishes,
instead of behind all of them in vLLM's first-come queue. Without tenants every sequence is the same tenant ("") and
the order is first come, first served, as before.
"""
from __future__ import annotations

import asyncio
import collections
import itertools


class FairGate:
    def __init__(self, slots: int):
        self.slots = slots
        self.running: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)   # engine -> tenant
        self.waiting: dict[str, dict[str, collections.deque]] = collections.defaultdict(dict)       # engine -> tenant
        self.last_served: dict[tuple[str, str], int] = {}
        self._tick = itertools.count()

    def waiting_of(self, tenant: str) -> int:
        return sum(len(q.get(tenant, ())) for q in self.waiting.values())

    async def acquire(self, engine: str, tenant: str) -> None:
        """Wait for a slot on `engine` for one sequence of `tenant`."""
        running = self.running[engine]
        if sum(running.values()) < self.slots and not any(self.waiting[engine].values()):
            self._grant(engine, tenant)
            return
        fut = asyncio.get_running_loop().create_future()
        self.waiting[engine].setdefault(tenant, collections.deque()).append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():     # granted just as it was cancelled: give the slot on
                self.release(engine, tenant)
            elif fut in self.waiting[engine][tenant]:
                self.waiting[engine][tenant].remove(fut)
            raise

    def release(self, engine: str, tenant: str) -> None:
        """A sequence of `tenant` left `engine`: its slot goes to the fairest waiting tenant."""
        running = self.running[engine]
        running[tenant] -= 1
        if running[tenant] <= 0:
            del running[tenant]
        queues = {t: q for t, q in self.waiting[engine].items() if q}
        if not queues or sum(running.values()) >= self.slots:
            return
        for q in queues.values():                    # cancelled waiters not yet removed by their own task
            while q and q[0].done():
                q.popleft()
        queues = {t: q for t, q in queues.items() if q}
        if not queues:
            return
        pick = min(queues, key=lambda t: (running.get(t, 0), self.last_served.get((engine, t), -1)))
        fut = queues[pick].popleft()
        self._grant(engine, pick)
        fut.set_result(None)

    def _grant(self, engine: str, tenant: str) -> None:
        self.running[engine][tenant] += 1
        self.last_served[(engine, tenant)] = next(self._tick)
