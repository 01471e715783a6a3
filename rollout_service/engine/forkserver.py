"""The engine core started from a fork server that has vLLM imported already (patch cpu_engine_forkserver).

vLLM's CPU platform starts its engine core by spawn: every engine start, restart and scale-out imports torch and
vLLM afresh in a new interpreter (~8 s of a ~13 s start on 2 cores). Here the first engine start of a process
starts Python's fork server (`multiprocessing.forkserver`, itself a fresh interpreter, so nothing of the caller's
threads or OpenMP state is inherited) with vLLM's engine core imported, and every engine core is forked from it.
Importing torch runs no OpenMP region, so the fork hazard that makes vLLM spawn on CPU is absent, as it is for the
worker the engine core forks (cpu_worker_fork).

A fork server's children inherit the environment the server started with, not the caller's at start(): vLLM
sets variables around each start (platforms/cpu.py, numa_utils.configure_subprocess) and the server marks
itself for the lifeline (engine/lifeline.py). So each engine process carries the caller's environment as it is
at start() and installs it first thing (`_run_with_environment`), which is what spawn gives it.
"""
from __future__ import annotations

import atexit
import ctypes
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import signal
import sys

# Imported first in the fork server (PRELOAD), whose parent is the front end: the lifeline is armed there too, so the
# fork server and everything forked from it are SIGKILLed the moment the front end is gone (an exiting fork server
# with torch and vLLM imported took over 10 s to finalize on a busy machine).
from rollout_service.engine import lifeline

PRELOAD = ["rollout_service.engine.forkserver", "vllm.v1.engine.core"]
ROOT_ENV = "ROLLOUT_ENGINE_ROOT"      # the engine core's pid: engine/lifeline.py's root below the fork server
PR_SET_PDEATHSIG = 1


def _run_with_environment(environ: dict, target, args: tuple, kwargs: dict):
    _let_go_of_the_front_end()
    _die_with_fork_server()
    try:        # setproctitle (vLLM names its processes) finds its room next to the C environment: before changing it
        import setproctitle

        setproctitle.getproctitle()
    except ImportError:
        pass
    os.environ.clear()
    os.environ.update(environ)
    os.environ[ROOT_ENV] = str(os.getpid())
    from rollout_service.engine.patches import install_config_patches

    install_config_patches()             # before vLLM re-checks its config in the handshake
    lifeline.rearm()                     # forked from the fork server's image: its own watch, rooted here
    return target(*args, **kwargs)


def _let_go_of_the_front_end() -> None:
    """Python hands every process forked from the fork server a copy of the front end's end of the pipe whose closing
    tells the fork server to exit (for nested use, which engine processes never make). Held here it kept the fork
    server, and with it every engine, alive after the front end died; closed, the front end's death ends the fork
    server at once."""
    server = multiprocessing.forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        server._forkserver_alive_fd = None
        try:
            os.close(fd)
        except OSError:
            pass


def _die_with_fork_server() -> None:
    """The kernel SIGKILLs this engine process when the fork server exits, which it does as soon as the front end is
    gone (SIGKILL included): no Python thread has to be scheduled for it, however busy the machine. The fork server
    forks from its only thread, so PR_SET_PDEATHSIG fires on its exit and on nothing else."""
    if sys.platform != "linux":
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:            # the fork server died before the request took effect
        os._exit(1)


def stop() -> None:
    """Stop this process's fork server and reap it (registered at exit): a fork server orphaned by an exiting front end
    ends anyway, but where nobody reaps orphans (a container's init that does not) it would stay a zombie."""
    server = multiprocessing.forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) is None:
        return
    try:
        server._stop()
    except (OSError, ChildProcessError):
        pass


class EngineProcess(multiprocessing.context.ForkServerProcess):
    """A process forked from the fork server that runs with the caller's environment as of start()."""

    def start(self) -> None:
        self._args = (dict(os.environ), self._target, tuple(self._args), dict(self._kwargs))
        self._kwargs = {}
        self._target = _run_with_environment
        super().start()


class EngineContext(multiprocessing.context.ForkServerContext):
    Process = EngineProcess


_context: EngineContext | None = None


def context() -> EngineContext:
    """vLLM's get_mp_context() for starting engine cores (installed by patches.cpu_engine_forkserver)."""
    global _context
    if _context is None:
        multiprocessing.forkserver.set_forkserver_preload(PRELOAD)
        _context = EngineContext()
        atexit.register(stop)
    return _context
