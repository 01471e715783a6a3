"""Session routing: every request of a conversation goes to the engine that holds its earlier turns in its prefix
cache (vLLM's automatic prefix caching), so a turn prefills only what is new.

A session key (GenerateRequest.session_id; the dialects' session headers) maps to the engine its last request went
to. The next request with that key goes there again while that engine is ready (not restarting, joining or
draining) and holds at most `max_imbalance` sequences more than the least-loaded ready engine; otherwise it goes to
the least-loaded engine and the session moves there. The table is bounded (`max_sessions`, least recently used
forgotten first) and forgets the sessions of an engine that restarted or left the pool (its cache is gone).
Requests without a key are routed least-loaded, as before.
"""
from __future__ import annotations

import collections
from typing import Callable, Sequence

from rollout_service.engine.base import Engine

OUTCOMES = ("hit", "moved_unavailable", "moved_overloaded", "started")


class SessionTable:
    def __init__(self, max_sessions: int = 100_000, max_imbalance: int = 32,
                 on_route: Callable[[str], None] | None = None):
        """max_sessions: sessions remembered (0: no session routing, every request least-loaded).
        max_imbalance: how many more sequences than the least-loaded ready engine a session's engine may hold and
        still take the session's next request. on_route(outcome): a metrics hook, called once per keyed request."""
        self.max_sessions = max_sessions
        self.max_imbalance = max_imbalance
        self.on_route = on_route
        self.engine_of: collections.OrderedDict[str, str] = collections.OrderedDict()   # oldest first
        self.per_engine: collections.Counter[str] = collections.Counter()               # sessions per engine id
        self.counts = dict.fromkeys(OUTCOMES, 0)
        self.evicted = 0

    def __len__(self) -> int:
        return len(self.engine_of)

    def route(self, key: str, ready: Sequence[Engine], load: dict[str, int]) -> Engine:
        """The engine for a request with session `key` ("" for none) among `ready` (non-empty), given each engine's
        assigned sequences; remembers the choice."""
        least = min(ready, key=lambda e: load[e.id])
        if not key or not self.max_sessions:
            return least
        known = self.engine_of.get(key)
        chosen = least
        if known is None:
            outcome = "started"
        else:
            home = next((e for e in ready if e.id == known), None)
            if home is None:
                outcome = "moved_unavailable"
            elif load[home.id] - load[least.id] > self.max_imbalance:
                outcome = "moved_overloaded"
            else:
                outcome, chosen = "hit", home
        self._remember(key, chosen.id)
        self.counts[outcome] += 1
        if self.on_route is not None:
            self.on_route(outcome)
        return chosen

    def _remember(self, key: str, engine_id: str) -> None:
        old = self.engine_of.pop(key, None)
        if old is not None:
            self._drop_count(old)
        self.engine_of[key] = engine_id
        self.per_engine[engine_id] += 1
        while len(self.engine_of) > self.max_sessions:
            _, gone = self.engine_of.popitem(last=False)
            self._drop_count(gone)
            self.evicted += 1

    def _drop_count(self, engine_id: str) -> None:
        self.per_engine[engine_id] -= 1
        if self.per_engine[engine_id] <= 0:
            del self.per_engine[engine_id]

    def forget_engine(self, engine_id: str) -> int:
        """Forget every session on `engine_id` (it restarted with an empty cache, or left the pool): their next
        requests route as new sessions. Returns how many were forgotten."""
        if not self.per_engine.get(engine_id):
            return 0
        keys = [k for k, e in self.engine_of.items() if e == engine_id]
        for k in keys:
            del self.engine_of[k]
        self.per_engine.pop(engine_id, None)
        return len(keys)
