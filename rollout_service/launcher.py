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


PARENT_ENV = "ROLLOUT_SERVICE_PARENT_PID"


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServiceProcess:
    def __init__(self, model: str, *, extra_args: list[str] | None = None, log_path: str | Path | None = None,
                 env: dict | None = None, startup_timeout: float = 600.0, http_token: str | None = None,
                 tls_ca: str | None = None, client_cert: tuple[str, str] | None = None):
        """http_token: bearer token for the readiness probe; tls_ca / client_cert (cert, key): when the service
        serves TLS (mutual TLS)."""
        self.grpc_port = free_port()
        self.http_port = free_port()
        self.target = f"127.0.0.1:{self.grpc_port}"
        self.http = f"{'https' if tls_ca else 'http'}://127.0.0.1:{self.http_port}"
        self.http_token = http_token
        self.ssl_context = None
        if tls_ca:
            import ssl

            self.ssl_context = ssl.create_default_context(cafile=tls_ca)
            self.ssl_context.check_hostname = False      # the probe dials 127.0.0.1; the chain is still verified
            if client_cert:
                self.ssl_context.load_cert_chain(*client_cert)
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
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                     env={**self.env, PARENT_ENV: str(os.getpid())})
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

    def http_get(self, path: str, token: str | None = None) -> tuple[int, str]:
        """(status, body) of GET path; token defaults to http_token. (0, "") when nothing answers."""
        token = token if token is not None else self.http_token
        req = urllib.request.Request(self.http + path, headers={"Authorization": f"Bearer {token}"} if token else {})
        try:
            with urllib.request.urlopen(req, timeout=5, context=self.ssl_context) as r:
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
