"""Event-loop lag: how long the server's asyncio loop was held by one callback (a blocking call on it stalls
every RPC and /healthz at once).

A task sleeps INTERVAL_S at a time and measures how late it wakes (the lag); /metrics exports the last lag,
the largest since the server became ready, and a histogram. A watchdog thread notices a loop held longer
than `warn_s` while it is still held, samples the loop thread's stack (sys._current_frames) and logs it,
so the warning names the code holding the loop even if it never returns (a read blocked forever). A stall in which
the loop sat idle in its selector and no other thread ran is the machine's (the process waited for a CPU): it is
measured and logged as such, and left out of `rollout_event_loop_held_max_seconds`, the process's own holds.

Garbage collection holds the loop too (it holds the GIL): a full collection of the front end's start-up heap
(about 680,000 objects once vLLM, torch and gRPC are imported) took 0.35-0.41 s here and failed CI's 0.5 s
limit under load. `freeze_startup_heap` moves that heap out of the collector's reach once the engines are up,
as vLLM's EngineCore does for its own process; the watchdog times every collection, exports them and names
them in its warning, so a stall caused by the collector says so."""
from __future__ import annotations

import asyncio
import gc
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


def freeze_startup_heap() -> float:
    """Collect once, then move every object alive now to the permanent generation: later collections walk
    only what serving allocates. Call after start-up, before the server reports SERVING (the collection
    itself takes about as long as the pause it prevents). Returns the seconds it took."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    return time.perf_counter() - t0


class LoopWatchdog:
    def __init__(self, registry: CollectorRegistry, *, interval_s: float = INTERVAL_S, warn_s: float = WARN_S):
        self.interval_s = interval_s
        self.warn_s = warn_s
        self.max_lag = 0.0
        self.max_held = 0.0                     # the longest stall that this process's own work caused
        self._beat = time.monotonic()           # when the loop last went to sleep on the timer
        self._sampled: str | None = None        # the loop thread's stack, sampled during the current stall
        self._starved = False                   # ... and the loop was idle with no thread of ours running
        self._stop = threading.Event()
        self._gc_started: float | None = None
        self._gc_held = 0.0                     # seconds spent collecting garbage since the last beat
        self.m_last = Gauge("rollout_event_loop_lag_last_seconds",
                            "How late the event loop last woke a 50 ms timer", registry=registry)
        self.m_max = Gauge("rollout_event_loop_lag_max_seconds",
                           "Longest the event loop was held since the server became ready", registry=registry)
        self.m_held = Gauge("rollout_event_loop_held_max_seconds",
                            "Longest the event loop was held by this process's own work (code on the loop, or "
                            "another of its threads holding the GIL) since the server became ready; stalls where "
                            "the loop was idle and none of its threads ran (the process waited for a CPU) are not "
                            "counted", registry=registry)
        self.m_lag = Histogram("rollout_event_loop_lag_seconds", "How late the event loop woke a 50 ms timer",
                               buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
                               registry=registry)
        self.m_gc = Histogram("rollout_gc_pause_seconds", "Garbage collections in the front end (they hold the "
                              "event loop)", ["generation"], buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1),
                              registry=registry)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            took = time.perf_counter() - self._gc_started
            self._gc_started = None
            self._gc_held += took
            self.m_gc.labels(str(info.get("generation", "?"))).observe(took)

    async def run(self) -> None:
        """Measure until cancelled; call from the loop to watch."""
        loop_thread = threading.get_ident()
        watcher = threading.Thread(target=self._watch, args=(loop_thread,), name="loop-watchdog", daemon=True)
        watcher.start()
        gc.callbacks.append(self._on_gc)
        try:
            while True:
                t0 = self._beat = time.monotonic()
                await asyncio.sleep(self.interval_s)
                self.observe(time.monotonic() - t0 - self.interval_s)
        finally:
            self._stop.set()
            gc.callbacks.remove(self._on_gc)

    def observe(self, lag: float) -> None:
        lag = max(0.0, lag)
        self.m_last.set(lag)
        self.m_lag.observe(lag)
        if lag > self.max_lag:
            self.max_lag = lag
            self.m_max.set(lag)
        sampled, self._sampled = self._sampled, None
        starved, self._starved = self._starved, False
        collecting, self._gc_held = self._gc_held, 0.0
        if lag > self.max_held and not starved:
            self.max_held = lag
            self.m_held.set(lag)
        if lag > self.warn_s:
            log.warning("the event loop was held for %.3f s (every RPC and /healthz waited)%s%s%s", lag,
                        f", {collecting:.3f} s of it collecting garbage" if collecting > 0.01 else "",
                        "; the loop was idle and no thread of this process was running: it waited for a CPU "
                        "(the machine is overloaded), no code here held it" if starved else "",
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
            frames = sys._current_frames()
            frame = frames.pop(loop_thread, None)
            if frame is None:
                continue
            busy = _busy_threads(frames)
            self._starved = starved(frame, busy)
            self._sampled = "".join(traceback.format_stack(frame)[-STACK_FRAMES:]).rstrip() + busy
            log.warning("the event loop has been held for %.2f s so far, in:\n%s", held, self._sampled)


IDLE_FILES = ("threading.py", "queue.py", "selectors.py", "thread.py")   # where idle threads wait


def _running(f) -> bool:
    """Whether a thread whose top frame is `f` is running (not waiting). A pool worker's own `run` frame on top
    means it is inside a C function it was given (which may keep the GIL)."""
    if f.f_code.co_filename.endswith("thread.py") and f.f_code.co_name == "run":
        return True
    return not f.f_code.co_filename.endswith(IDLE_FILES)


def _busy_threads(frames: dict) -> str:
    """The other threads that are not waiting: when the loop's own stack is idle code (asyncio's run_once),
    the loop was waiting for the GIL, and the thread that held it (a C call that keeps the GIL, in a worker
    thread) is among these."""
    me = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    busy = [f"\n  thread {names.get(tid, tid)}:\n" + "".join(traceback.format_stack(f)[-3:]).rstrip()
            for tid, f in frames.items() if tid != me and _running(f)]
    return ("\n other threads running:" + "".join(busy)) if busy else ""


def starved(loop_frame, busy: str) -> bool:
    """A stall in which the loop sat in its selector, due to wake, and no other thread of this process was running:
    nothing here held it; the process was not given a CPU (an overloaded machine), which no code change fixes."""
    return loop_frame.f_code.co_filename.endswith("selectors.py") and not busy
