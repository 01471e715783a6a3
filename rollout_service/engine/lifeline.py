"""Engine processes end with the server that started them, however it ends (SIGKILL included).

The server marks itself in the environment its engine processes inherit (`mark_front_end`). Every vLLM
worker imports this module (engine/worker_ext.py), which starts a thread polling that process; once it is
gone, the thread SIGKILLs the worker's engine: its topmost ancestor below the server (vLLM's EngineCore),
everything under that, and itself. vLLM's EngineCore does not watch its parent (only its workers watch
EngineCore), so a SIGKILLed server used to leave EngineCore and its workers running, re-parented to init.

PR_SET_PDEATHSIG is not used here: it fires when the parent *thread* exits, and AsyncLLM starts EngineCore
from a worker thread of the server's executor (an engine core forked from engine/forkserver.py does use it: the fork
server forks from its only thread). The thread here waits on a pidfd of the server, so the kernel wakes it at the
server's exit: no polling interval to wait out on a busy machine. Linux only (/proc); elsewhere this does nothing.
"""
from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time

ENV = "ROLLOUT_SERVICE_FRONT_END"      # "pid:start time" of the process whose engines these are
POLL_S = 0.5
_armed = False


def _stat(pid: int) -> tuple[str, int, str] | None:
    """(state, parent pid, start time) of `pid` from /proc, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2:].split()      # after the command name, which may hold spaces
    return fields[0].decode(), int(fields[1]), fields[19].decode()


def mark_front_end() -> None:
    """Called by the process that starts engines (the server; a Ray actor hosting an engine): engine
    processes started from here on die with this process."""
    if sys.platform == "linux":
        os.environ[ENV] = f"{os.getpid()}:{_stat(os.getpid())[2]}"


def _alive(pid: int, start: str) -> bool:
    st = _stat(pid)
    return st is not None and st[2] == start and st[0] not in ("Z", "X")     # a zombie is dead


def _engine_root(front_end: int) -> int:
    """This process's engine core: the one engine/forkserver.py marked (its parent is the fork server, which
    outlives no front end but may outlive an engine), else the ancestor whose parent is the front end (itself if
    none is found)."""
    marked = os.environ.get("ROLLOUT_ENGINE_ROOT", "")
    if marked.isdigit() and _stat(int(marked)) is not None:
        return int(marked)
    pid = os.getpid()
    while True:
        st = _stat(pid)
        if st is None or st[1] <= 1:
            return os.getpid()
        if st[1] == front_end:
            return pid
        pid = st[1]


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                children.setdefault(st[1], []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _wait_for_exit(pid: int, start: str) -> None:
    """Return once `pid` (started at `start`) is gone: blocked on a pidfd (woken by the kernel at its exit, nothing to
    poll, however busy the machine), else polling /proc."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    try:
        if fd is not None and _alive(pid, start):         # the pidfd is that process's, not a reuse of its pid
            select.select([fd], [], [])
        while _alive(pid, start):
            time.sleep(POLL_S)
    finally:
        if fd is not None:
            os.close(fd)


def _watch(front_end: int, start: str, root: int) -> None:
    _wait_for_exit(front_end, start)
    me = os.getpid()
    for pid in _descendants(root):             # the root first: it stops starting new processes
        if pid != me:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    os.kill(me, signal.SIGKILL)


def arm() -> None:
    """Start the watch in this process if a front end is marked and this process is not it (once)."""
    global _armed
    value = os.environ.get(ENV, "")
    if _armed or sys.platform != "linux" or ":" not in value:
        return
    pid, start = value.split(":", 1)
    if int(pid) == os.getpid():
        return
    _armed = True
    if not _alive(int(pid), start):            # gone before we got here
        _watch(int(pid), start, _engine_root(int(pid)))
    threading.Thread(target=_watch, args=(int(pid), start, _engine_root(int(pid))), name="rollout-lifeline",
                     daemon=True).start()


def rearm() -> None:
    """In a process forked from an armed one (threads are not inherited): start this process's own watch."""
    global _armed
    _armed = False
    arm()


arm()
