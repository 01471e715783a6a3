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

`rollout-service serve` starts the fork server before it imports vLLM itself (`prestart`): the two imports overlap.
"""
from __future__ import annotations

import atexit
import ctypes
import logging
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import signal
import sys
import threading

# Imported first in the fork server (PRELOAD), whose parent is the front end: the lifeline is armed there too, so the
# fork server and everything forked from it are SIGKILLed the moment the front end is gone (an exiting fork server
# with torch and vLLM imported took over 10 s to finalize on a busy machine).
from rollout_service.engine import lifeline

PRELOAD = ["rollout_service.engine.forkserver", "vllm.v1.engine.core"]
ROOT_ENV = "ROLLOUT_ENGINE_ROOT"      # the engine core's pid: engine/lifeline.py's root below the fork server
PR_SET_PDEATHSIG = 1
log = logging.getLogger(__name__)


_child_setup: list = []      # functions every engine process runs before its target (run_in_children)


def run_in_children(setup) -> None:
    """Have every engine process started from here call `setup()` (a module-level function: it travels pickled)
    once its environment is installed, before its target: patches.cpu_engine_forkserver passes the registry's config
    patches, which vLLM's handshake needs. Given, not imported: this module stays below the patch registry."""
    if setup not in _child_setup:
        _child_setup.append(setup)


def _run_with_environment(environ: dict, setup: tuple, target, args: tuple, kwargs: dict):
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
    for fn in setup:                     # the registry's config patches: before vLLM re-checks its config
        fn()
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
    """Stop this process's fork server and reap it (registered at exit). It is killed: it holds nothing to finalize
    (the engines forked from it are shut down by then, and any left die with it), and its interpreter's orderly exit,
    torch and vLLM imported, took 2.8 s on 2 cores that every exiting front end waited for (0.1 s killed). Reaped: where
    nobody reaps orphans (a container's init that does not) it would stay a zombie."""
    server = multiprocessing.forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        server._stop()
    except (OSError, ChildProcessError):
        pass


_prestarted: dict[str, str] | None = None     # the environment a prestarted fork server got that matters, until used
_prestart_lock = threading.Lock()


def prestart(tensor_parallel_size: int) -> bool:
    """Start the fork server now, in a process that will start its engines here and has not imported vLLM yet, where
    they will take it (the caller asks patches.forkserver_expected first): its import of vLLM's engine core (~13 s on
    2 cores) then runs beside this process's own import of vLLM (5-10 s), where it used to follow it at the first
    engine start. False where it is not started.

    A fork server's interpreter starts with the environment of the moment, so it is made what the first engine start
    would give it: the CPU environment (cpu_env.prepare_cpu_environment: LD_PRELOAD acts only when an interpreter
    starts) and the lifeline's mark, set here as the engine sets them, and what vLLM's CPU platform adds before it
    starts an engine (cpu_env.cpu_platform_environment), given to the fork server only. The first engine start
    compares that with its own environment and starts a fresh fork server where it differs (`_check_prestarted`)."""
    global _prestarted
    from rollout_service.engine.cpu_env import (cpu_platform_environment, extra_environment,
                                                prepare_cpu_environment)
    prepare_cpu_environment()
    lifeline.mark_front_end()
    engine_env = cpu_platform_environment(tensor_parallel_size)
    if engine_env is None:
        return False
    context()
    with _prestart_lock, extra_environment(engine_env):
        multiprocessing.forkserver.ensure_running()
        _prestarted = {k: os.environ.get(k, "") for k in {"LD_PRELOAD", lifeline.ENV, *engine_env}}
    log.info("engine fork server started (pid %d): it imports vLLM's engine core while this process starts",
             multiprocessing.forkserver._forkserver._forkserver_pid)
    return True


def _check_prestarted() -> None:
    """At the first engine start after `prestart`: a prestarted fork server whose environment is not the one this
    start would have given it is stopped; Python's forkserver then starts a fresh one as it would have without it."""
    global _prestarted
    with _prestart_lock:
        if _prestarted is None:
            return
        differ = sorted(k for k, v in _prestarted.items() if os.environ.get(k, "") != v)
        if differ:
            log.warning("the engine fork server started before vLLM was imported has another %s than this engine "
                        "start: starting a fresh one (~10 s more)", ", ".join(differ))
            stop()
        _prestarted = None


def release_if_unused() -> None:
    """Once this process's engines are up: a fork server prestarted for them that none was started from (they did not
    take cpu_engine_forkserver after all) is stopped, with a warning."""
    global _prestarted
    with _prestart_lock:
        if _prestarted is not None:
            log.warning("the engine fork server started early was not used by the engines (cpu_engine_forkserver "
                        "did not apply): stopped")
            stop()
            _prestarted = None


class EngineProcess(multiprocessing.context.ForkServerProcess):
    """A process forked from the fork server that runs with the caller's environment as of start()."""

    def start(self) -> None:
        _check_prestarted()
        self._args = (dict(os.environ), tuple(_child_setup), self._target, tuple(self._args), dict(self._kwargs))
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
