"""SIGTERM with streams in flight: they end UNAVAILABLE with a clear message, the process exits 0 and
leaves no engine process behind. Runs its own service (the shared one must outlive every test)."""
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import grpc
import psutil

from rollout_client import RolloutClient
from rollout_client.launcher import ServiceProcess
from tests.integration.conftest import SERVICE_ARGS


def test_sigterm_ends_streams_unavailable_and_leaves_no_orphans(tiny_model, tmp_path):
    svc = ServiceProcess(str(tiny_model), extra_args=SERVICE_ARGS, log_path=tmp_path / "svc.log").start()
    children = psutil.Process(svc.proc.pid).children(recursive=True)
    assert children, "vLLM's engine core should run in a child process"
    staging = [base / f"rollout-service-{svc.proc.pid}" for base in (Path("/dev/shm"), Path(tempfile.gettempdir()))]
    assert any(p.is_dir() for p in staging), "the server keeps weight pushes in a staging folder"
    errors = []

    def stream():
        with RolloutClient(svc.target) as c:
            try:
                list(c.generate([[1, 2, 3]] * 2, n=2, max_tokens=450, ignore_eos=True))
            except grpc.RpcError as e:
                errors.append(e)

    t = threading.Thread(target=stream)
    t.start()
    with RolloutClient(svc.target) as c:
        deadline = time.monotonic() + 20
        while c.status().queue_depth < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
    svc.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert svc.proc.wait(60) == 0
    assert len(errors) == 1 and errors[0].code() == grpc.StatusCode.UNAVAILABLE, errors
    assert "shutting down" in errors[0].details()
    deadline = time.monotonic() + 30
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [p.pid for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"engine processes left behind: {alive}"
    assert not any(p.exists() for p in staging), "the staging folder (RAM on /dev/shm) outlived the server"
    assert os.path.exists(tmp_path / "svc.log")
