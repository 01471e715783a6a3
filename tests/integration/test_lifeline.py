"""A SIGKILLed server leaves no engine process behind: every process of its tree, recorded once it was ready
(vLLM's EngineCore, its worker, multiprocessing's resource tracker), is gone within 10 s."""
import signal
import time

import psutil

from tests.integration.services import running_service


def remaining(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {p.name()}")
        except psutil.NoSuchProcess:
            pass
    return out


def test_engine_processes_die_with_a_sigkilled_server(tiny_model, tmp_path):
    with running_service(tiny_model, tmp_path / "svc.log", clean_exit=False) as svc:
        tree = psutil.Process(svc.proc.pid).children(recursive=True)
        try:
            names = [p.name() for p in tree]
            assert any("EngineCore" in n for n in names), names
            svc.proc.send_signal(signal.SIGKILL)
            svc.proc.wait(10)
            t0 = time.monotonic()
            while remaining(tree) and time.monotonic() - t0 < 10:
                time.sleep(0.1)
            left = remaining(tree)
            assert not left, f"still running 10 s after the server's SIGKILL: {left}"
            print(f"{len(tree)} processes under the server ({', '.join(names)}): all gone "
                  f"{time.monotonic() - t0:.1f} s after it was reaped")
        finally:
            for p in tree:                               # never leave anything behind, pass or fail
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
