"""Event-loop lag: how long the server's asyncio loop was held by one callback (a blocking call on it stalls
every RPC and /healthz at once).

A task sleeps INTERVAL_S at a time and measures how late it wakes (the lag); /metrics exports the last lag,
the largest since the server became ready, and a histogram. A watchdog thread notices a loop held longer
than `warn_s` while it is still held, samples the loop thread's stack (sys._current_frames) and logs it,
so the warning names the code holding the loop even if it never returns (a read blocked forever)."""
from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback

from prometheus_client import CollectorRegistry, Gauge, Histogram

log = logging.getLogger(__name__)
INTERVAL_S = 0.05
WARN_S = 0.2                   # the log warns above this (the integration suite fails above 0.5 s)
STACK_FRAMES = 8


class LoopWatchdog:
    def __init__(self, registry: CollectorRegistry, *, interval_s: float = INTERVAL_S, warn_s: float = WARN_S):
        self.interval_s = interval_s
        self.warn_s = warn_s
        self.max_lag = 0.0
        self._beat = time.monotonic()           # when the loop last went to sleep on the timer
        self._sampled: str | None = None        # the loop thread's stack, sampled during the current stall
        self._stop = threading.Event()
        self.m_last = Gauge("rollout_event_loop_lag_last_seconds",
                            "How late the event loop last woke a 50 ms timer", registry=registry)
        self.m_max = Gauge("rollout_event_loop_lag_max_seconds",
                           "Longest the event loop was held since the server became ready", registry=registry)
        self.m_lag = Histogram("rollout_event_loop_lag_seconds", "How late the event loop woke a 50 ms timer",
                               buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
                               registry=registry)

    async def run(self) -> None:
        """Measure until cancelled; call from the loop to watch."""
        loop_thread = threading.get_ident()
        watcher = threading.Thread(target=self._watch, args=(loop_thread,), name="loop-watchdog", daemon=True)
        watcher.start()
        try:
            while True:
                t0 = self._beat = time.monotonic()
                await asyncio.sleep(self.interval_s)
                self.observe(time.monotonic() - t0 - self.interval_s)
        finally:
            self._stop.set()

    def observe(self, lag: float) -> None:
        lag = max(0.0, lag)
        self.m_last.set(lag)
        self.m_lag.observe(lag)
        if lag > self.max_lag:
            self.max_lag = lag
            self.m_max.set(lag)
        sampled, self._sampled = self._sampled, None
        if lag > self.warn_s:
            log.warning("the event loop was held for %.3f s (every RPC and /healthz waited)%s", lag,
                        f"; it was in:\n{sampled}" if sampled else "")

    def _watch(self, loop_thread: int) -> None:
        """Thread: sample the loop thread's stack once per stall longer than warn_s, while it lasts."""
        reported = None
        while not self._stop.wait(self.interval_s):
            beat = self._beat
            held = time.monotonic() - beat - self.interval_s
            if held <= self.warn_s or reported == beat:
                continue
            reported = beat
            frame = sys._current_frames().get(loop_thread)
            if frame is None:
                continue
            self._sampled = "".join(traceback.format_stack(frame)[-STACK_FRAMES:]).rstrip()
            log.warning("the event loop has been held for %.2f s so far, in:\n%s", held, self._sampled)
