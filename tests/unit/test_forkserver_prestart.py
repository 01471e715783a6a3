"""The engine fork server started before vLLM is imported (engine/forkserver.prestart, `rollout-service serve`): only
where the engines will take it (patches.forkserver_expected), with the environment the first engine start would give
it, reused by that start, replaced where the environment turned out otherwise, stopped when no engine used it.

Real processes, no vLLM: the fork server preloads only engine/forkserver.py here."""
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from rollout_service.engine import cpu_env, patches

SCRIPT = textwrap.dedent("""
    import json, logging, os, sys, time
    from rollout_service.engine import cpu_env, forkserver

    def core(q):
        q.put([os.getppid(), os.environ.get("ROLLOUT_TEST_PLATFORM")])

    def server_environ(pid):
        deadline = time.monotonic() + 60
        while b"forkserver" not in open(f"/proc/{pid}/cmdline", "rb").read():     # exec'd
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(x.decode().split("=", 1) for x in f.read().split(b"\\0") if b"=" in x)

    if __name__ == "__main__":
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="LOG %(message)s")
        forkserver.PRELOAD[:] = ["rollout_service.engine.forkserver"]      # no vLLM import in this test
        cpu_env.cpu_platform_environment = lambda tp: {"ROLLOUT_TEST_PLATFORM": f"tp{tp}"}
        mode = sys.argv[1]
        out = {"started": forkserver.prestart(2), "pid": os.getpid()}
        from multiprocessing import forkserver as fs
        pid = out["server"] = fs._forkserver._forkserver_pid
        env = server_environ(pid)
        out["server_env"] = [env.get("ROLLOUT_TEST_PLATFORM"), env.get("ROLLOUT_SERVICE_FRONT_END"),
                             env.get("VLLM_CPU_KVCACHE_SPACE")]
        out["caller_env"] = [os.environ.get("ROLLOUT_TEST_PLATFORM"), os.environ.get("ROLLOUT_SERVICE_FRONT_END")]
        if mode == "unused":
            forkserver.release_if_unused()
            time.sleep(0.2)
            out["server_after"] = fs._forkserver._forkserver_pid
            out["alive"] = os.path.exists(f"/proc/{pid}")
        else:
            os.environ["ROLLOUT_TEST_PLATFORM"] = "tp2" if mode == "same" else "tp4"   # what vLLM set meanwhile
            ctx = forkserver.context()
            q = ctx.SimpleQueue()
            p = ctx.Process(target=core, args=(q,))
            p.start()
            out["engine"] = q.get()
            p.join()
            out["old_alive"] = os.path.exists(f"/proc/{pid}")
        print(json.dumps(out), flush=True)
""")


def run(tmp_path, mode: str) -> tuple[dict, str]:
    script = tmp_path / "server.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if k not in ("ROLLOUT_SERVICE_FRONT_END", "ROLLOUT_TEST_PLATFORM", "VLLM_CPU_KVCACHE_SPACE")}
    env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    return json.loads(lines[-1]), "\n".join(lines[:-1])


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_the_first_engine_is_forked_from_the_prestarted_fork_server_with_the_callers_environment(tmp_path):
    out, log = run(tmp_path, "same")
    assert out["started"]
    # the fork server started with the CPU environment, the lifeline's mark and vLLM's platform variables; the
    # caller got the first two, not the platform's (vLLM sets them itself)
    platform, front_end, kv = out["server_env"]
    assert platform == "tp2" and kv is None, out        # the KV size is an engine argument
    assert front_end.startswith(f"{out['pid']}:") and front_end == out["caller_env"][1], out
    assert out["caller_env"][0] is None
    assert out["engine"] == [out["server"], "tp2"], out                 # forked from it, the caller's environment
    assert "fresh one" not in log


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_prestarted_fork_server_with_another_environment_is_replaced(tmp_path):
    out, log = run(tmp_path, "other")
    assert out["engine"][0] != out["server"] and out["engine"][1] == "tp4", out
    assert not out["old_alive"]
    assert "has another ROLLOUT_TEST_PLATFORM than this engine start: starting a fresh one" in log, log


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_an_unused_prestarted_fork_server_is_stopped(tmp_path):
    out, log = run(tmp_path, "unused")
    assert out["started"] and out["server_after"] is None and not out["alive"], out
    assert "was not used by the engines" in log, log


@pytest.mark.parametrize("dists, env, expected", [
    ({"vllm-cpu": "0.32.0"}, {}, True),                               # the CPU build installed here
    ({"vllm": "0.32.0+cpu"}, {}, False),                              # a CPU build of an unverified version
    ({"vllm": "0.32.0"}, {}, False),                                  # a GPU build: vLLM picks CUDA
    ({"vllm": "0.32.0"}, {"VLLM_TARGET_DEVICE": "cpu"}, True),        # ... unless told CPU
    ({"vllm-cpu": "0.33.0"}, {}, False),                              # not verified there
    ({"vllm-cpu": "0.32.0"}, {"ROLLOUT_DISABLE_ENGINE_FORKSERVER": "1"}, False),
    ({}, {}, False),                                                  # no vLLM
])
def test_the_fork_server_is_expected_where_the_patch_will_apply(monkeypatch, dists, env, expected):
    def version(name):
        if name not in dists:
            raise importlib.metadata.PackageNotFoundError(name)
        return dists[name]
    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])
    for var in ("VLLM_TARGET_DEVICE", "ROLLOUT_DISABLE_ENGINE_FORKSERVER"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert patches.forkserver_expected() is expected


def test_another_platform_plugin_means_no_fork_server(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.32.0")
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: ["a plugin"])
    monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    assert not patches.forkserver_expected()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="no vLLM installed")
def test_cpu_platform_environment_is_known_only_with_an_openmp_runtime_preloaded(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/x/libiomp5.so")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    env = cpu_env.cpu_platform_environment(2)
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn" and env["NUMEXPR_MAX_THREADS"] == "2"
    assert env["LOCAL_WORLD_SIZE"] == "2" and env["TORCHINDUCTOR_CPP_DYNAMIC_THREADS"] == "1"
    monkeypatch.setenv("LD_PRELOAD", "")          # vLLM would add PyTorch's libgomp: not known here
    assert cpu_env.cpu_platform_environment(2) is None
