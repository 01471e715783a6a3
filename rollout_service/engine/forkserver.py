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

import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os

PRELOAD = ["rollout_service.engine.forkserver", "vllm.v1.engine.core"]
ROOT_ENV = "ROLLOUT_ENGINE_ROOT"      # the engine core's pid: engine/lifeline.py's root below the fork server


def _run_with_environment(environ: dict, target, args: tuple, kwargs: dict):
    try:        # setproctitle (vLLM names its processes) finds its room next to the C environment: before changing it
        import setproctitle

        setproctitle.getproctitle()
    except ImportError:
        pass
    os.environ.clear()
    os.environ.update(environ)
    os.environ[ROOT_ENV] = str(os.getpid())
    return target(*args, **kwargs)


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
    return _context
