"""Generate requests in flight or recently finished: idempotent replay and cancellation bookkeeping.

A RequestRecord collects the samples of one Generate request as they finish. Any number of streams
(the first attempt and its retries) read it from the start; when the last reader leaves before the
request finished, the record is cancelled (its engine sequences are aborted) and forgotten.

With token streaming, it also holds each unfinished sample's tokens so far (Progress, dropped when the sample
finishes). A reader remembers how far it has sent each sample and sends what is new since: a slow reader gets
the steps it missed as one delta, so the engine never waits for a reader and a record never holds more than its
samples' tokens.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from rollout_service.engine.types import Routes, SeqResult, TokenDelta, joined_spans
from rollout_service.errors import ServiceError


@dataclass
class IndexedResult:
    prompt_index: int
    sample_index: int
    result: SeqResult


@dataclass
class IndexedDelta:
    prompt_index: int
    sample_index: int
    delta: TokenDelta


@dataclass
class Progress:
    """An unfinished sample's tokens so far, as the engine reported them (TokenDelta's fields, whole), from index
    `first` of the sample on (a continued partial sample's new tokens start after the partial's)."""
    first: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_token_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    version_spans: list[tuple[int, int]] = field(default_factory=list)
    routes: Routes | None = None     # routed-experts rows reported so far (GenerateRequest.return_routed_experts)

    def extend(self, d: TokenDelta) -> None:
        if d.start != self.end:          # never: an engine reports every token once, in order
            raise ValueError(f"a delta starting at {d.start} follows the tokens before {self.end}")
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs
        if d.top_token_ids:
            self.top_token_ids += d.top_token_ids
            self.top_logprobs += d.top_logprobs
        spans = d.version_spans
        if not (len(spans) == 1 and self.version_spans and self.version_spans[-1][0] == spans[0][0]):
            self.version_spans = joined_spans(self.version_spans, spans)   # (the same version: nothing to add)
        if d.routed_experts is not None:
            self.routes = d.routed_experts if self.routes is None else self.routes.then(d.routed_experts)

    @property
    def rows_end(self) -> int:
        """The index after the last routed-experts row held (0: none)."""
        return self.routes.end if self.routes is not None else 0

    @property
    def end(self) -> int:
        """The index after the last token held."""
        return self.first + len(self.token_ids)

    def since(self, start: int, row: int = 0) -> TokenDelta:
        """The tokens from index `start` (>= first) on, with the versions that produced them, and the routed-experts
        rows from index `row` on."""
        off = start - self.first
        spans = [(v, max(t, start)) for i, (v, t) in enumerate(self.version_spans)
                 if i + 1 == len(self.version_spans) or self.version_spans[i + 1][1] > start]
        return TokenDelta(start=start, token_ids=self.token_ids[off:], logprobs=self.logprobs[off:],
                          version_spans=spans, top_token_ids=self.top_token_ids[off:],
                          top_logprobs=self.top_logprobs[off:],
                          routed_experts=self.routes.since(row) if self.routes is not None and self.rows_end > row
                          else None)


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
    progress: dict[tuple[int, int], Progress] = field(default_factory=dict)   # unfinished samples (streaming)
    return_partial: bool = False    # an aborted sample is a result, not the request's failure

    def add(self, item: IndexedResult) -> None:
        self.progress.pop((item.prompt_index, item.sample_index), None)
        self.results.append(item)
        self._notify()

    def add_delta(self, prompt_index: int, sample_index: int, delta: TokenDelta) -> None:
        """New tokens of an unfinished sample (called by the engine's step loop: never blocks)."""
        if self.done:
            return
        prog = self.progress.get((prompt_index, sample_index))
        if prog is None:
            prog = self.progress[(prompt_index, sample_index)] = Progress(first=delta.start)
        prog.extend(delta)
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
        """Wake the readers. The event stays set until a reader looks again (batches): an engine step's thousand
        deltas set it once, not a thousand fresh events."""
        self.changed.set()

    async def read(self, deltas: bool = False):
        """Yield every result from the first; raise the record's error, if any, at the end. deltas: also yield an
        IndexedDelta with the tokens of each unfinished sample that are new since this reader's last one."""
        async for batch in self.batches(deltas):
            for item in batch:
                yield item

    async def batches(self, deltas: bool = False):
        """read(), a list at a time: the results and deltas that are new each time the record changed (after an
        engine step, one delta per unfinished sample), so that a reader can handle them together (one hop to the
        tokenizer thread, one write)."""
        i = 0
        sent: dict[tuple[int, int], tuple[int, int]] = {}   # per unfinished sample: the tokens and routed-experts
        #                                                     rows this reader has sent
        while True:
            if self.changed.is_set():     # what set it is read below; anything later sets the new one
                self.changed = asyncio.Event()
            changed = self.changed
            batch: list[IndexedResult | IndexedDelta] = self.results[i:]
            i += len(batch)
            if deltas:                    # a finished sample has left progress: no delta follows its result
                for key, prog in self.progress.items():
                    at, row = sent.get(key, (prog.first, 0))
                    if prog.end > at:
                        sent[key] = (prog.end, prog.rows_end)
                        batch.append(IndexedDelta(key[0], key[1], prog.since(at, row)))
            if batch:                     # the yield may have waited: look again before sleeping
                yield batch
                continue
            if self.done:
                if self.error is not None:
                    raise self.error
                return
            await changed.wait()


def split(batch: list) -> tuple[list[IndexedResult], list[IndexedDelta]]:
    """A RequestRecord.batches list -> (the samples that finished, the unfinished samples' deltas)."""
    finished = [x for x in batch if isinstance(x, IndexedResult)]
    return finished, [x for x in batch if isinstance(x, IndexedDelta)]


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
