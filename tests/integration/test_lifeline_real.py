"""A real service (vLLM engine core forked from the fork server, its worker) SIGKILLed while the machine is busy:
every process it started, the fork server included, is gone within 10 s (engine/lifeline.py, engine/forkserver.py;
tests/unit/test_lifeline_busy.py covers the same without vLLM, and an engine core still starting)."""
import os
import signal
import subprocess
import sys
import time

import psutil

from tests.integration.services import running_service


def test_engines_and_the_fork_server_die_within_10_s_of_a_sigkilled_server_on_a_busy_machine(tiny_model, tmp_path):
    with running_service(tiny_model, tmp_path / "service.log", clean_exit=False) as svc:
        procs = psutil.Process(svc.proc.pid).children(recursive=True)
        names = {p.pid: " ".join(p.cmdline())[:80] for p in procs}
        assert any("forkserver" in n for n in names.values()), names
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(4 * (os.cpu_count() or 2))]
        try:
            time.sleep(1.0)
            svc.proc.send_signal(signal.SIGKILL)
            svc.proc.wait()
            t = time.monotonic()
            alive = procs
            while alive and time.monotonic() - t < 10:
                time.sleep(0.2)
                alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            assert not alive, f"outlived the server by 10 s: {[names[p.pid] for p in alive]}"
        finally:
            for h in hogs:
                h.kill()
                h.wait()
            for p in procs:
                try:
                    p.kill()
                except psutil.Error:
                    pass
