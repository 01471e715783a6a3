"""Generate requests in flight or recently finished: idempotent replay and cancellation bookkeeping.

A RequestRecord collects the samples of one Generate request as they finish. Any number of streams
(the first attempt and its retries) read it from the start; when the last reader leaves before the
request finished, the record is cancelled (its engine sequences are aborted) and forgotten.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from rollout_service.engine.types import SeqResult
from rollout_service.errors import ServiceError


@dataclass
class IndexedResult:
    prompt_index: int
    sample_index: int
    result: SeqResult


@dataclass(eq=False)
class RequestRecord:
    request_id: str
    fingerprint: bytes              # identifies the request's content: a retry must match it
    expected: int                   # samples to produce
    results: list[IndexedResult] = field(default_factory=list)
    error: ServiceError | None = None
    done: bool = False
    finished_at: float = 0.0
    readers: int = 0
    tasks: list[asyncio.Task] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, item: IndexedResult) -> None:
        self.results.append(item)
        self._notify()

    def finish(self, error: ServiceError | None = None) -> None:
        if self.done:
            return
        self.error = error
        self.done = True
        self.finished_at = time.monotonic()
        self._notify()

    def cancel(self) -> None:
        for t in self.tasks:
            t.cancel()

    def _notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    async def read(self):
        """Yield every result from the first; raise the record's error, if any, at the end."""
        i = 0
        while True:
            while i < len(self.results):
                yield self.results[i]
                i += 1
            if self.done:
                if self.error is not None:
                    raise self.error
                return
            await self.changed.wait()


class RequestRegistry:
    """request_id -> RequestRecord, keeping finished records for `ttl_s` so retries replay them."""

    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._records: dict[str, RequestRecord] = {}

    def get(self, request_id: str) -> RequestRecord | None:
        self._expire()
        return self._records.get(request_id)

    def put(self, record: RequestRecord) -> None:
        self._records[record.request_id] = record

    def drop(self, request_id: str) -> None:
        self._records.pop(request_id, None)

    def _expire(self) -> None:
        now = time.monotonic()
        old = [k for k, r in self._records.items() if r.done and r.readers == 0 and now - r.finished_at > self.ttl_s]
        for k in old:
            del self._records[k]
