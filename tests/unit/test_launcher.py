"""launcher.die_with_parent: a service started by ServiceProcess ends when the process that started it is
SIGKILLed (no orphaned service holding engines), and refuses to start when that process is already gone.
rollout_client.launcher.run_command: a `rollout-service` tool's output passes through, its last line (the
directory it prepared) is returned."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from rollout_client import launcher
from rollout_client.launcher import PARENT_ENV

CHILD = "from rollout_service.launcher import die_with_parent; die_with_parent(); import time; time.sleep(120)"


def test_child_gets_sigterm_when_its_parent_is_killed():
    parent_code = textwrap.dedent(f"""
        import os, subprocess, sys, time
        env = {{**os.environ, {PARENT_ENV!r}: str(os.getpid())}}
        child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], env=env)
        print(child.pid, flush=True)
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(parent.stdout.readline()))
    time.sleep(2.0)                                  # the child armed PR_SET_PDEATHSIG (imports take ~1 s)
    assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 20
    while child.is_running() and child.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, "child outlived its parent"


def test_child_whose_parent_is_already_gone_exits():
    env = {**os.environ, PARENT_ENV: "1" if os.getppid() != 1 else "999999"}    # not our parent
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode != 0 and "is gone" in r.stderr


def test_run_command_passes_output_through_and_returns_the_last_line(tmp_path, monkeypatch, capsys):
    tool = tmp_path / "rollout-service"
    tool.write_text('#!/bin/sh\necho "preparing $1"\necho\necho /cache/$1\n[ "$1" != fail ]\n')
    tool.chmod(0o755)
    monkeypatch.setattr(launcher, "service_command", lambda: str(tool))
    assert launcher.run_command("prepare-model") == "/cache/prepare-model"
    assert capsys.readouterr().out == "preparing prepare-model\n\n"
    with pytest.raises(subprocess.CalledProcessError):
        launcher.run_command("fail")
