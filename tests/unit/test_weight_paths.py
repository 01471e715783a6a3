"""LoadWeights paths: only regular files inside security.weights_roots, read off the event loop under the
request's deadline (fake engines; the files and special files are real)."""
import asyncio
import os
import socket
import threading
import time

import grpc
import pytest
import torch
from safetensors.torch import save_file

from tests.fake_engine import FakeEngine
from rollout_service.errors import ServiceError
from rollout_service.pool.pool import EnginePool
from rollout_service.weights import service as service_mod
from rollout_service.weights.paths import check_path, resolve_roots, weight_files
from rollout_service.weights.service import WeightService


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "root"
    r.mkdir()
    save_file({"a.weight": torch.full((4, 3), 2.0)}, str(r / "model.safetensors"))
    return r


def refusal(fn) -> ServiceError:
    with pytest.raises(ServiceError) as e:
        fn()
    return e.value


def test_special_files_named_safetensors_are_refused_naming_them(root):
    roots = resolve_roots([str(root)])
    d = root / "special"
    d.mkdir()
    os.mkfifo(d / "x.safetensors")
    err = refusal(lambda: weight_files(str(d), roots))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "x.safetensors" in err.message and "FIFO" in err.message
    err = refusal(lambda: weight_files(str(d / "x.safetensors"), roots))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "FIFO" in err.message
    os.unlink(d / "x.safetensors")
    (d / "y.safetensors").mkdir()
    err = refusal(lambda: weight_files(str(d), roots))
    assert "y.safetensors" in err.message and "directory" in err.message
    os.rmdir(d / "y.safetensors")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(d / "z.safetensors"))
        err = refusal(lambda: weight_files(str(d), roots))
        assert "z.safetensors" in err.message and "socket" in err.message
    os.unlink(d / "z.safetensors")
    os.symlink("/dev/zero", d / "w.safetensors")        # inside the roots only by name
    err = refusal(lambda: weight_files(str(d), roots))
    assert err.code == grpc.StatusCode.PERMISSION_DENIED and "/dev/zero" in err.message


def test_devices_are_refused_when_a_root_allows_them(tmp_path):
    err = refusal(lambda: weight_files("/dev/zero", resolve_roots(["/dev"])))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "character device" in err.message


def test_paths_outside_the_roots_are_permission_denied_naming_the_option(root, tmp_path):
    roots = resolve_roots([str(root)])
    outside = tmp_path / "outside.safetensors"
    save_file({"a.weight": torch.zeros(4, 3)}, str(outside))
    os.symlink(outside, root / "link.safetensors")
    for path in ("/etc/passwd", "/proc/self/environ", str(outside), str(root / "link.safetensors"),
                 str(root / ".." / "outside.safetensors"), "/"):
        err = refusal(lambda p=path: check_path(p, roots))
        assert err.code == grpc.StatusCode.PERMISSION_DENIED, path
        assert "security.weights_roots" in err.message and "--weights-root" in err.message
    err = refusal(lambda: weight_files(str(root), roots))        # the directory holds the link
    assert err.code == grpc.StatusCode.PERMISSION_DENIED and "link.safetensors" in err.message
    os.unlink(root / "link.safetensors")
    assert weight_files(str(root), roots) == [root.resolve() / "model.safetensors"]
    os.symlink(root, tmp_path / "alias")                         # a link into a root is fine
    assert weight_files(str(tmp_path / "alias"), roots) == [root.resolve() / "model.safetensors"]


@pytest.mark.parametrize("path,words", [("", "empty"), ("/x\0y", "NUL"), ("/" + "a" * 5000, "characters long"),
                                        ("relative/model", "absolute")])
def test_malformed_paths_are_invalid_argument(root, path, words):
    err = refusal(lambda: check_path(path, resolve_roots([str(root)])))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and words in err.message


def _service(tmp_path, roots):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    save_file({"a.weight": torch.zeros(4, 3)}, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text("{}")
    pool = EnginePool([FakeEngine("e0")], max_queue=10, checkpoints={"policy": ckpt})
    return pool, WeightService.create(pool, "float32", weights_roots=roots)


def test_load_reads_off_the_loop_and_a_timed_out_load_changes_nothing(root, tmp_path, monkeypatch):
    release = threading.Event()
    real = service_mod.weight_files

    def stalled(path, roots):               # a read stuck on a stalled filesystem
        release.wait(10)
        return real(path, roots)
    monkeypatch.setattr(service_mod, "weight_files", stalled)

    async def main():
        pool, svc = _service(tmp_path, [str(root)])
        await pool.start()
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)
        t = asyncio.create_task(ticker())
        t0 = time.monotonic()
        with pytest.raises(ServiceError) as e:
            await svc.load(str(root), 1, "policy", "wait", partial=True, timeout=0.3)
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and "deadline" in e.value.message
        assert time.monotonic() - t0 < 2 and ticks >= 10          # the loop kept running meanwhile
        assert not pool.push_lock.locked() and pool.policy_version == 0
        task = asyncio.create_task(svc.load(str(root), 1, "policy", "wait", partial=True))
        await asyncio.sleep(0.1)
        task.cancel()                                              # a client that went away
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not pool.push_lock.locked() and pool.policy_version == 0
        release.set()
        out = await svc.load(str(root), 1, "policy", "wait", partial=True)
        assert out.version == 1 and pool.policy_version == 1
        t.cancel()
    asyncio.run(main())


def test_load_refuses_a_fifo_without_blocking(root, tmp_path):
    async def main():
        pool, svc = _service(tmp_path, [str(root)])
        await pool.start()
        os.mkfifo(root / "a.safetensors")        # sorts before model.safetensors
        with pytest.raises(ServiceError) as e:
            await asyncio.wait_for(svc.load(str(root), 1, "policy", "wait", partial=True), 5)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "a.safetensors" in e.value.message
        with pytest.raises(ServiceError) as e:
            await svc.load("/etc/hostname", 1, "policy", "wait", partial=True)
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert pool.policy_version == 0
    asyncio.run(main())
