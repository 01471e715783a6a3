"""engine/lifeline.py: a process tree below a "server" dies within seconds of the server's SIGKILL (real
processes, no vLLM: the server marks itself and starts a child, whose child arms the lifeline as a vLLM
worker does when it imports worker_ext)."""
import os
import signal
import subprocess
import sys
import textwrap
import time

# server -> engine core (never imports the lifeline, like vLLM's EngineCore) -> worker (arms it)
WORKER = "import time; from rollout_service.engine import lifeline; time.sleep(60)"
CORE = textwrap.dedent(f"""
    import subprocess, sys, time
    w = subprocess.Popen([sys.executable, "-c", {WORKER!r}])
    print(w.pid, flush=True); time.sleep(60)""")
SERVER = textwrap.dedent(f"""
    import subprocess, sys, time
    from rollout_service.engine import lifeline
    lifeline.mark_front_end()
    core = subprocess.Popen([sys.executable, "-c", {CORE!r}], stdout=subprocess.PIPE, text=True)
    print(core.pid, core.stdout.readline().strip(), flush=True); time.sleep(60)""")


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_engine_processes_die_with_a_sigkilled_server():
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUT_SERVICE_FRONT_END"}
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True, env=env)
    core, worker = (int(p) for p in server.stdout.readline().split())
    time.sleep(1.0)                                   # the worker imported the lifeline
    assert not gone(core) and not gone(worker)
    server.send_signal(signal.SIGKILL)
    server.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not (gone(core) and gone(worker)):
        time.sleep(0.1)
    assert gone(core) and gone(worker), "engine processes outlived the server"

