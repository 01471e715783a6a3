"""Fair shares of each engine between tenants (security.tenants): one tenant's burst never starves another.

Each engine has `slots` (its batch, engine.max_num_seqs): a sequence holds one while the engine generates it. When
the slots are taken, sequences wait here, per tenant in arrival order; a freed slot goes to the waiting tenant with
the fewest sequences running on that engine (ties: the one served longest ago). vLLM does not preempt a running
sequence for a waiting one, so without more a tenant that arrives while a flood holds every slot waits for one of
the flood's sequences to end (a whole generation). So the last `reserve` slots (a sixteenth of them, at least one,
never all) go only to a tenant running fewer than its fair share of the rest, (slots - reserve) / tenants active on
the engine (running or waiting there, itself included): a flood alone runs slots - reserve sequences, and a small
tenant's next sequence starts at once. Without tenants there is no gate (pool.py): vLLM's first-come order.
"""
from __future__ import annotations

import asyncio
import collections
import itertools


def reserve_of(slots: int) -> int:
    """Slots of an engine kept for tenants below their fair share: a sixteenth, at least one, never all."""
    return min(max(1, slots // 16), slots - 1) if slots > 0 else 0


class FairGate:
    def __init__(self, slots: int, reserve: int | None = None):
        self.slots = slots
        self.reserve = reserve_of(slots) if reserve is None else reserve
        self.running: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)   # engine -> tenant
        self.waiting: dict[str, dict[str, collections.deque]] = collections.defaultdict(dict)       # engine -> tenant
        self.last_served: dict[tuple[str, str], int] = {}
        self._tick = itertools.count()

    def waiting_of(self, tenant: str) -> int:
        return sum(len(q.get(tenant, ())) for q in self.waiting.values())

    def may_start(self, engine: str, tenant: str) -> bool:
        """Whether a sequence of `tenant` may take a slot on `engine` now: a free slot outside the reserve, or one
        of the reserve while the tenant runs fewer than its fair share of the rest."""
        running = self.running[engine]
        taken = sum(running.values())
        if taken >= self.slots:
            return False
        shared = self.slots - self.reserve
        if taken < shared:
            return True
        active = {t for t, q in self.waiting[engine].items() if q} | set(running) | {tenant}
        return running.get(tenant, 0) < shared // len(active)

    async def acquire(self, engine: str, tenant: str) -> None:
        """Wait for a slot on `engine` for one sequence of `tenant`."""
        if not self.waiting[engine].get(tenant) and self.may_start(engine, tenant):
            self._grant(engine, tenant)        # no waiting tenant may start (release hands out what it can)
            return
        fut = asyncio.get_running_loop().create_future()
        self.waiting[engine].setdefault(tenant, collections.deque()).append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():     # granted just as it was cancelled: give the slot on
                self.release(engine, tenant)
            elif fut in self.waiting[engine].get(tenant, ()):
                self.waiting[engine][tenant].remove(fut)
                self._dispatch(engine)                 # it may have been the tenant's last: the others' shares grow
            raise

    def release(self, engine: str, tenant: str) -> None:
        """A sequence of `tenant` left `engine`: its slot goes to the fairest waiting tenant that may start."""
        running = self.running[engine]
        running[tenant] -= 1
        if running[tenant] <= 0:
            del running[tenant]
        self._dispatch(engine)

    def _dispatch(self, engine: str) -> None:
        """Grant waiting sequences, fewest running first (ties: served longest ago), while one may start."""
        queues = self.waiting[engine]
        for t in list(queues):
            q = queues[t]
            while q and q[0].done():                   # cancelled waiters not yet removed by their own task
                q.popleft()
            if not q:
                del queues[t]
        running = self.running[engine]
        while queues:
            ready = [t for t in queues if self.may_start(engine, t)]
            if not ready:
                return
            pick = min(ready, key=lambda t: (running.get(t, 0), self.last_served.get((engine, t), -1)))
            fut = queues[pick].popleft()
            if not queues[pick]:
                del queues[pick]
            self._grant(engine, pick)
            fut.set_result(None)

    def _grant(self, engine: str, tenant: str) -> None:
        self.running[engine][tenant] += 1
        self.last_served[(engine, tenant)] = next(self._tick)
