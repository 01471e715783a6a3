"""Run `rollout-service serve` as a child process (demo, tests, benchmarks): free ports, wait until
ready, SIGTERM on exit. Readiness is the real thing: the HTTP /readyz answering 200."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServiceProcess:
    def __init__(self, model: str, *, extra_args: list[str] | None = None, log_path: str | Path | None = None,
                 env: dict | None = None, startup_timeout: float = 600.0):
        self.grpc_port = free_port()
        self.http_port = free_port()
        self.target = f"127.0.0.1:{self.grpc_port}"
        self.http = f"http://127.0.0.1:{self.http_port}"
        self.model = model
        self.extra_args = extra_args or []
        self.log_path = Path(log_path) if log_path else None
        self.env = {**os.environ, **(env or {})}
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ServiceProcess":
        cmd = [sys.executable, "-m", "rollout_service.cli", "serve", "--model", self.model,
               "--grpc-port", str(self.grpc_port), "--http-port", str(self.http_port), *self.extra_args]
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rollout-service exited with code {self.proc.returncode} during start-up"
                                   + (f"; see {self.log_path}" if self.log_path else ""))
            if self.http_get("/readyz")[0] == 200:
                return self
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"rollout-service not ready after {self.startup_timeout:.0f} s")

    def http_get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.http + path, timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except OSError:
            return 0, ""

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> "ServiceProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
