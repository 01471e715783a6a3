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


# The service's orphans come to the helper (a child subreaper) which reaps nothing before it looks: what a container
# init that does not reap would leave behind as zombies.
HELPER = """
import ctypes, json, os, sys, time
import psutil
from rollout_client.launcher import ServiceProcess
from tests.integration.services import SERVICE_ARGS
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)                                  # PR_SET_CHILD_SUBREAPER
svc = ServiceProcess(sys.argv[1], extra_args=SERVICE_ARGS, log_path=sys.argv[2])
svc.start()
procs = psutil.Process(svc.proc.pid).children(recursive=True)
code = svc.stop()                                                         # SIGTERM, then wait for the exit
time.sleep(3.0)
left = {}
for p in procs:
    try:
        left[p.pid] = (p.status(), " ".join(p.cmdline())[:60])
    except psutil.Error:
        pass
print(json.dumps({"code": code, "children": len(procs), "left": left}), flush=True)
for p in procs:
    try:
        p.kill()
    except psutil.Error:
        pass
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
"""


def test_no_zombie_is_left_after_sigterm(tiny_model, tmp_path):
    import json

    out = subprocess.run([sys.executable, "-c", HELPER, str(tiny_model), str(tmp_path / "service.log")],
                         capture_output=True, text=True, timeout=300, cwd=os.getcwd())
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["code"] == 0 and result["children"] >= 2, result
    assert not result["left"], f"left after SIGTERM (Z: a zombie nobody reaped): {result['left']}"
