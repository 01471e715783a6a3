"""The service's side of being started by another process (die_with_parent). Starting the service as a child
process: rollout_client.launcher."""
from __future__ import annotations

import os
import signal
import sys

from rollout_client.launcher import PARENT_ENV


def die_with_parent() -> None:
    """Called first thing in a service started by ServiceProcess: SIGTERM this process when the parent that
    started it dies (Linux PR_SET_PDEATHSIG), so a trainer or test killed with SIGKILL never leaves a service
    and its engines running. If the parent is already gone, exit. The signal follows the thread that started
    the child, so start services from a long-lived thread (the main one).

    The child arms this itself rather than in a preexec_fn: a preexec_fn makes subprocess fork() and run the
    parent's Python at-fork hooks in the child, and gRPC's (the parent is a trainer or a test with live gRPC
    channels) sometimes aborted the child before it reached exec (SIGABRT, "epoll_wait error: Bad file
    descriptor")."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None or sys.platform != "linux":
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)     # PR_SET_PDEATHSIG = 1
    if os.getppid() != int(parent):                                   # died before the line above
        raise SystemExit(f"rollout-service: the process that started it ({parent}) is gone")
