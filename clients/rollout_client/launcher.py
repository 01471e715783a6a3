"""Run the service's console command from a trainer, a test or a benchmark: `serve` as a child process (free
ports, wait until ready, SIGTERM on exit; readiness is the real thing, the HTTP /readyz answering 200) and the
one-shot tools (`prepare-model`, `prepare-drafter`, which print the directory they prepared). Standard library
only; the command itself comes with the service (`pip install rollout-service`)."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

# ServiceProcess sets it to its pid; the service then ends with this process (rollout_service.launcher).
PARENT_ENV = "ROLLOUT_SERVICE_PARENT_PID"
# How often start() asks /readyz (a refused connection or a 503 costs well under a millisecond): every start waited
# half of it on average past the moment the service became ready.
READY_POLL_S = 0.05


def service_command() -> str:
    """The `rollout-service` console script: beside this interpreter (a venv's bin/), else on PATH."""
    here = Path(sys.executable).parent / "rollout-service"
    found = str(here) if here.is_file() else shutil.which("rollout-service")
    if found is None:
        raise FileNotFoundError("the `rollout-service` command is neither beside this Python nor on PATH "
                                "(pip install rollout-service)")
    return found


def run_command(*args: str) -> str:
    """Run `rollout-service ARGS` to its end with its output passed through, and return the last line it
    printed (the prepare-* commands print the directory they prepared). CalledProcessError if it failed."""
    with subprocess.Popen([service_command(), *args], stdout=subprocess.PIPE, text=True) as proc:
        last = None
        try:
            for line in proc.stdout:
                if last is not None:
                    print(last, end="", flush=True)
                last = line
        except BaseException:          # Ctrl-C, SIGTERM: the tool does not outlive its caller
            proc.kill()
            raise
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, proc.args)
    return (last or "").strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServiceProcess:
    """`rollout-service serve --model MODEL` on free loopback ports (`target` for the client, `http` for the
    HTTP port), a child that ends with this process. A context manager: started and ready on entry, stopped on
    exit."""

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
        cmd = [service_command(), "serve", "--model", self.model,
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
            time.sleep(READY_POLL_S)
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
