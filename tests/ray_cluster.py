"""A throwaway single-node Ray cluster for tests and benchmarks."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rollout_client.launcher import free_port


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
        # Ray's memory monitor kills actors once the machine's used memory passes its threshold (0.95 by default):
        # beside another pytest-xdist worker's engines that is a test's engine killed, not a fault of the service;
        # the kernel's OOM killer stays the backstop. The object store is kept small: no test puts large objects.
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_memory_usage_threshold": "0.99"}

    def __enter__(self) -> "LocalRayCluster":
        subprocess.run([self.ray, "start", "--head", f"--port={self.port}", f"--num-cpus={self.num_cpus}",
                        "--include-dashboard=false", f"--temp-dir={self.temp}", "--disable-usage-stats",
                        f"--object-store-memory={256 << 20}"],
                       check=True, env=self.env, timeout=self.timeout, capture_output=True)
        return self

    def __exit__(self, *exc) -> None:
        subprocess.run([self.ray, "stop", "--force"], env=self.env, timeout=self.timeout, capture_output=True,
                       check=False)
        import shutil

        shutil.rmtree(self.temp, ignore_errors=True)
