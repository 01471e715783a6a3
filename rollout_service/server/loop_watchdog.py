"""Event-loop lag: how long the server's asyncio loop was held by one callback (a blocking call on it stalls
every RPC and /healthz at once).

A task sleeps INTERVAL_S at a time and measures how late it wakes (the lag); /metrics exports the last lag,
the largest since the server became ready, and a histogram. A watchdog thread notices a loop held longer
than `warn_s` while it is still held, samples the loop thread's stack (sys._current_frames) and logs it,
so the warning names the code holding the loop even if it never returns (a read blocked forever).

Time the loop thread spent runnable but waiting for a CPU is the machine's, not this process's code's: Linux counts
it per thread (/proc/thread-self/schedstat, the run-queue wait), and the loop subtracts it from each lag before it
counts towards `rollout_event_loop_held_max_seconds`, the process's own holds. CI failed once on a 0.51 s "hold"
sampled inside a prometheus Gauge.set, which takes microseconds: the loop thread had been preempted there on a
loaded 2-core machine. Where schedstat is missing, a stall in which the loop sat idle in its selector and no other
thread ran is still recognised from the stacks as the machine's.

Garbage collection holds the loop too (it holds the GIL): a full collection of the front end's start-up heap
(about 680,000 objects once vLLM, torch and gRPC are imported) took 0.35-0.41 s here and failed CI's 0.5 s
limit under load. `freeze_startup_heap` moves that heap out of the collector's reach once the engines are up,
as vLLM's EngineCore does for its own process; the watchdog times every collection, exports them and names
them in its warning, so a stall caused by the collector says so."""
from __future__ import annotations

import asyncio
import gc
import logging
import os
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


class RunQueueWait:
    """Seconds the calling thread has spent runnable but waiting for a CPU, read from the kernel's scheduler
    statistics (a procfs read, no disk: microseconds). Create it on the thread to measure; `None` from `read`
    where the kernel does not expose them."""

    def __init__(self):
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def read(self) -> float | None:
        if self._fd is None:
            return None
        try:
            return int(os.pread(self._fd, 128, 0).split()[1]) / 1e9     # on-CPU ns, run-queue wait ns, slices
        except (OSError, IndexError, ValueError):
            return None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class LoopWatchdog:
    def __init__(self, registry: CollectorRegistry, *, interval_s: float = INTERVAL_S, warn_s: float = WARN_S,
                 run_queue_wait=RunQueueWait):
        self.interval_s = interval_s
        self._run_queue_wait = run_queue_wait   # made on the loop thread by run(): the clock of its CPU waits
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
                            "another of its threads holding the GIL) since the server became ready; the time the "
                            "loop thread waited for a CPU (the machine overloaded) is not counted", registry=registry)
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
        clock = self._run_queue_wait()
        try:
            waited = clock.read()
            while True:
                t0 = self._beat = time.monotonic()
                await asyncio.sleep(self.interval_s)
                lag = time.monotonic() - t0 - self.interval_s
                before, waited = waited, clock.read()
                self.observe(lag, None if before is None or waited is None else waited - before)
        finally:
            self._stop.set()
            gc.callbacks.remove(self._on_gc)
            clock.close()

    def observe(self, lag: float, cpu_wait: float | None = None) -> None:
        """One beat: `lag` seconds late, `cpu_wait` of the interval spent by the loop thread waiting for a CPU
        (None: not known)."""
        lag = max(0.0, lag)
        self.m_last.set(lag)
        self.m_lag.observe(lag)
        if lag > self.max_lag:
            self.max_lag = lag
            self.m_max.set(lag)
        sampled, self._sampled = self._sampled, None
        starved, self._starved = self._starved, False
        collecting, self._gc_held = self._gc_held, 0.0
        if cpu_wait is not None:
            held = max(0.0, lag - cpu_wait)
        else:
            held = 0.0 if starved else lag
        if held > self.max_held:
            self.max_held = held
            self.m_held.set(held)
        if lag > self.warn_s:
            machine = lag - held
            log.warning("the event loop was held for %.3f s (every RPC and /healthz waited)%s%s%s", lag,
                        f", {collecting:.3f} s of it collecting garbage" if collecting > 0.01 else "",
                        f"; for {machine:.3f} s of it the loop thread was waiting for a CPU (the machine is "
                        "overloaded: that part is not this process's)" if machine > 0.02 else "",
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
