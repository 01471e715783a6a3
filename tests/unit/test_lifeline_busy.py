"""Engine processes and the fork server end with the front end on a busy machine, and leave no zombie behind.

Real processes, no vLLM: a "server" marks itself for the lifeline and starts an engine core the way
engine/forkserver.py does (a fork server, the engine core forked from it), and the engine core starts a worker that
arms the lifeline as a vLLM worker does when it imports worker_ext. Busy processes (four per core) run beside them."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.unit.test_lifeline import gone

WORKER = "import time; from rollout_service.engine import lifeline; time.sleep(120)"
SERVER = textwrap.dedent(f"""
    import os, signal, subprocess, sys, time
    from rollout_service.engine import forkserver      # (the engine core imports this script: not the lifeline)

    def core(q):
        if os.environ.get("NO_WORKER"):      # an engine core still starting: no worker has armed a lifeline yet
            q.put(os.getpid())
            time.sleep(120)
        w = subprocess.Popen([sys.executable, "-c", {WORKER!r}])

        def stop(*_):            # vLLM's engine core on SIGTERM: its workers end first
            w.kill()
            w.wait()
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        q.put(w.pid)
        time.sleep(120)

    if __name__ == "__main__":
        from rollout_service.engine import lifeline

        forkserver.PRELOAD[:] = ["rollout_service.engine.forkserver"]      # no vLLM import in this test
        lifeline.mark_front_end()
        ctx = forkserver.context()
        q = ctx.SimpleQueue()
        p = ctx.Process(target=core, args=(q,))
        p.start()
        worker = q.get()
        from multiprocessing import forkserver as fs
        print(fs._forkserver._forkserver_pid, p.pid, worker, flush=True)

        def stop(*_):            # what the server does on SIGTERM: its engines shut down, then it exits
            p.terminate()
            p.join()
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        time.sleep(120)
""")


def busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def start_server(tmp_path, **extra_env):
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUT_SERVICE_FRONT_END"} | extra_env
    env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")
    server = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    line = server.stdout.readline()
    assert line, "the server did not start its engine"
    return server, [int(p) for p in line.split()]


@pytest.mark.skipif(sys.platform != "linux", reason="the lifeline is Linux only")
@pytest.mark.parametrize("starting", [False, True], ids=["serving", "starting"])
def test_engines_and_the_fork_server_die_within_10_s_of_a_sigkilled_server_on_a_busy_machine(tmp_path, starting):
    """starting: the engine core has no worker yet (vLLM's start-up, 35-50 s here), so no lifeline is armed: the
    kernel ends it with the fork server (PR_SET_PDEATHSIG)."""
    server, pids = start_server(tmp_path, **({"NO_WORKER": "1"} if starting else {}))  # fork server, core, worker
    time.sleep(1.0)                                     # the worker armed its lifeline
    hogs = busy(4 * (os.cpu_count() or 2))
    try:
        time.sleep(1.0)
        assert not any(gone(p) for p in pids)
        server.send_signal(signal.SIGKILL)
        server.wait()
        t = time.monotonic()
        while time.monotonic() - t < 10 and not all(gone(p) for p in pids):
            time.sleep(0.1)
        left = [p for p in pids if not gone(p)]
        assert not left, f"{left} of (fork server, engine core, worker) {pids} outlived the server by 10 s"
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass


# The orphans of the server come to the helper (a child subreaper), which never reaps them before it looks: what a
# container's init that does not reap would leave as zombies.
HELPER = textwrap.dedent("""
    import ctypes, os, signal, subprocess, sys, time
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)                     # PR_SET_CHILD_SUBREAPER
    server = subprocess.Popen([sys.executable, sys.argv[1]], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in server.stdout.readline().split()]
    time.sleep(1.0)
    server.send_signal(signal.SIGTERM)
    server.wait()
    time.sleep(3.0)
    states = {}
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                states[p] = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            pass
    print(server.returncode, states, flush=True)
    print(pids, file=sys.stderr, flush=True)
    for p in pids:                                                # now reap and end whatever is left
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    while True:
        try:
            os.wait()
        except ChildProcessError:
            break
""")


@pytest.mark.skipif(sys.platform != "linux", reason="subreapers are Linux only")
def test_no_zombie_is_left_after_sigterm(tmp_path):
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    helper = tmp_path / "helper.py"
    helper.write_text(HELPER)
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUT_SERVICE_FRONT_END"}
    env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, str(helper), str(script)], capture_output=True, text=True, env=env,
                         timeout=60)
    returncode, states = out.stdout.split(" ", 1)
    assert returncode == "0", out.stdout + out.stderr
    assert states.strip() == "{}", (f"left after SIGTERM (pid: state; Z is a zombie) of (fork server, engine core, "
                                    f"worker) {out.stderr}: {states}")
