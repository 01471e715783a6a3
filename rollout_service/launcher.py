"""The service's side of being started by another process (die_with_parent), and a throwaway local Ray
cluster (tests, benchmarks). Starting the service as a child process: rollout_client.launcher."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from rollout_client.launcher import PARENT_ENV, free_port


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


class LocalRayCluster:
    """A throwaway single-node Ray cluster (tests, benchmarks): `ray start --head` on a free port with its
    own short temp dir, `ray stop --force` on exit. `address` is what `serve --ray-address` takes."""

    def __init__(self, num_cpus: int = 4, timeout: float = 120.0):
        self.num_cpus = num_cpus
        self.timeout = timeout
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.temp = Path(f"/tmp/rt{os.getpid()}")        # short: Ray's socket paths have a length limit
        self.ray = str(Path(sys.executable).parent / "ray")
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}

    def __enter__(self) -> "LocalRayCluster":
        subprocess.run([self.ray, "start", "--head", f"--port={self.port}", f"--num-cpus={self.num_cpus}",
                        "--include-dashboard=false", f"--temp-dir={self.temp}", "--disable-usage-stats"],
                       check=True, env=self.env, timeout=self.timeout, capture_output=True)
        return self

    def __exit__(self, *exc) -> None:
        subprocess.run([self.ray, "stop", "--force"], env=self.env, timeout=self.timeout, capture_output=True,
                       check=False)
        import shutil

        shutil.rmtree(self.temp, ignore_errors=True)
